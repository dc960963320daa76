"""Server-side pieces with explicit state, in the (init, update) style of optax.

* Server optimizers turn the aggregated direction Δ = Σ ω_iΔ_i into a step: x ← x − step.
* :class:`GlobalMomentum` is FedShuffle's *global momentum* (eqs. (13)–(14)), which is not a server
  optimizer: the server keeps a momentum m^r and broadcasts it, and clients fold it into every
  local step (see :class:`fedshuffle.local.Drift`).

States are plain dicts of tensors so that a checkpoint can store them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .errors import ConfigError
from .local import ClientPlan, Drift

State = dict[str, torch.Tensor]


class ServerOptimizer(Protocol):
    """x ← x − step, with ``step, state = update(direction, state, params)``."""

    def init(self, params: torch.Tensor) -> State: ...

    def update(self, direction: torch.Tensor, state: State, params: torch.Tensor) -> tuple[torch.Tensor, State]: ...


def _check_lr(lr: float) -> None:
    if not lr > 0:
        raise ConfigError("algorithm.server_lr", f"server step size must be > 0, got {lr}")


@dataclass(frozen=True)
class ServerSGD:
    """x ← x − η_g·Δ (FedShuffle Algorithm 1, line 14)."""

    lr: float = 1.0

    def __post_init__(self) -> None:
        _check_lr(self.lr)

    def init(self, params):
        return {}

    def update(self, direction, state, params):
        return self.lr * direction, state


@dataclass(frozen=True)
class ServerHeavyBall:
    """Server ("slow") momentum: v ← βv + Δ (v = Δ on the first round), x ← x − η_g·v.

    This is FedAvgM / FedNova's ``gmf`` (Hsu et al. 2019; Wang et al. 2020 code). It differs from
    FedShuffle's global momentum, which acts inside local steps (:class:`GlobalMomentum`).
    """

    lr: float = 1.0
    beta: float = 0.9

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        if not 0 <= self.beta < 1:
            raise ConfigError("algorithm.server_momentum", f"must be in [0, 1), got {self.beta}")

    def init(self, params):
        return {"velocity": torch.zeros_like(params), "started": torch.tensor(False)}

    def update(self, direction, state, params):
        velocity = self.beta * state["velocity"] + direction if bool(state["started"]) else direction.clone()
        return self.lr * velocity, {"velocity": velocity, "started": torch.tensor(True)}


ClientGradients = Callable[[torch.Tensor, np.ndarray], torch.Tensor]


@dataclass(frozen=True)
class GlobalMomentum:
    """FedShuffle's global momentum with parameter β = 1 − a (the paper uses β = 0.9).

    ``estimator="exact"`` (FedShuffleMVR, eqs. (12)–(14)): at the start of round r the cohort sends
    full gradients at x^r and x^{r−1}, and

        m^r = a·Σ_S ω_i∇f_i(x^r) + (1−a)·m^{r−1} + (1−a)·Σ_S ω_i(∇f_i(x^r) − ∇f_i(x^{r−1})),

    with ω_i = w_i/p_i; clients step with d = ∇f_{iΠ}(y) + (1−a)(m^r − ∇f_{iΠ}(x^r)) (eq. (13)).
    We start from m^{−1} = 0 and x^{−1} = x^0, which the paper leaves open.

    ``estimator="approx"`` (Appendix F, real data): the last terms of (13)–(14) are dropped and
    ∇f_i(x^r) ≈ Δ_i/(τ_iη_i). Clients step with d = a∇f_{iΠ}(y) + (1−a)m, and after the round
    m ← Σ_S ω_iΔ_i/(τ_iη_i), which equals a·ĝ + (1−a)m for ĝ the estimate above. As in the reference
    code, round 0 (no momentum yet) runs plain local steps.
    """

    beta: float = 0.9
    estimator: str = "exact"

    def __post_init__(self) -> None:
        if not 0 < self.beta < 1:
            raise ConfigError("algorithm.global_momentum", f"must be in (0, 1), got {self.beta}")
        if self.estimator not in ("exact", "approx"):
            raise ConfigError("algorithm.momentum_estimator", f"unknown {self.estimator!r}; accepted: exact, approx")

    @property
    def a(self) -> float:
        return 1.0 - self.beta

    def init(self, params: torch.Tensor) -> State:
        return {"momentum": torch.zeros_like(params), "previous": params.clone(), "started": torch.tensor(False)}

    def broadcast(
        self, state: State, params: torch.Tensor, cohort: np.ndarray, unbiased: np.ndarray, client_gradients: ClientGradients
    ) -> tuple[Drift | None, State]:
        """The drift clients use this round; ``unbiased`` are ω_i = w_i/E[c_i] for the cohort."""
        if self.estimator == "approx":
            return (Drift(self.a, state["momentum"], False) if bool(state["started"]) else None), state
        m = (1 - self.a) * state["momentum"]
        if len(cohort):
            weights = torch.as_tensor(unbiased, dtype=params.dtype)
            now = weights @ client_gradients(params, cohort)
            before = weights @ client_gradients(state["previous"], cohort)
            m = m + self.a * now + (1 - self.a) * (now - before)
        state = {"momentum": m, "previous": params.clone(), "started": torch.tensor(True)}
        return Drift(self.a, m, True), state

    def collect(self, state: State, plans: Sequence[ClientPlan], deltas: torch.Tensor, unbiased: np.ndarray) -> State:
        """After the round (approx only): m ← Σ_S ω_iΔ_i/(τ_iη_i)."""
        if self.estimator != "approx" or not plans:
            return state
        scale = torch.as_tensor([u / (p.steps * p.lr) for u, p in zip(unbiased, plans)], dtype=deltas.dtype)
        return {**state, "momentum": scale @ deltas, "started": torch.tensor(True)}

    def gradient_evaluations(self, sizes: np.ndarray, cohort: np.ndarray) -> int:
        """Per-sample gradients spent by :meth:`broadcast` (two full local gradients per client, exact only)."""
        return int(2 * sizes[cohort].sum()) if self.estimator == "exact" else 0
