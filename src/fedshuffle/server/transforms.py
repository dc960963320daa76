"""Transforms of the server step, in the shape of optax's ``GradientTransformation``: small frozen
objects with ``init(params) -> state`` and ``update(updates, state, inputs) -> (updates, state)``,
composed with :func:`chain`.

A chain starts from the aggregated pseudo-gradient Δ = Σ ω_iΔ_i and ends at the step of
x ← x − step. Every transform keeps its own state, a dict of tensors that a checkpoint stores as it
is; a chain's state is the dict ``{part.key: part's state}``, so a new transform never changes the
state of the optimizers that do not use it. As in optax, a transform sees the updates it is given and
nothing of what the chain started from: a transform put in front of another (a clip, a scale) changes
everything the later one computes. Besides its updates it may read the round's :class:`StepInputs`: the
model x the step is taken from and the schedule's factor for the round.

The transforms do not check their constants: the registered optimizers that build them do
(:func:`fedshuffle.server.server_optimizer`), with the settings' declared constraints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

#: a transform's state: tensors, or for a chain the states of its parts by key
State = dict[str, Any]


@dataclass(frozen=True)
class StepInputs:
    """What every transform may read about the round besides its updates: the model x the step is taken
    from, and the step-size schedule's factor for the round."""

    params: torch.Tensor
    lr_scale: float = 1.0


class Transform(Protocol):
    """``updates, state = update(updates, state, inputs)``; ``key`` names its state in a chain."""

    key: ClassVar[str]

    def init(self, params: torch.Tensor) -> State: ...

    def update(self, updates: torch.Tensor, state: State, inputs: StepInputs) -> tuple[torch.Tensor, State]: ...


@dataclass(frozen=True)
class Chain:
    """``parts`` applied in order, each to the updates of the one before; the state is ``{part.key: part's state}``."""

    parts: tuple[Transform, ...]
    key: ClassVar[str] = "chain"

    def __post_init__(self) -> None:
        keys = [part.key for part in self.parts]
        if len(set(keys)) < len(keys):
            raise ValueError(f"a chain keeps one state per key; these transforms share one: {', '.join(keys)}")

    def init(self, params: torch.Tensor) -> State:
        return {part.key: part.init(params) for part in self.parts}

    def update(self, updates: torch.Tensor, state: State, inputs: StepInputs) -> tuple[torch.Tensor, State]:
        new_state = {}
        for part in self.parts:
            updates, new_state[part.key] = part.update(updates, state[part.key], inputs)
        return updates, new_state


def chain(*parts: Transform) -> Chain:
    """The transforms ``parts`` applied in order (optax's ``chain``)."""
    return Chain(parts)


@dataclass(frozen=True)
class ScaleBySchedule:
    """u ← η·s_t·u: the server step size η times the schedule's factor s_t for the round
    (:class:`fedshuffle.schedules.Schedule`). The product η·s_t is taken first, then applied to u."""

    lr: float
    key: ClassVar[str] = "scale_by_schedule"

    def init(self, params: torch.Tensor) -> State:
        return {}

    def update(self, updates: torch.Tensor, state: State, inputs: StepInputs) -> tuple[torch.Tensor, State]:
        return self.lr * inputs.lr_scale * updates, state


@dataclass(frozen=True)
class Trace:
    """Server ("slow") heavy-ball momentum with β = ``decay`` (the ``momentum`` setting): v ← βv + u, with
    v = u on the first round; the output is v.

    This is FedAvgM (Hsu, Qi & Brown 2019, arXiv:1909.06335) and FedNova's ``gmf`` (Wang et al., NeurIPS
    2020, code). It differs from FedShuffle's global momentum, which acts inside local steps
    (:class:`fedshuffle.methods.momentum.GlobalMomentum`).
    """

    decay: float
    key: ClassVar[str] = "trace"

    def init(self, params: torch.Tensor) -> State:
        return {"velocity": torch.zeros_like(params), "started": torch.tensor(False)}

    def update(self, updates: torch.Tensor, state: State, inputs: StepInputs) -> tuple[torch.Tensor, State]:
        velocity = self.decay * state["velocity"] + updates if bool(state["started"]) else updates.clone()
        return velocity, {"velocity": velocity, "started": torch.tensor(True)}


class _ScaleByMoments:
    """u ← m/(√v + τ), with m ← β₁m + (1−β₁)u from m₀ = 0 and v a running statistic of u² from v₀ = τ² (Reddi et al.,
    ICLR 2021, Algorithm 2: τ is the adaptivity degree; no bias correction): both moments of the updates this
    transform receives, as optax's ``scale_by_adam``. Subclasses say how v accumulates; chained before
    :class:`ScaleBySchedule`, the step is η·s_t·m/(√v + τ)."""

    beta1: float
    eps: float

    def accumulate(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def init(self, params: torch.Tensor) -> State:
        return {"m": torch.zeros_like(params), "v": torch.full_like(params, self.eps**2)}

    def update(self, updates: torch.Tensor, state: State, inputs: StepInputs) -> tuple[torch.Tensor, State]:
        m = self.beta1 * state["m"] + (1 - self.beta1) * updates
        v = self.accumulate(state["v"], updates * updates)
        return m / (v.sqrt() + self.eps), {"m": m, "v": v}


@dataclass(frozen=True)
class ScaleByAdagrad(_ScaleByMoments):
    """FedAdagrad's moments: m ← β₁m + (1−β₁)u, v ← v + u²."""

    beta1: float
    eps: float
    key: ClassVar[str] = "scale_by_adagrad"

    def accumulate(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        return v + square


@dataclass(frozen=True)
class ScaleByAdam(_ScaleByMoments):
    """FedAdam's moments: m ← β₁m + (1−β₁)u, v ← β₂v + (1−β₂)u²."""

    beta1: float
    beta2: float
    eps: float
    key: ClassVar[str] = "scale_by_adam"

    def accumulate(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        return self.beta2 * v + (1 - self.beta2) * square


@dataclass(frozen=True)
class ScaleByYogi(_ScaleByMoments):
    """FedYogi's moments: m ← β₁m + (1−β₁)u, v ← v − (1−β₂)u²·sign(v − u²)."""

    beta1: float
    beta2: float
    eps: float
    key: ClassVar[str] = "scale_by_yogi"

    def accumulate(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.beta2) * square * torch.sign(v - square)


@dataclass(frozen=True)
class ScaleByAdGD:
    """Adaptive gradient descent without descent (Malitsky & Mishchenko, ICML 2020, Algorithm 1): u ← λ_k·s_t·u.

    The updates g_k (the pseudo-gradient Δ when this is the first transform) stand in for ∇f(x_k)
    (Nastya: Malinovsky, Mishchenko & Richtárik 2022, §8):

        λ_k = min{ √(1+θ_{k−1})·λ_{k−1},  ‖x_k − x_{k−1}‖ / (2‖g_k − g_{k−1}‖) },   θ_k = λ_k/λ_{k−1},
        x_{k+1} = x_k − λ_k g_k,

    with x₁ = x₀ − λ₀g₀ (λ₀ = ``lr``) and θ₀ = +∞, so λ₁ is set by the curvature estimate alone; s_t is
    the schedule's factor. With Nastya's g = mean local gradient and a small client step this is AdGD
    on f itself; the paper does not say which form its experiment used, so this is the plain form of
    the AdGD paper.

    No curvature estimate: when ‖x_k − x_{k−1}‖ = 0 (the model did not move: g_{k−1} = 0, a
    stationary point) or ‖g_k − g_{k−1}‖ = 0 (f linear along the last step, or the model stopped),
    the ratio is 0/0, 0/c or c/0 and says nothing about the local smoothness; the step is kept,
    λ_k = λ_{k−1} (θ_k = 1), as the AdGD convention for a vanishing difference. Reading c/0 as +∞
    would instead give λ_k = √(1+θ_{k−1})λ_{k−1}, which is +∞ right after the first step (θ₀ = +∞), and
    0/c = 0 would stop the method for good (and divide by λ = 0 next). A kept step still satisfies
    both inequalities of the analysis, λ_k ≤ √(1+θ_{k−1})λ_{k−1} and 2λ_k‖g_k − g_{k−1}‖ ≤ ‖x_k − x_{k−1}‖
    whenever the latter has content. A non-finite or zero estimate (underflow) is treated the same way.

    The state keeps λ_k as ``lr`` and θ_k as ``theta`` (float64 scalars), and x_k, g_k for the next round.
    """

    lr: float
    key: ClassVar[str] = "scale_by_adgd"

    def init(self, params: torch.Tensor) -> State:
        return {
            "prev_params": params.clone(),
            "prev_direction": torch.zeros_like(params),
            "lr": torch.tensor(self.lr, dtype=torch.float64),
            "theta": torch.tensor(math.inf, dtype=torch.float64),
            "started": torch.tensor(False),
        }

    def update(self, updates: torch.Tensor, state: State, inputs: StepInputs) -> tuple[torch.Tensor, State]:
        lam = float(state["lr"])
        if bool(state["started"]):
            moved = float((inputs.params - state["prev_params"]).norm())
            diff = float((updates - state["prev_direction"]).norm())
            curvature = moved / (2 * diff) if moved > 0 and diff > 0 else math.nan
            new = (
                min(math.sqrt(1 + float(state["theta"])) * lam, curvature)
                if math.isfinite(curvature) and curvature > 0
                else lam
            )
            theta, lam = new / lam, new
        else:
            theta = math.inf
        new_state = {
            "prev_params": inputs.params.clone(),
            "prev_direction": updates.clone(),
            "lr": torch.tensor(lam, dtype=torch.float64),
            "theta": torch.tensor(theta, dtype=torch.float64),
            "started": torch.tensor(True),
        }
        return lam * inputs.lr_scale * updates, new_state
