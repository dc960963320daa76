"""Server-side pieces with explicit state, in the (init, update) style of optax.

* Server optimizers turn the aggregated direction Δ = Σ ω_iΔ_i into a step: x ← x − step.
* FedShuffle's *global momentum* is not a server optimizer but a method wrapper
  (:class:`fedshuffle.methods.momentum.GlobalMomentum`): clients fold it into every local step.

States are plain dicts of tensors so that a checkpoint can store them as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Protocol

import torch
from pydantic import Field

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Registry

State = dict[str, torch.Tensor]


class ServerOptimizer(Protocol):
    """x ← x − step, with ``step, state = update(direction, state, params, lr_scale)``.

    ``direction`` is the aggregated pseudo-gradient Σ ω_iΔ_i; ``lr_scale`` is the step-size
    schedule's factor for this round (:class:`fedshuffle.schedules.Schedule`).
    """

    lr: float

    def init(self, params: torch.Tensor) -> State: ...

    def update(self, direction: torch.Tensor, state: State, params: torch.Tensor, lr_scale: float = 1.0) -> tuple[torch.Tensor, State]: ...


def _check_lr(lr: float) -> None:
    if not lr > 0:
        raise ConfigError("lr", f"server step size must be > 0, got {lr}")


@dataclass(frozen=True)
class ServerSGD:
    """x ← x − η_g·Δ (FedShuffle Algorithm 1, line 14)."""

    lr: float = 1.0

    def __post_init__(self) -> None:
        _check_lr(self.lr)

    def init(self, params):
        return {}

    def update(self, direction, state, params, lr_scale=1.0):
        return self.lr * lr_scale * direction, state


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
            raise ConfigError("momentum", f"must be in [0, 1), got {self.beta}")

    def init(self, params):
        return {"velocity": torch.zeros_like(params), "started": torch.tensor(False)}

    def update(self, direction, state, params, lr_scale=1.0):
        velocity = self.beta * state["velocity"] + direction if bool(state["started"]) else direction.clone()
        return self.lr * lr_scale * velocity, {"velocity": velocity, "started": torch.tensor(True)}


ADAPTIVE = ("adam", "adagrad", "yogi")


@dataclass(frozen=True)
class ServerAdaptive:
    """FedAdagrad / FedAdam / FedYogi (Reddi et al. 2021, Algorithm 2) on the pseudo-gradient Δ.

        m ← β₁m + (1−β₁)Δ
        v ← v + Δ²                                  (adagrad)
        v ← β₂v + (1−β₂)Δ²                          (adam)
        v ← v − (1−β₂)Δ²·sign(v − Δ²)               (yogi)
        x ← x − η·m/(√v + τ)

    with m₀ = 0 and v₀ = τ², as in that paper (no bias correction). Nastya §8 (Malinovsky, Mishchenko & Richtárik 2022) uses Adam on the
    aggregated direction in this way; τ (``eps``) is the adaptivity degree, 1e-3 by default.
    """

    kind: str = "adam"
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        if self.kind not in ADAPTIVE:
            raise ConfigError("optimizer", f"unknown adaptive optimizer {self.kind!r}; accepted: {', '.join(ADAPTIVE)}")
        for name, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= value < 1:
                raise ConfigError(name, f"must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ConfigError("eps", f"must be > 0, got {self.eps}")

    def init(self, params):
        return {"m": torch.zeros_like(params), "v": torch.full_like(params, self.eps**2)}

    def update(self, direction, state, params, lr_scale=1.0):
        m = self.beta1 * state["m"] + (1 - self.beta1) * direction
        sq = direction * direction
        if self.kind == "adagrad":
            v = state["v"] + sq
        elif self.kind == "adam":
            v = self.beta2 * state["v"] + (1 - self.beta2) * sq
        else:
            v = state["v"] - (1 - self.beta2) * sq * torch.sign(state["v"] - sq)
        return self.lr * lr_scale * m / (v.sqrt() + self.eps), {"m": m, "v": v}


@dataclass(frozen=True)
class ServerAdGD:
    """Adaptive gradient descent without descent (Malitsky & Mishchenko 2020, Algorithm 1) on the server.

    The pseudo-gradient g_k = Δ stands in for ∇f(x_k) (Nastya, Malinovsky, Mishchenko & Richtárik 2022, §8):

        λ_k = min{ √(1+θ_{k−1})·λ_{k−1},  ‖x_k − x_{k−1}‖ / (2‖g_k − g_{k−1}‖) },   θ_k = λ_k/λ_{k−1},
        x_{k+1} = x_k − λ_k g_k,

    with x₁ = x₀ − λ₀g₀ (λ₀ = ``lr``) and θ₀ = +∞, so λ₁ is set by the curvature estimate alone.
    With Nastya's g = mean local gradient and a small client step this is AdGD on f itself; the paper
    does not say which form its experiment used, so this is the plain form of the AdGD paper.

    No curvature estimate: when ‖x_k − x_{k−1}‖ = 0 (the model did not move: g_{k−1} = 0, a
    stationary point) or ‖g_k − g_{k−1}‖ = 0 (f linear along the last step, or the model stopped),
    the ratio is 0/0, 0/c or c/0 and says nothing about the local smoothness; the step is kept,
    λ_k = λ_{k−1} (θ_k = 1), as the AdGD convention for a vanishing difference. Reading c/0 as +∞
    would instead give λ_k = √(1+θ_{k−1})λ_{k−1}, which is +∞ right after the first step (θ₀ = +∞), and
    0/c = 0 would stop the method for good (and divide by λ = 0 next). A kept step still satisfies
    both inequalities of the analysis, λ_k ≤ √(1+θ_{k−1})λ_{k−1} and 2λ_k‖g_k − g_{k−1}‖ ≤ ‖x_k − x_{k−1}‖
    whenever the latter has content. A non-finite or zero estimate (underflow) is treated the same way.
    """

    lr: float = 1e-6

    def __post_init__(self) -> None:
        _check_lr(self.lr)

    def init(self, params):
        return {"prev_params": params.clone(), "prev_direction": torch.zeros_like(params), "lr": torch.tensor(self.lr, dtype=torch.float64), "theta": torch.tensor(math.inf, dtype=torch.float64), "started": torch.tensor(False)}

    def update(self, direction, state, params, lr_scale=1.0):
        lam = float(state["lr"])
        if bool(state["started"]):
            moved = float((params - state["prev_params"]).norm())
            diff = float((direction - state["prev_direction"]).norm())
            curvature = moved / (2 * diff) if moved > 0 and diff > 0 else math.nan
            new = min(math.sqrt(1 + float(state["theta"])) * lam, curvature) if math.isfinite(curvature) and curvature > 0 else lam
            theta, lam = new / lam, new
        else:
            theta = math.inf
        new_state = {
            "prev_params": params.clone(), "prev_direction": direction.clone(), "lr": torch.tensor(lam, dtype=torch.float64),
            "theta": torch.tensor(theta, dtype=torch.float64), "started": torch.tensor(True),
        }
        return lam * lr_scale * direction, new_state


@dataclass(frozen=True)
class MetaEpochExtrapolation:
    """RR-CLI's global step (Malinovsky, Horváth, Burlachenko & Richtárik 2023, Algorithm 1, line 18) around any server optimizer.

    Rounds run ``inner`` from the meta-epoch's anchor x_t; after the R-th round of the meta-epoch

        x_{t+1} = x_t − θ·(x_t − x_t^R)/(ηR),

    with η the inner server step size. θ = ηR gives x_{t+1} = x_t^R (no extrapolation).
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

    def init(self, params):
        return {"inner": self.inner.init(params), "anchor": params.clone(), "round": torch.tensor(0)}

    def update(self, direction, state, params, lr_scale=1.0):
        step, inner_state = self.inner.update(direction, state["inner"], params, lr_scale)
        count = int(state["round"]) + 1
        if count < self.rounds:
            return step, {"inner": inner_state, "anchor": state["anchor"], "round": torch.tensor(count)}
        anchor = state["anchor"]
        end = anchor - self.global_lr / (self.inner.lr * self.rounds) * (anchor - (params - step))
        return params - end, {"inner": inner_state, "anchor": end.clone(), "round": torch.tensor(0)}


Lr = Annotated[float, Field(gt=0, description="server step size η_g")]
Beta = Annotated[float, Field(ge=0, lt=1)]


def sgd(lr: Lr = 1.0) -> ServerSGD:
    return ServerSGD(lr)


def heavy_ball(lr: Lr = 1.0, momentum: Beta = 0.9) -> ServerHeavyBall:
    return ServerHeavyBall(lr, momentum)


def _adaptive(kind: str):
    def factory(lr: Lr = 0.01, beta1: Beta = 0.9, beta2: Beta = 0.99, eps: Annotated[float, Field(gt=0)] = 1e-3) -> ServerAdaptive:
        return ServerAdaptive(kind, lr, beta1, beta2, eps)

    return factory


def adgd(lr: Lr = 1e-6) -> ServerAdGD:
    return ServerAdGD(lr)


SERVER_OPTIMIZERS = Registry("server.optimizer", runtime=(), noun="server optimizer")
SERVER_OPTIMIZERS.add("sgd", sgd, "x ← x − η_g·Δ", "Horváth et al., FedShuffle, TMLR 2022, Algorithm 1")
SERVER_OPTIMIZERS.add("heavy_ball", heavy_ball, "server heavy-ball momentum on Δ", "Hsu, Qi & Brown 2019 (FedAvgM)")
for _kind in ADAPTIVE:
    SERVER_OPTIMIZERS.add(_kind, _adaptive(_kind), f"Fed{_kind.capitalize()} on the pseudo-gradient", "Reddi et al., Adaptive Federated Optimization, ICLR 2021, Algorithm 2")
SERVER_OPTIMIZERS.add("adgd", adgd, "adaptive gradient descent without descent on Δ", "Malitsky & Mishchenko, ICML 2020, Algorithm 1")
