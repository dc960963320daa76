"""Server optimizers: x ← x − step, where the step is a chain of transforms applied to the aggregated
pseudo-gradient Δ = Σ ω_iΔ_i (:mod:`fedshuffle.server.transforms`, in optax's shape).

Each entry of :data:`SERVER_OPTIMIZERS` is a factory whose keyword parameters are its settings, each
with a type, a default, its constraints and a one-line help (``Annotated[float, Field(...)]``, checked
by the registry, :mod:`fedshuffle.core.registry`); it returns an :class:`Optimizer`: the chain of
transforms and its step size. Adding a server optimizer is a transform (if a new one is needed), a factory
and one ``SERVER_OPTIMIZERS.add`` line; AMSGrad, say, is Adam's moments transform that also keeps
max v, chained as ``chain(ScaleByAMSGrad(beta1, beta2, eps), ScaleBySchedule(lr))`` (the
documentation's "Extending" page writes it out).

* :class:`MetaEpochExtrapolation` wraps any server optimizer with RR-CLI's meta-epoch step.
* FedShuffle's *global momentum* is not a server optimizer but a method wrapper
  (:class:`fedshuffle.methods.momentum.GlobalMomentum`): clients fold it into every local step.

States are dicts of tensors (a chain's: of its parts' states) so that a checkpoint can store them as they are.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import torch
from pydantic import Field

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Example, Registry, StepSize
from fedshuffle.server.transforms import (
    ScaleByAdagrad,
    ScaleByAdam,
    ScaleByAdGD,
    ScaleBySchedule,
    ScaleByYogi,
    State,
    StepInputs,
    Trace,
    Transform,
    chain,
)

__all__ = [
    "SERVER_OPTIMIZERS",
    "GlobalStep",
    "MetaEpochExtrapolation",
    "Optimizer",
    "ServerOptimizer",
    "chosen_optimizer",
]


class ServerOptimizer(Protocol):
    """x ← x − step, with ``step, state = update(direction, state, params, lr_scale)``.

    ``direction`` is the aggregated pseudo-gradient Σ ω_iΔ_i; ``lr_scale`` is the step-size
    schedule's factor for this round (:class:`fedshuffle.schedules.Schedule`); ``lr`` is the server
    step size η that RR-CLI's meta-epoch step divides by.
    """

    lr: float

    def init(self, params: torch.Tensor) -> State: ...

    def update(
        self, direction: torch.Tensor, state: State, params: torch.Tensor, lr_scale: float = 1.0
    ) -> tuple[torch.Tensor, State]: ...


@dataclass(frozen=True)
class Optimizer:
    """A registered server optimizer: its chain of transforms and its step size η (``lr``)."""

    transform: Transform
    lr: float

    def init(self, params: torch.Tensor) -> State:
        return self.transform.init(params)

    def update(
        self, direction: torch.Tensor, state: State, params: torch.Tensor, lr_scale: float = 1.0
    ) -> tuple[torch.Tensor, State]:
        return self.transform.update(direction, state, StepInputs(params, lr_scale))


#: a server optimizer's step size η (the role :class:`~fedshuffle.core.registry.StepSize`: ``'theory'`` takes a
#: theorem's ``server_lr``)
ServerStep = Annotated[
    float, Field(gt=0, allow_inf_nan=False, description="server step size η_g"), StepSize("server_lr")
]
#: RR-CLI's meta-epoch step θ of :class:`MetaEpochExtrapolation` (``server.global_lr``; default ηR: no extrapolation)
GlobalStep = Annotated[
    float,
    Field(gt=0, allow_inf_nan=False, description="RR-CLI's meta-epoch step θ (default ηR: no extrapolation)"),
    StepSize("global_lr"),
]
Momentum = Annotated[float, Field(ge=0, lt=1, description="server heavy-ball momentum β: v ← βv + Δ")]
Beta1 = Annotated[float, Field(ge=0, lt=1, description="first-moment decay β₁: m ← β₁m + (1−β₁)Δ")]
Beta2 = Annotated[float, Field(ge=0, lt=1, description="second-moment decay β₂")]
Eps = Annotated[float, Field(gt=0, allow_inf_nan=False, description="adaptivity degree τ: v₀ = τ², step η·m/(√v + τ)")]


def sgd(lr: ServerStep = 1.0) -> Optimizer:
    """x ← x − η_g·Δ (FedShuffle Algorithm 1, line 14)."""
    return Optimizer(ScaleBySchedule(lr), lr)


def heavy_ball(lr: ServerStep = 1.0, momentum: Momentum = 0.9) -> Optimizer:
    """Server heavy-ball momentum: v ← βv + Δ (v = Δ on the first round), x ← x − η_g·v."""
    return Optimizer(chain(Trace(momentum), ScaleBySchedule(lr)), lr)


# FedAdagrad, FedAdam and FedYogi (Reddi et al., ICLR 2021, Algorithm 2) share the first moment and the
# step size and differ in the second moment: x ← x − η·m/(√v + τ), with m₀ = 0 and v₀ = τ² and no bias
# correction, as in that paper. Nastya §8 (Malinovsky, Mishchenko & Richtárik 2022) uses Adam on the
# aggregated direction in this way.


def adagrad(lr: ServerStep = 0.01, beta1: Beta1 = 0.9, eps: Eps = 1e-3) -> Optimizer:
    """FedAdagrad: m ← β₁m + (1−β₁)Δ, v ← v + Δ², x ← x − η·m/(√v + τ)."""
    return Optimizer(chain(ScaleByAdagrad(beta1, eps), ScaleBySchedule(lr)), lr)


def adam(lr: ServerStep = 0.01, beta1: Beta1 = 0.9, beta2: Beta2 = 0.99, eps: Eps = 1e-3) -> Optimizer:
    """FedAdam: m ← β₁m + (1−β₁)Δ, v ← β₂v + (1−β₂)Δ², x ← x − η·m/(√v + τ)."""
    return Optimizer(chain(ScaleByAdam(beta1, beta2, eps), ScaleBySchedule(lr)), lr)


def yogi(lr: ServerStep = 0.01, beta1: Beta1 = 0.9, beta2: Beta2 = 0.99, eps: Eps = 1e-3) -> Optimizer:
    """FedYogi: m ← β₁m + (1−β₁)Δ, v ← v − (1−β₂)Δ²·sign(v − Δ²), x ← x − η·m/(√v + τ)."""
    return Optimizer(chain(ScaleByYogi(beta1, beta2, eps), ScaleBySchedule(lr)), lr)


def adgd(
    lr: Annotated[
        float,
        Field(gt=0, allow_inf_nan=False, description="first server step λ₀; later ones adapt"),
        StepSize("server_lr"),
    ] = 1e-6,
) -> Optimizer:
    """AdGD on the pseudo-gradient (:class:`~fedshuffle.server.transforms.ScaleByAdGD`)."""
    return Optimizer(ScaleByAdGD(lr), lr)


@dataclass(frozen=True)
class MetaEpochExtrapolation:
    """RR-CLI's global step (Malinovsky, Horváth, Burlachenko & Richtárik 2023, Algorithm 1, line 18) around any server
    optimizer.

    Rounds run ``inner`` from the meta-epoch's anchor x_t; after the R-th round of the meta-epoch

        x_{t+1} = x_t − θ·(x_t − x_t^R)/(ηR),

    with η = ``inner.lr`` the inner server step size. θ = ηR gives x_{t+1} = x_t^R (no extrapolation).
    Like optax's ``MultiSteps``, it wraps the inner optimizer and keeps the inner state under ``inner``.
    """

    inner: ServerOptimizer
    global_lr: float
    rounds: int

    def __post_init__(self) -> None:
        if not self.global_lr > 0:
            raise ConfigError("global_lr", f"global step size θ must be > 0, got {self.global_lr}")

    @property
    def lr(self) -> float:
        return self.inner.lr

    def init(self, params: torch.Tensor) -> State:
        return {"inner": self.inner.init(params), "anchor": params.clone(), "round": torch.tensor(0)}

    def update(
        self, direction: torch.Tensor, state: State, params: torch.Tensor, lr_scale: float = 1.0
    ) -> tuple[torch.Tensor, State]:
        step, inner_state = self.inner.update(direction, state["inner"], params, lr_scale)
        count = int(state["round"]) + 1
        if count < self.rounds:
            return step, {"inner": inner_state, "anchor": state["anchor"], "round": torch.tensor(count)}
        anchor = state["anchor"]
        end = anchor - self.global_lr / (self.inner.lr * self.rounds) * (anchor - (params - step))
        return params - end, {"inner": inner_state, "anchor": end.clone(), "round": torch.tensor(0)}


def chosen_optimizer(settings: Mapping[str, Any]) -> str:
    """The server optimizer ``settings`` (the ``[server]`` section) choose: ``optimizer``, else ``heavy_ball`` when they
    give a ``momentum``, else ``sgd``."""
    return settings.get("optimizer") or ("heavy_ball" if settings.get("momentum") is not None else "sgd")


_REDDI = "Reddi et al., Adaptive Federated Optimization, ICLR 2021, Algorithm 2"
#: Server optimizers by name; a factory's keyword parameters are the optimizer's settings
#: (:mod:`fedshuffle.core.registry`).
SERVER_OPTIMIZERS = Registry("server.optimizer", runtime=(), noun="server optimizer")
SERVER_OPTIMIZERS.add(
    "sgd", sgd, "x ← x − η_g·Δ", "Horváth et al., FedShuffle, TMLR 2022, Algorithm 1", example=Example()
)
SERVER_OPTIMIZERS.add(
    "heavy_ball",
    heavy_ball,
    "server heavy-ball momentum on Δ",
    "Hsu, Qi & Brown, arXiv:1909.06335, 2019 (FedAvgM)",
    example=Example(),
)
SERVER_OPTIMIZERS.add("adam", adam, "FedAdam on the pseudo-gradient", _REDDI, example=Example())
SERVER_OPTIMIZERS.add("adagrad", adagrad, "FedAdagrad on the pseudo-gradient", _REDDI, example=Example())
SERVER_OPTIMIZERS.add("yogi", yogi, "FedYogi on the pseudo-gradient", _REDDI, example=Example())
SERVER_OPTIMIZERS.add(
    "adgd",
    adgd,
    "adaptive gradient descent without descent on Δ",
    "Malitsky & Mishchenko, ICML 2020, Algorithm 1",
    example=Example(),
)
