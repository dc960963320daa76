"""Local step transforms: how one local step turns a minibatch gradient into a move.

In the style of optax, a transform is an ``(init, update)`` pair with explicit state, and a
:class:`StepChain` composes them. One local step of every working client is

    g = ∇f_batch(y),  (d, d_x) = chain.update((g, g_x), state, step),  y ← y − η_i·d,

where ``g_x`` = ∇f_batch(x) at the client's center x on the same minibatch (computed only when a
transform asks for it: FedShuffleMVR's eq. (13)). All tensors are stacks over the working clients
(``(k, d)``), so the same chain serves one client (the sequential executor, k = 1) and a cohort.

Each transform also says what it does to FedNova's ‖a_i‖₁ (Wang et al., NeurIPS 2020, §4: after τ
steps x − y_τ = η Σ_k a_k g_k), in :meth:`a_l1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from fedshuffle.core.errors import ConfigError

State = dict[str, torch.Tensor]


@dataclass
class Step:
    """What a transform may read at one step: the working clients' iterates, centers and offsets."""

    y: torch.Tensor  # (k, d) current iterates
    center: torch.Tensor  # (k, d) the point x the client started from (or its prox center)
    offset: torch.Tensor | None  # (k, d) per-client constant added to the direction
    working: int  # k: the clients still stepping are rows [0, k)


class StepTransform(Protocol):
    """``init(start) -> state``; ``update((d, d_x), state, step) -> (d, d_x)`` (state updated in place on rows [0,
    k))."""

    needs_center_gradient: bool

    def init(self, start: torch.Tensor) -> State: ...

    def update(
        self, d: torch.Tensor, d_x: torch.Tensor | None, state: State, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def a_l1(self, steps: int, lr: float, inner: float) -> float: ...


class _Stateless:
    needs_center_gradient = False

    def init(self, start: torch.Tensor) -> State:
        return {}

    def a_l1(self, steps: int, lr: float, inner: float) -> float:
        return inner


@dataclass(frozen=True)
class Clip(_Stateless):
    """g ← g·min(1, c/‖g‖) per client (gradient clipping, FedShuffle Appendix F)."""

    norm: float

    def update(self, d, d_x, state, step):
        def clip(g: torch.Tensor) -> torch.Tensor:
            return g * torch.clamp(self.norm / (g.norm(dim=-1, keepdim=True) + 1e-12), max=1.0)

        return clip(d), None if d_x is None else clip(d_x)


@dataclass(frozen=True)
class WeightDecay(_Stateless):
    """g ← g + λ·y (and λ·x for the center gradient)."""

    rate: float

    def update(self, d, d_x, state, step):
        return d + self.rate * step.y, None if d_x is None else d_x + self.rate * step.center


@dataclass(frozen=True)
class Drift(_Stateless):
    """FedShuffle's global momentum m in every local step (Horváth et al., TMLR 2022, eqs. (13)–(14), Appendix F).

    ``correction`` (FedShuffleMVR, eq. (13)): d ← d + (1−a)(m − d_x), with d_x the same
    transforms applied to ∇f_batch(x). Without (Appendix F's approximation): d ← a·d + (1−a)m.
    """

    a: float
    momentum: torch.Tensor
    correction: bool

    @property
    def needs_center_gradient(self) -> bool:  # type: ignore[override]
        return self.correction

    def update(self, d, d_x, state, step):
        if self.correction:
            return d + (1 - self.a) * (self.momentum - d_x), d_x
        return self.a * d + (1 - self.a) * self.momentum, d_x


@dataclass(frozen=True)
class Prox:
    """d ← d + μ(y − x): the proximal term (μ/2)‖y − x‖² of FedProx (Li et al., MLSys 2020) and FedDyn.

    FedNova's ‖a_i‖₁ of proximal SGD with α = ημ: [1 − (1−α)^τ]/α. The proximal pull alone,
    y − x ← (1 − α)(y − x), diverges for α > 2, so such a μ is refused (naming ``local.prox_mu``).
    """

    mu: float
    needs_center_gradient = False

    def init(self, start):
        return {}

    def update(self, d, d_x, state, step):
        return d + self.mu * (step.y - step.center), d_x

    def a_l1(self, steps, lr, inner):
        if inner != steps:
            raise ConfigError("local.prox_mu", "a proximal term after local momentum has no FedNova normalizer")
        alpha = lr * self.mu
        if not alpha <= 2:
            raise ConfigError(
                "local.prox_mu",
                f"μ = {self.mu:g} with step size {lr:g}: η·μ = {alpha:g} > 2 makes the proximal term itself diverge "
                f"(|1 − ημ| > 1); use μ <= {2 / lr:.4g}",
            )
        return (1 - (1 - alpha) ** steps) / alpha


@dataclass(frozen=True)
class Offset(_Stateless):
    """d ← d + o_i, a per-client constant: SCAFFOLD's c − c_i (Karimireddy et al., ICML 2020), FedDyn's −∇L_i."""

    def update(self, d, d_x, state, step):
        return (d if step.offset is None else d + step.offset), d_x


@dataclass(frozen=True)
class Momentum:
    """Local heavy-ball: v ← ρv + d, d ← v. FedNova's ‖a_i‖₁: [τ − ρ(1−ρ^τ)/(1−ρ)]/(1−ρ)."""

    rho: float
    needs_center_gradient = False

    def init(self, start):
        return {"velocity": torch.zeros_like(start)}

    def update(self, d, d_x, state, step):
        v = state["velocity"][: step.working]
        v.mul_(self.rho).add_(d)
        return v.clone(), d_x

    def a_l1(self, steps, lr, inner):
        if inner != steps:
            raise ConfigError("local.momentum", "local momentum after a proximal term has no FedNova normalizer")
        rho = self.rho
        return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)


@dataclass(frozen=True)
class StepChain:
    """Transforms applied in order; the chain of a plain SGD step is empty."""

    transforms: tuple[StepTransform, ...] = field(default_factory=tuple)

    @property
    def needs_center_gradient(self) -> bool:
        return any(t.needs_center_gradient for t in self.transforms)

    def init(self, start: torch.Tensor) -> list[State]:
        return [t.init(start) for t in self.transforms]

    def update(self, g: torch.Tensor, g_x: torch.Tensor | None, states: list[State], step: Step) -> torch.Tensor:
        d, d_x = g, g_x
        for transform, state in zip(self.transforms, states):
            d, d_x = transform.update(d, d_x, state, step)
        return d

    def a_l1(self, steps: int, lr: float) -> float:
        """FedNova's ‖a_i‖₁ of ``steps`` steps with step size ``lr``."""
        value = float(steps)
        for transform in self.transforms:
            value = transform.a_l1(steps, lr, value)
        return value


def standard_chain(
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
    prox_mu: float = 0.0,
    momentum: float = 0.0,
    drift: Drift | None = None,
    offset: bool = False,
) -> StepChain:
    """clip → weight decay → global-momentum drift → prox → offset → local momentum."""
    parts: list[StepTransform] = []
    if clip_norm is not None:
        parts.append(Clip(clip_norm))
    if weight_decay:
        parts.append(WeightDecay(weight_decay))
    if drift is not None:
        parts.append(drift)
    if prox_mu:
        parts.append(Prox(prox_mu))
    if offset:
        parts.append(Offset())
    if momentum:
        parts.append(Momentum(momentum))
    return StepChain(tuple(parts))
