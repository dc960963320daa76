"""Methods whose clients keep state between rounds: SCAFFOLD and FedCDR.

Each is a part of an :class:`~fedshuffle.algorithms.Algorithm` that replaces the round's local work:
it reads and writes its clients' rows in a :class:`~fedshuffle.state.ClientStateStore` (created at
first participation), keeps its server-side vectors in ``server`` (checkpointed with the run), runs
the local work through the executor, and returns the aggregated direction d (x ← x − d, or the
server optimizer on d) with what the round cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.local.plan import ClientPlan, LocalRule, LocalSolver
from fedshuffle.state import ClientStateStore

#: The stream key offset of FedCDR's initialization solves, so that they never reuse a round's data order.
INIT_ROUND_OFFSET = 1 << 40


@dataclass
class RoundContext:
    """What a stateful method needs from the simulation for one round."""

    problem: Any
    data: Any
    executor: Any
    params: torch.Tensor
    cohort: np.ndarray
    plans: list[ClientPlan]
    rule: LocalRule
    local: LocalSolver
    round_index: int
    seed: int
    lr_scale: float
    store: ClientStateStore
    server: dict[str, torch.Tensor]
    aggregation_weights: Callable[[list[ClientPlan]], np.ndarray]


@dataclass
class RoundWork:
    direction: torch.Tensor
    sample_gradients: int
    models_up: int  # per cohort member
    models_down: int
    extras: dict[str, float] = field(default_factory=dict)


def _last_occurrence(cohort: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each client (a client sampled twice keeps its last update)."""
    _, first_in_reversed = np.unique(cohort[::-1], return_index=True)
    return np.sort(len(cohort) - 1 - first_in_reversed)


@dataclass(frozen=True)
class Scaffold:
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1), control variates option I or II.

    Clients step y ← y − η_l(g_i(y) − c_i + c) and return Δy_i; then c_i⁺ = ∇f_i(x) (option I, one
    full local gradient) or c_i − c + (x − y_i)/(Kη_l) (option II), Δc_i = c_i⁺ − c_i. The server takes
    the method's aggregation of Δy_i and c ← c + Σ_{i∈S} w_iΔc_i, which keeps c = Σ_i w_i c_i (the
    paper's (|S|/N)·mean_S Δc_i for uniform weights). Clients upload Δy_i and Δc_i, and download x and c.
    """

    option: str = "II"

    def __post_init__(self) -> None:
        if self.option not in ("I", "II"):
            raise ConfigError("algorithm.scaffold_option", f"unknown option {self.option!r}; accepted: I, II")

    def fields(self, dim: int) -> dict[str, int]:
        return {"control": dim}

    def init(self, params: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"control": torch.zeros_like(params)}

    def run(self, ctx: RoundContext) -> RoundWork:
        c = ctx.server["control"]
        own = ctx.store.get("control", ctx.cohort, ctx.params.device).to(ctx.params.dtype)
        plans = [replace(p, offset=c - own[k]) for k, p in enumerate(ctx.plans)]
        deltas = ctx.executor.run(ctx.problem, ctx.data, ctx.params, plans, ctx.rule)
        omega = torch.as_tensor(ctx.aggregation_weights(plans), dtype=deltas.dtype, device=deltas.device)
        extra = 0
        if self.option == "I":
            updated = ctx.executor.client_gradients(ctx.problem, ctx.data, ctx.params, ctx.cohort)
            extra = int(ctx.data.sizes[ctx.cohort].sum())
        else:
            scale = torch.tensor([p.steps * p.lr for p in plans], dtype=deltas.dtype, device=deltas.device).unsqueeze(1)
            updated = own - c + deltas / scale
        keep = _last_occurrence(ctx.cohort)
        weights = torch.as_tensor(ctx.data.weights[ctx.cohort[keep]], dtype=deltas.dtype, device=deltas.device)
        ctx.server["control"] = c + weights @ (updated[keep] - own[keep])
        ctx.store.set("control", ctx.cohort[keep], updated[keep])
        return RoundWork(omega @ deltas, sum(p.sample_gradients for p in plans) + extra, models_up=2, models_down=2)


@dataclass(frozen=True)
class FedCDR:
    """FedCDR (001, Algorithm 1): Douglas–Rachford splitting with client reshuffling.

    Client i keeps (y_i, x_i, x̂_i). When it takes part in round r with server model x:

        y_i ← y_i + α(x − x_i),   x_i ← prox_{ηf_i}(y_i),   x̂_i ← 2x_i − y_i,   g_i = x̂_i(new) − x̂_i(old),

    and the server takes x ← x + Σ_{i∈S} w_i g_i (w_i = 1/n in the paper), which keeps x = Σ_i w_i x̂_i.

    Choices where the paper is ambiguous:

    * **y update:** Algorithm 1 (line 8) and its proofs (Lemma A.2, eq. (21)) update y_i ← y_i + α(x − x_i);
      the derivation's (14) writes x_i + α(x − x_i). We follow Algorithm 1 (``form = "y"``), whose fixed
      point is x* for any heterogeneity; ``form = "x"`` gives (14).
    * **Prox:** prox_{ηf_i} as in Algorithm 1; (12) shows it is the i-th block of (14)'s prox_{nηf}.
    * **Initialization:** line 3 initializes every client up front (x_i = prox_{ηf_i}(x⁰), x̂_i = 2x_i − x⁰)
      but starts the server at x⁰, which breaks the invariant x = (1/n)Σx̂_i the analysis uses (eq. (23))
      unless ∇f_i(x⁰) = 0. We create a client's state at its first participation and count it as
      x̂_i = x⁰ until then, so the invariant holds from round 0 and never-seen clients cost nothing.
    * **The prox:** solved in closed form where the problem has one (:meth:`Problem.prox`: quadratics),
      otherwise by the local solver — SGD epochs on f_i(z) + ‖z − y_i‖²/(2η) (20 epochs in the paper),
      started from the prox center y_i (the paper does not say; ``warm_start`` starts from the previous x_i,
      which on the 001 synthetic MLP gave higher residuals and a higher loss after 40 rounds). Each round reports the mean prox residual ‖∇f_i(x_i) + (x_i − y_i)/η‖ of the cohort;
      since the subproblem is (1/η)-strongly convex, ‖x_i − prox(y_i)‖ ≤ η·residual.
    """

    alpha: float = 1.0
    eta: float = 1.0
    form: str = "y"
    exact_prox: bool = True
    warm_start: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 2:
            raise ConfigError("algorithm.fedcdr_alpha", f"the relaxation α must be in (0, 2), got {self.alpha}")
        if not self.eta > 0:
            raise ConfigError("algorithm.fedcdr_eta", f"the prox step η must be > 0, got {self.eta}")
        if self.form not in ("y", "x"):
            raise ConfigError("algorithm.fedcdr_form", f"unknown {self.form!r}; accepted: y (Algorithm 1), x (eq. (14))")

    def fields(self, dim: int) -> dict[str, int]:
        return {"y": dim, "x": dim, "xhat": dim}

    def init(self, params: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x0": params.clone()}

    def _prox(self, ctx: RoundContext, centers: torch.Tensor, clients: np.ndarray, round_key: int, starts: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """prox_{ηf_i}(center_i) for each client (the inner solver from ``starts``, default the centers), and the sample gradients spent."""
        exact = ctx.problem.prox(centers, ctx.data, clients, self.eta) if self.exact_prox else None
        if exact is not None:
            return exact, 0
        plans = ctx.local.plan(ctx.data.client_indices, clients, round_key, ctx.seed, ctx.lr_scale, ctx.data.sizes)
        starts = centers if starts is None else starts
        plans = [replace(p, start=starts[k], center=centers[k]) for k, p in enumerate(plans)]
        deltas = ctx.executor.run(ctx.problem, ctx.data, ctx.params, plans, ctx.rule)
        return starts - deltas, sum(p.sample_gradients for p in plans)

    def run(self, ctx: RoundContext) -> RoundWork:
        cohort = ctx.cohort[_last_occurrence(ctx.cohort)]
        x0 = ctx.server["x0"]
        y, x_i, xhat = (ctx.store.get(k, cohort, ctx.params.device).to(ctx.params.dtype) for k in ("y", "x", "xhat"))
        new = ~ctx.store.created[cohort]
        spent = 0
        if new.any():
            starts = x0.expand(int(new.sum()), -1)
            x_new0, cost = self._prox(ctx, starts, cohort[new], INIT_ROUND_OFFSET + ctx.round_index)
            mask = torch.from_numpy(new).to(ctx.params.device)
            y[mask], x_i[mask], xhat[mask] = starts, x_new0, x0  # x̂ counted as x⁰ by the server until now
            spent += cost
        base = y if self.form == "y" else x_i
        y_new = base + self.alpha * (ctx.params - x_i)
        x_new, cost = self._prox(ctx, y_new, cohort, ctx.round_index, x_i if self.warm_start else None)
        xhat_new = 2 * x_new - y_new
        weights = torch.as_tensor(ctx.data.weights[cohort], dtype=x_new.dtype, device=x_new.device)
        direction = -(weights @ (xhat_new - xhat))
        for name, value in (("y", y_new), ("x", x_new), ("xhat", xhat_new)):
            ctx.store.set(name, cohort, value)
        residual = ctx.executor.client_gradients(ctx.problem, ctx.data, x_new, cohort) + (x_new - y_new) / self.eta  # a diagnostic: not counted as cost
        spent += cost
        return RoundWork(direction, spent, models_up=1, models_down=1, extras={"prox_residual": float(residual.norm(dim=1).mean())})
