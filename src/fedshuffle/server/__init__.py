"""Server optimizers: x ← x − step, where the step is a chain of transforms applied to the aggregated
pseudo-gradient Δ = Σ ω_iΔ_i (:mod:`fedshuffle.server.transforms`, in optax's shape).

Each entry of :data:`SERVER_OPTIMIZERS` is a factory whose keyword parameters are its settings, each
with a type, a default, its constraints and a one-line help (``Annotated[float, Field(...)]``); it
returns the chain of transforms, and :func:`server_optimizer` makes it an :class:`Optimizer` that
checks its settings. Adding a server optimizer is a transform (if a new one is needed), a factory
and one ``SERVER_OPTIMIZERS.add`` line; AMSGrad, say, is a second-moment transform that also keeps
max v, chained as ``chain(EMA(beta1), ScaleBySchedule(lr), ScaleByAMSGrad(beta2, eps))`` (the
documentation's "Extending" page writes it out).

* :class:`MetaEpochExtrapolation` wraps any server optimizer with RR-CLI's meta-epoch step.
* FedShuffle's *global momentum* is not a server optimizer but a method wrapper
  (:class:`fedshuffle.methods.momentum.GlobalMomentum`): clients fold it into every local step.

States are dicts of tensors (a chain's: of its parts' states) so that a checkpoint can store them as they are.
"""

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, get_type_hints

import torch
from pydantic import ConfigDict, Field, ValidationError, create_model

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Registry
from fedshuffle.server.transforms import (
    EMA, ScaleByAdagrad, ScaleByAdam, ScaleByAdGD, ScaleBySchedule, ScaleByYogi, State, StepInputs, Trace, Transform, chain,
)

__all__ = ["SERVER_OPTIMIZERS", "MetaEpochExtrapolation", "Optimizer", "ServerOptimizer", "server_optimizer"]


class ServerOptimizer(Protocol):
    """x ← x − step, with ``step, state = update(direction, state, params, lr_scale)``.

    ``direction`` is the aggregated pseudo-gradient Σ ω_iΔ_i; ``lr_scale`` is the step-size
    schedule's factor for this round (:class:`fedshuffle.schedules.Schedule`); ``lr`` is the server
    step size η that RR-CLI's meta-epoch step divides by.
    """

    lr: float

    def init(self, params: torch.Tensor) -> State: ...

    def update(self, direction: torch.Tensor, state: State, params: torch.Tensor, lr_scale: float = 1.0) -> tuple[torch.Tensor, State]: ...


@dataclass(frozen=True)
class Optimizer:
    """A registered server optimizer: its chain of transforms and the settings it was built with
    (defaults filled in); ``lr`` is the ``lr`` setting."""

    transform: Transform
    settings: Mapping[str, Any]

    @property
    def lr(self) -> float:
        return self.settings["lr"]

    def init(self, params: torch.Tensor) -> State:
        return self.transform.init(params)

    def update(self, direction: torch.Tensor, state: State, params: torch.Tensor, lr_scale: float = 1.0) -> tuple[torch.Tensor, State]:
        return self.transform.update(direction, state, StepInputs(direction, params, lr_scale))


def server_optimizer(factory: Callable[..., Transform]) -> Callable[..., Optimizer]:
    """The registry factory made of ``factory(**settings) -> Transform``, whose keyword parameters (each
    annotated and with a default) are the optimizer's settings and include its step size ``lr``.

    The returned function has ``factory``'s signature; it checks a call against the annotations
    (pydantic, strictly: a bool or a string is not a number), so a setting the optimizer does not
    take or a value outside its constraints is a :class:`~fedshuffle.core.errors.ConfigError` naming
    the setting, and returns an :class:`Optimizer` keeping the settings.
    """
    parameters = inspect.signature(factory).parameters
    types = get_type_hints(factory, include_extras=True)  # evaluated where the factory is written (string annotations too)
    if "lr" not in parameters or any(p.default is inspect.Parameter.empty or n not in types for n, p in parameters.items()):
        raise TypeError(f"{factory.__name__}: a server optimizer's settings are annotated keyword parameters with defaults, lr among them")
    fields = {n: (types[n], p.default) for n, p in parameters.items()}
    model = create_model(f"{factory.__name__}_settings", __config__=ConfigDict(extra="forbid", strict=True), **fields)

    @functools.wraps(factory)
    def build(**settings: Any) -> Optimizer:
        try:
            checked = model.model_validate(settings).model_dump()
        except ValidationError as exc:
            error = exc.errors()[0]
            name = str(error["loc"][0])
            if error["type"] == "extra_forbidden":
                raise ConfigError(name, f"not a setting of server optimizer {factory.__name__!r}; accepted: {', '.join(parameters)}") from None
            raise ConfigError(name, f"{error['msg']} (got {error['input']!r})") from None
        return Optimizer(factory(**checked), checked)

    return build


StepSize = Annotated[float, Field(gt=0, allow_inf_nan=False, description="server step size η_g")]
Momentum = Annotated[float, Field(ge=0, lt=1, description="server heavy-ball momentum β: v ← βv + Δ")]
Beta1 = Annotated[float, Field(ge=0, lt=1, description="first-moment decay β₁: m ← β₁m + (1−β₁)Δ")]
Beta2 = Annotated[float, Field(ge=0, lt=1, description="second-moment decay β₂")]
Eps = Annotated[float, Field(gt=0, allow_inf_nan=False, description="adaptivity degree τ: v₀ = τ², step η·m/(√v + τ)")]


@server_optimizer
def sgd(lr: StepSize = 1.0) -> Transform:
    """x ← x − η_g·Δ (FedShuffle Algorithm 1, line 14)."""
    return ScaleBySchedule(lr)


@server_optimizer
def heavy_ball(lr: StepSize = 1.0, momentum: Momentum = 0.9) -> Transform:
    """Server heavy-ball momentum: v ← βv + Δ (v = Δ on the first round), x ← x − η_g·v."""
    return chain(Trace(momentum), ScaleBySchedule(lr))


# FedAdagrad, FedAdam and FedYogi (Reddi et al., ICLR 2021, Algorithm 2) share the first moment and the
# step size and differ in the second moment: x ← x − η·m/(√v + τ), with m₀ = 0 and v₀ = τ² and no bias
# correction, as in that paper. Nastya §8 (Malinovsky, Mishchenko & Richtárik 2022) uses Adam on the
# aggregated direction in this way.


@server_optimizer
def adagrad(lr: StepSize = 0.01, beta1: Beta1 = 0.9, eps: Eps = 1e-3) -> Transform:
    """FedAdagrad: m ← β₁m + (1−β₁)Δ, v ← v + Δ², x ← x − η·m/(√v + τ)."""
    return chain(EMA(beta1), ScaleBySchedule(lr), ScaleByAdagrad(eps))


@server_optimizer
def adam(lr: StepSize = 0.01, beta1: Beta1 = 0.9, beta2: Beta2 = 0.99, eps: Eps = 1e-3) -> Transform:
    """FedAdam: m ← β₁m + (1−β₁)Δ, v ← β₂v + (1−β₂)Δ², x ← x − η·m/(√v + τ)."""
    return chain(EMA(beta1), ScaleBySchedule(lr), ScaleByAdam(beta2, eps))


@server_optimizer
def yogi(lr: StepSize = 0.01, beta1: Beta1 = 0.9, beta2: Beta2 = 0.99, eps: Eps = 1e-3) -> Transform:
    """FedYogi: m ← β₁m + (1−β₁)Δ, v ← v − (1−β₂)Δ²·sign(v − Δ²), x ← x − η·m/(√v + τ)."""
    return chain(EMA(beta1), ScaleBySchedule(lr), ScaleByYogi(beta2, eps))


@server_optimizer
def adgd(lr: Annotated[float, Field(gt=0, allow_inf_nan=False, description="first server step λ₀; later ones adapt")] = 1e-6) -> Transform:
    """AdGD on the pseudo-gradient (:class:`~fedshuffle.server.transforms.ScaleByAdGD`)."""
    return ScaleByAdGD(lr)


@dataclass(frozen=True)
class MetaEpochExtrapolation:
    """RR-CLI's global step (Malinovsky, Horváth, Burlachenko & Richtárik 2023, Algorithm 1, line 18) around any server optimizer.

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

    def update(self, direction: torch.Tensor, state: State, params: torch.Tensor, lr_scale: float = 1.0) -> tuple[torch.Tensor, State]:
        step, inner_state = self.inner.update(direction, state["inner"], params, lr_scale)
        count = int(state["round"]) + 1
        if count < self.rounds:
            return step, {"inner": inner_state, "anchor": state["anchor"], "round": torch.tensor(count)}
        anchor = state["anchor"]
        end = anchor - self.global_lr / (self.inner.lr * self.rounds) * (anchor - (params - step))
        return params - end, {"inner": inner_state, "anchor": end.clone(), "round": torch.tensor(0)}


_REDDI = "Reddi et al., Adaptive Federated Optimization, ICLR 2021, Algorithm 2"
SERVER_OPTIMIZERS = Registry("server.optimizer")
SERVER_OPTIMIZERS.add("sgd", sgd, "x ← x − η_g·Δ", "Horváth et al., FedShuffle, TMLR 2022, Algorithm 1")
SERVER_OPTIMIZERS.add("heavy_ball", heavy_ball, "server heavy-ball momentum on Δ", "Hsu, Qi & Brown, arXiv:1909.06335, 2019 (FedAvgM)")
SERVER_OPTIMIZERS.add("adam", adam, "FedAdam on the pseudo-gradient", _REDDI)
SERVER_OPTIMIZERS.add("adagrad", adagrad, "FedAdagrad on the pseudo-gradient", _REDDI)
SERVER_OPTIMIZERS.add("yogi", yogi, "FedYogi on the pseudo-gradient", _REDDI)
SERVER_OPTIMIZERS.add("adgd", adgd, "adaptive gradient descent without descent on Δ", "Malitsky & Mishchenko, ICML 2020, Algorithm 1")
