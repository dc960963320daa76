"""FedCDR: federated Douglas–Rachford splitting with client reshuffling (Algorithm 1 of the FedCDR paper)."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field
import torch

from fedshuffle.aggregation import Aggregator
from fedshuffle.core.registry import Example, StepSize
from fedshuffle.local.plan import CohortPlan
from fedshuffle.local.prox import SOLVERS, ClientObjectives, solve_prox
from fedshuffle.metrics import metric
from fedshuffle.methods.base import METHODS, ClientResult, Method, Trainer, sample_gradients

#: The stream key offset of FedCDR's initialization solves, so that they never reuse a round's data order.
INIT_ROUND_OFFSET = 1 << 40
FORMS = ("y", "x")
#: "prox": Algorithm 1, line 3 (x̂_i⁰ = 2 prox_{ηf_i}(x⁰) − x⁰); "lazy": x̂_i counted as x⁰ until its first round
INITS = ("prox", "lazy")

metric(
    "prox_residual",
    "mean prox residual ‖∇f_i(x_i) + (x_i − y_i)/η‖",
    lambda e: e.extras.get("prox_residual"),
    kind="method",
)


class FedCDR(Method):
    """FedCDR (Algorithm 1): Douglas–Rachford splitting with client reshuffling.

    Client i keeps (y_i, x_i, x̂_i). When it takes part in round r with server model x:

        y_i ← y_i + α(x − x_i),   x_i ← prox_{ηf_i}(y_i),   x̂_i ← 2x_i − y_i,   g_i = x̂_i(new) − x̂_i(old),

    and the server takes x ← x + Σ_{i∈S} w_i g_i (w_i = 1/n in the paper), which keeps x = Σ_i w_i x̂_i.

    Choices where the paper is ambiguous:

    * **y update:** Algorithm 1 (line 8) and its proofs (Lemma A.2, eq. (21)) update y_i ← y_i + α(x − x_i);
      the derivation's (14) writes x_i + α(x − x_i). We follow Algorithm 1 (``form = "y"``), whose fixed
      point is x* for any heterogeneity; ``form = "x"`` gives (14).
    * **Initialization** (``initialization``): ``"prox"`` is Algorithm 1, lines 2–3: y_i⁰ = x⁰, x_i⁰ = prox_{ηf_i}(x⁰),
      x̂_i⁰ = 2x_i⁰ − x⁰ and the server at x⁰. Lemma A.1 (y_i = x_i + η∇f_i(x_i)) then holds from the start, but
      the server's x − (1/n)Σx̂_i = 2η·(1/n)Σ∇f_i(x_i⁰) stays constant, so the limit satisfies
      ∇f(x) = 2·(1/n)Σ∇f_i(x_i⁰) rather than ∇f(x) = 0 (eq. (23) assumes the offset is 0; eq. (45) assumes
      x_i⁰ = x⁰). ``"lazy"`` counts x̂_i = x⁰ until the client's first round (x_i, y_i as in Algorithm 1), which
      keeps x = (1/n)Σx̂_i, hence the fixed point ∇f = 0, and costs nothing for never-seen clients. We default to
      ``"lazy"``: the text says server and clients start "at the same point x⁰", which only the lazy start keeps.
      Both create a client's state at its first participation; prox_{ηf_i}(x⁰) is the same then as up front.
    * **The prox** (``prox_solver``): the closed form where the problem has one (:meth:`Problem.prox`: quadratics,
      with ``exact_prox``); else, by default, ``"sgd"``: the local solver's SGD epochs on
      f_i(z) + ‖z − y_i‖²/(2η), as §6.1 runs every method ("we use the same local solver (SGD) for all
      algorithms and perform local updates for 20 epochs"; the presets: 20 epochs of batch 10, the public
      FedDR code's setup). It starts from the client's previous x_i (``warm_start``, the default): the paper
      does not say; the FedDR code keeps each client's model between its rounds and trains it further, and
      a warm start makes the inexact prox improve over the rounds. A client's first prox (x_i⁰ = prox(x⁰))
      starts at x⁰. ``"lbfgs"`` (an ablation): L-BFGS on the client's full data until
      ‖∇f_i(z) + (z − y_i)/η‖ ≤ ``prox_tol`` or ``prox_max_iter`` iterations (:mod:`fedshuffle.local.prox`);
      ``warm_start = false`` starts either solver from the prox center y_i.
      Each round reports the mean prox residual ‖∇f_i(x_i) + (x_i − y_i)/η‖ of the cohort (``prox_residual``);
      when ηL < 1 the subproblem is (1/η − L)-strongly convex and ‖x_i − prox(y_i)‖ ≤ η·residual/(1 − ηL).
    """

    name = "fedcdr"
    state_fields = ("y", "x", "xhat")
    local_model_field = "x"  # scored by fedshuffle.metrics.local_model_scores
    needs_cycles = True
    sets_own_prox = True
    plain_local_steps = False

    def __init__(
        self,
        aggregator: Aggregator,
        alpha: Annotated[float, Field(gt=0, lt=2, description="relaxation α ∈ (0, 2)"), StepSize()] = 1.0,
        eta: Annotated[float, Field(gt=0, description="prox step η > 0"), StepSize()] = 1.0,
        form: Annotated[Literal[FORMS], Field(description="y update of Algorithm 1 ('y') or eq. (14) ('x')")] = "y",
        exact_prox: Annotated[bool, Field(description="closed-form prox where the problem has one")] = True,
        warm_start: Annotated[
            bool, Field(description="start the inner prox solver from the previous x_i (default) or, false, from y_i")
        ] = True,
        initialization: Annotated[
            Literal[INITS],
            Field(description="x̂_i⁰ = 2prox(x⁰) − x⁰ (Algorithm 1, 'prox') or x⁰ until first seen ('lazy')"),
        ] = "lazy",
        prox_solver: Annotated[
            Literal[SOLVERS],
            Field(description="the local SGD epochs (default, §6.1), or L-BFGS on the full client data to prox_tol"),
        ] = "sgd",
        prox_tol: Annotated[
            float, Field(gt=0, description="L-BFGS stops at ‖∇f_i(z) + (z − y_i)/η‖ ≤ prox_tol")
        ] = 1e-4,
        prox_max_iter: Annotated[int, Field(ge=1, description="L-BFGS iteration cap per prox")] = 500,
    ) -> None:
        super().__init__(aggregator)
        self.alpha, self.eta, self.form, self.exact_prox, self.warm_start = alpha, eta, form, exact_prox, warm_start
        self.initialization = initialization
        self.prox_solver = prox_solver
        self.prox_tol = prox_tol
        self.prox_max_iter = prox_max_iter

    def init(self, params):
        return {"x0": params.clone()}

    def configure(self, rnd, params, state):
        broadcast = {"model": params}
        if rnd.first_time.any():
            broadcast["initial"] = state["x0"]
        return broadcast

    def _prox(
        self, trainer: Trainer, centers: torch.Tensor, clients: np.ndarray, plans, starts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """prox_{ηf_i}(center_i) for each client (the inner solver from ``starts``, default the centers), and the
        work spent."""
        exact = trainer.problem.prox(centers, trainer.data, clients, self.eta) if self.exact_prox else None
        if exact is not None:
            return exact, 0
        if self.prox_solver == "lbfgs":
            objectives = ClientObjectives(trainer.problem, trainer.data, clients, centers.device)
            solution = solve_prox(objectives, centers, self.eta, self.prox_tol, self.prox_max_iter, starts)
            return solution.points, solution.sample_gradients
        starts = centers if starts is None else starts
        deltas = trainer.train(plans, starts, center=centers, prox_mu=1.0 / self.eta)
        return starts - deltas, sample_gradients(plans)

    def client_update(self, broadcast, plans, rows, trainer):
        clients = CohortPlan.of(plans).clients
        y, x_i, xhat = rows["y"].clone(), rows["x"].clone(), rows["xhat"].clone()
        new = ~rows["created"].to(torch.bool)
        spent = 0
        if bool(new.any()):
            x0 = broadcast["initial"]
            fresh = clients[new.cpu().numpy()]
            starts = x0.expand(len(fresh), -1)
            x_first, spent = self._prox(
                trainer, starts, fresh, trainer.plan(fresh, INIT_ROUND_OFFSET + trainer.round_index)
            )
            y[new], x_i[new] = starts, x_first
            xhat[new] = (
                2 * x_first - starts if self.initialization == "prox" else starts
            )  # "lazy": x̂ counted as x⁰ by the server until now
        base = y if self.form == "y" else x_i
        y_new = base + self.alpha * (broadcast["model"] - x_i)
        x_new, cost = self._prox(trainer, y_new, clients, plans, x_i if self.warm_start else None)
        xhat_new = 2 * x_new - y_new
        residual = trainer.gradients(x_new, clients) + (x_new - y_new) / self.eta  # a diagnostic: not counted as cost
        extras = {"prox_residual": float(residual.norm(dim=1).mean())}
        return ClientResult(
            {"delta": xhat - xhat_new}, {"y": y_new, "x": x_new, "xhat": xhat_new}, spent + cost, extras
        )

    server_needs_only_sum = True  # d = Σ_S w_iΔ_i (:meth:`aggregate`): a secure sum may stand in for the Δ_i

    def sum_weights(self, rnd):
        return rnd.objective_weights[rnd.cohort]

    def aggregate(self, rnd, params, state, payload):
        """x ← x + Σ_S w_i g_i, sent as d = Σ_S w_i(x̂_i^old − x̂_i^new) to the server optimizer.

        With the default server step (SGD, step 1) this keeps x = Σ_i w_i x̂_i; another server optimizer
        (momentum, Adam) runs, but gives up that invariant."""
        if len(rnd.cohort) == 0:
            return torch.zeros_like(params), state, {}
        if "delta_sum" in payload:  # the sum, already formed (a secure aggregation's)
            return payload["delta_sum"], state, {}
        return rnd.member_weights(params) @ payload["delta"], state, {}

    def extra_passes(self) -> int:
        """The L-BFGS prox's: two solves (a new client's first prox and the round's), each of at most
        1 + 40·``prox_max_iter`` evaluations (:func:`~fedshuffle.local.prox.solve_prox`'s 40 halvings per iteration)."""
        return 2 * (1 + 40 * self.prox_max_iter)

    def describe(self):
        return f"fedcdr (α = {self.alpha}, η = {self.eta}, init {self.initialization}, prox {self.prox_solver})"


METHODS.add(
    "fedcdr",
    FedCDR,
    "Douglas–Rachford splitting with client reshuffling; each client keeps (y_i, x_i, x̂_i)",
    "Mitigating Data Heterogeneity Effect in Federated Learning with Client Reshuffling (FedCDR; anonymous ICML "
    "submission), Algorithm 1",
    local={"order": "reshuffle", "epochs": 20, "batch_size": 10},
    example=Example(),
)
