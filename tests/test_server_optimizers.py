"""Server optimizers as chains of transforms: each registered optimizer against the closed form of its
paper's equations, their declared settings, their states in a checkpoint, and a new optimizer made of
one new transform."""

import inspect
import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, get_args

import numpy as np
import pytest
import torch
from pydantic import Field
from pydantic.fields import FieldInfo

from fedshuffle.core.checkpoint import load_checkpoint, save_checkpoint
from fedshuffle.core.errors import ConfigError
from fedshuffle.methods.algorithm import build_algorithm
from fedshuffle.server import SERVER_OPTIMIZERS, MetaEpochExtrapolation, Optimizer
from fedshuffle.server.transforms import (
    ScaleByAdagrad,
    ScaleByAdam,
    ScaleBySchedule,
    ScaleByYogi,
    StepInputs,
    Trace,
    chain,
)

ROUNDS = 6
SCALES = [1.0, 0.5, 1.0, 0.1, 1 / 3, 2.0]  # schedule factors s_t


def sgd_reference(directions, params, s, lr=1.0):
    """x ← x − η·s_t·Δ_t."""
    return [lr * s_t * d for d, s_t in zip(directions, s)]


def heavy_ball_reference(directions, params, s, lr=1.0, momentum=0.9):
    """v_1 = Δ_1, v_t = βv_{t−1} + Δ_t; x ← x − η·s_t·v_t."""
    steps, v = [], None
    for d, s_t in zip(directions, s):
        v = d.copy() if v is None else momentum * v + d
        steps.append(lr * s_t * v)
    return steps


def adaptive_reference(kind):
    """Reddi et al., ICLR 2021, Algorithm 2, with m_0 = 0 and v_0 = τ² and no bias correction:
    m_t = β₁m_{t−1} + (1−β₁)Δ_t; v_t by ``kind``; x ← x − η·s_t·m_t/(√v_t + τ)."""

    def reference(directions, params, s, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-3):
        m, v, steps = np.zeros_like(directions[0]), np.full_like(directions[0], eps**2), []
        for d, s_t in zip(directions, s):
            m = beta1 * m + (1 - beta1) * d
            if kind == "adagrad":
                v = v + d**2
            elif kind == "adam":
                v = beta2 * v + (1 - beta2) * d**2
            else:
                v = v - (1 - beta2) * d**2 * np.sign(v - d**2)
            steps.append(lr * s_t * m / (np.sqrt(v) + eps))
        return steps

    return reference


def adgd_reference(directions, params, s, lr=1e-6):
    """Malitsky & Mishchenko, ICML 2020, Algorithm 1 with g_k = Δ_k: λ_0 = lr, θ_0 = +∞,
    λ_k = min{√(1+θ_{k−1})λ_{k−1}, ‖x_k − x_{k−1}‖/(2‖g_k − g_{k−1}‖)}, θ_k = λ_k/λ_{k−1}; step λ_k·s_k·g_k."""
    lam, theta, steps = lr, math.inf, []
    for k, (d, x, s_k) in enumerate(zip(directions, params, s)):
        if k > 0:
            new = min(
                math.sqrt(1 + theta) * lam,
                np.linalg.norm(x - params[k - 1]) / (2 * np.linalg.norm(d - directions[k - 1])),
            )
            theta, lam = new / lam, new
        steps.append(lam * s_k * d)
    return steps


REFERENCES = {
    "sgd": sgd_reference,
    "heavy_ball": heavy_ball_reference,
    "adam": adaptive_reference("adam"),
    "adagrad": adaptive_reference("adagrad"),
    "yogi": adaptive_reference("yogi"),
    "adgd": adgd_reference,
}

#: settings other than the defaults, one per parameter of each optimizer
ADAPTIVE = {"lr": 0.05, "beta1": 0.8, "beta2": 0.95, "eps": 1e-2}
OTHER_SETTINGS = {
    "sgd": {"lr": 0.7},
    "heavy_ball": {"lr": 0.3, "momentum": 0.5},
    "adam": ADAPTIVE,
    "yogi": ADAPTIVE,
    "adagrad": {"lr": 0.05, "beta1": 0.8, "eps": 1e-2},
    "adgd": {"lr": 0.3},
}


def run_rounds(optimizer, seed=0, dim=5, rounds=ROUNDS):
    """Random pseudo-gradients of varied scale, applied from a random start as the simulation does
    (x ← x − step); the directions, the models x_k the steps were taken from and the steps."""
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.normal(size=dim))
    state = optimizer.init(x)
    directions, params, steps = [], [], []
    for t in range(rounds):
        d = torch.tensor(rng.normal(size=dim) * 10.0 ** (t % 3 - 1))
        step, state = optimizer.update(d, state, x, SCALES[t])
        directions.append(d.numpy())
        params.append(x.numpy())
        steps.append(step.numpy())
        x = x - step
    return directions, params, steps


def test_every_registered_optimizer_has_a_reference():
    assert set(REFERENCES) == set(SERVER_OPTIMIZERS.names()) == set(OTHER_SETTINGS), (
        "add the new optimizer's closed form to REFERENCES"
    )


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS.names())
@pytest.mark.parametrize("given", ["defaults", "other"])
def test_every_registered_optimizer_follows_the_closed_form_of_its_paper(name, given):
    settings = OTHER_SETTINGS[name] if given == "other" else {}
    directions, params, steps = run_rounds(SERVER_OPTIMIZERS[name].build(settings))
    expected = REFERENCES[name](directions, params, SCALES, **settings)
    for t, (step, ref) in enumerate(zip(steps, expected)):
        np.testing.assert_allclose(step, ref, rtol=1e-12, atol=0, err_msg=f"{name}, round {t}")


def test_yogi_grows_its_second_moment_faster_than_adam_while_v_is_below_the_squared_direction():
    g, x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    yogi, adam = SERVER_OPTIMIZERS["yogi"].build({"lr": 0.1}), SERVER_OPTIMIZERS["adam"].build({"lr": 0.1})
    s_y, s_a = yogi.init(x), adam.init(x)
    for _ in range(5):
        _, s_y = yogi.update(g, s_y, x)
        _, s_a = adam.update(g, s_a, x)
    assert torch.all(
        s_y["scale_by_yogi"]["v"] > s_a["scale_by_adam"]["v"]
    )  # additive growth (1−β₂)g² against β₂'s decay
    torch.testing.assert_close(
        s_y["scale_by_yogi"]["m"], s_a["scale_by_adam"]["m"], rtol=0, atol=0
    )  # the same first moment


@pytest.mark.parametrize(
    "kind", [ScaleByAdam(0.9, 0.99, 1e-3), ScaleByYogi(0.9, 0.99, 1e-3), ScaleByAdagrad(0.9, 1e-3)]
)
def test_the_adaptive_moments_are_of_the_updates_a_transform_receives(kind):
    """As in optax: a transform in front (here a scale by ½, as a clip would be) changes m and v alike, so the step of
    chain(scale ½, moments) is the moments of ½Δ: m/(√v + τ) of the halved directions, not of Δ."""
    x, rng = torch.zeros(3, dtype=torch.float64), np.random.default_rng(3)
    halved, direct = chain(ScaleBySchedule(0.5), kind), kind
    s_half, s_direct = halved.init(x), direct.init(x)
    for _ in range(4):
        d = torch.tensor(rng.normal(size=3))
        step, s_half = halved.update(d, s_half, StepInputs(x))
        expected, s_direct = direct.update(0.5 * d, s_direct, StepInputs(x))
        torch.testing.assert_close(step, expected, rtol=1e-15, atol=0)
    torch.testing.assert_close(s_half[kind.key]["v"], s_direct["v"], rtol=0, atol=0)


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS.names())
def test_meta_epoch_extrapolation_lands_where_its_formula_says(name):
    """After R rounds from the anchor x_t: x_{t+1} = x_t − θ(x_t − x_t^R)/(ηR) (RR-CLI, Algorithm 1, line 18)."""
    inner = SERVER_OPTIMIZERS[name].build(OTHER_SETTINGS[name])
    theta, rounds = 0.37, 3
    wrapped = MetaEpochExtrapolation(inner, theta, rounds)
    rng = np.random.default_rng(1)
    x = anchor = torch.tensor(rng.normal(size=4))
    state, inner_state, inner_x = wrapped.init(x), inner.init(x), x
    for t in range(rounds):
        d = torch.tensor(rng.normal(size=4))
        inner_step, inner_state = inner.update(d, inner_state, inner_x, SCALES[t])
        step, state = wrapped.update(d, state, x, SCALES[t])
        x, inner_x = x - step, inner_x - inner_step
    torch.testing.assert_close(x, anchor - theta / (inner.lr * rounds) * (anchor - inner_x), rtol=1e-13, atol=0)
    torch.testing.assert_close(
        state["anchor"], x, rtol=1e-13, atol=0
    )  # the next anchor is x_{t+1} (up to x − (x − x_{t+1}) rounding)
    assert int(state["round"]) == 0


def test_the_declared_defaults():
    defaults = {
        name: {k: p.default for k, p in inspect.signature(SERVER_OPTIMIZERS[name].factory).parameters.items()}
        for name in SERVER_OPTIMIZERS
    }
    adaptive = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-3}
    assert defaults == {
        "sgd": {"lr": 1.0},
        "heavy_ball": {"lr": 1.0, "momentum": 0.9},
        "adam": adaptive,
        "yogi": adaptive,
        "adagrad": {"lr": 0.01, "beta1": 0.9, "eps": 1e-3},
        "adgd": {"lr": 1e-6},
    }
    assert SERVER_OPTIMIZERS["heavy_ball"].check({}) == {"lr": 1.0, "momentum": 0.9}


def declared(name):
    """(setting, its pydantic FieldInfo) for each keyword parameter of the optimizer's factory."""
    out = []
    for key, parameter in inspect.signature(SERVER_OPTIMIZERS[name].factory).parameters.items():
        annotation = parameter.annotation
        info = next((a for a in get_args(annotation)[1:] if isinstance(a, FieldInfo)), None)
        assert get_args(annotation)[0] is float and info is not None and info.description, (
            f"{name}.{key}: Annotated[float, Field(description=...)]"
        )
        out.append((key, info))
    return out


def bad_values(info):
    """Values just outside the constraints a setting declares, and values of the wrong type."""
    bounds = {type(m).__name__: m for m in info.metadata}
    values = [float("nan"), [0.5]]
    if "Gt" in bounds:
        values.append(bounds["Gt"].gt)
    if "Ge" in bounds:
        values.append(np.nextafter(bounds["Ge"].ge, -math.inf))
    if "Lt" in bounds:
        values.append(bounds["Lt"].lt)
    return values


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS.names())
def test_settings_outside_their_declared_constraints_are_refused_by_name(name):
    for key, info in declared(name):
        for value in bad_values(info):
            with pytest.raises(ConfigError) as err:
                SERVER_OPTIMIZERS[name].build({key: value})
            assert err.value.field == key and "\n" not in str(err.value), (name, key, value)
    with pytest.raises(ConfigError) as err:
        SERVER_OPTIMIZERS[name].build({"not_a_setting": 0.5})
    assert (
        err.value.field == "not_a_setting"
        and name in err.value.message
        and all(k in err.value.message for k, _ in declared(name))
    )


def test_a_setting_of_another_optimizer_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"^beta1: not a setting of server optimizer 'sgd'; it takes lr$"):
        SERVER_OPTIMIZERS["sgd"].build({"beta1": 0.5})
    with pytest.raises(ConfigError, match=r"^beta2: .*'adagrad'.*; it takes lr, beta1, eps$"):
        SERVER_OPTIMIZERS["adagrad"].build({"beta2": 0.9})


def test_an_algorithm_takes_only_the_settings_of_its_server_optimizer():
    with pytest.raises(ConfigError) as err:
        build_algorithm("fedavg", {"local": {"lr": 0.1}, "server": {"optimizer": "sgd", "beta1": 0.5}})
    assert err.value.field == "server.beta1"
    implicit = build_algorithm(
        "fedavg", {"local": {"lr": 0.1}, "server": {"momentum": 0.0}}
    ).server  # momentum given: heavy ball, here with β = 0
    assert implicit.lr == 1.0 and set(implicit.init(torch.zeros(2))) == {"trace", "scale_by_schedule"}
    explicit = build_algorithm(
        "fedavg", {"local": {"lr": 0.1}, "server": {"optimizer": "heavy_ball", "momentum": 0.0}}
    ).server
    x = torch.zeros(2, dtype=torch.float64)
    state = explicit.init(x)
    for d in ([1.0, 2.0], [3.0, -1.0]):
        step, state = explicit.update(torch.tensor(d, dtype=torch.float64), state, x)
    assert explicit.lr == 1.0 and step.tolist() == [3.0, -1.0]  # β = 0 as given, not the default 0.9


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS.names())
@pytest.mark.parametrize("meta", [False, True])
def test_server_states_continue_bit_for_bit_from_a_checkpoint(tmp_path, name, meta):
    """The nested state of a chain (and of the meta-epoch wrapper around it) goes through a checkpoint file
    (weights_only loading) and continues with the same bytes as without it."""
    optimizer = SERVER_OPTIMIZERS[name].build(OTHER_SETTINGS[name])
    if meta:
        optimizer = MetaEpochExtrapolation(optimizer, 0.5, 4)
    rng = np.random.default_rng(2)
    x = torch.tensor(rng.normal(size=4), dtype=torch.float32)
    directions = [torch.tensor(rng.normal(size=4), dtype=torch.float32) for _ in range(6)]
    state = optimizer.init(x)
    for t, d in enumerate(directions[:3]):
        step, state = optimizer.update(d, state, x, SCALES[t])
        x = x - step
    save_checkpoint(tmp_path / "ckpt", {"server": state, "params": x})
    restored = load_checkpoint(tmp_path / "ckpt")
    runs = []
    for state, x in ((state, x), (restored["server"], restored["params"])):
        steps = []
        for t, d in enumerate(directions[3:], start=3):
            step, state = optimizer.update(d, state, x, SCALES[t])
            x = x - step
            steps.append(step.numpy().tobytes())
        runs.append(steps)
    assert runs[0] == runs[1]


@dataclass(frozen=True)
class ScaleByAMSGrad(ScaleByAdam):
    """AMSGrad (Reddi, Kale & Kumar, ICLR 2018): Adam's moments of u, v̂ ← max(v̂, v), u ← m/(√v̂ + τ)."""

    key: ClassVar[str] = "scale_by_amsgrad"

    def init(self, params):
        return {**super().init(params), "v_max": torch.full_like(params, self.eps**2)}

    def update(self, updates, state, inputs):
        m = self.beta1 * state["m"] + (1 - self.beta1) * updates
        v = self.accumulate(state["v"], updates * updates)
        v_max = torch.maximum(state["v_max"], v)
        return m / (v_max.sqrt() + self.eps), {"m": m, "v": v, "v_max": v_max}


def amsgrad(
    lr: Annotated[float, Field(gt=0, description="server step size η_g")] = 0.01,
    beta1: Annotated[float, Field(ge=0, lt=1, description="β₁")] = 0.9,
    beta2: Annotated[float, Field(ge=0, lt=1, description="β₂")] = 0.99,
    eps: Annotated[float, Field(gt=0, description="τ")] = 1e-3,
):
    return Optimizer(chain(ScaleByAMSGrad(beta1, beta2, eps), ScaleBySchedule(lr)), lr)


def test_a_new_optimizer_is_one_new_transform_chained_with_the_others():
    """AMSGrad from a transform and a factory outside the package: the shared parts keep Adam's numbers,
    its own state sits under its own key, and Adam's state is untouched by its existence."""
    entry = SERVER_OPTIMIZERS.add("amsgrad_test", amsgrad, "AMSGrad (a test's)")
    try:
        optimizer, adam = entry.build({"lr": 0.1}), SERVER_OPTIMIZERS["adam"].build({"lr": 0.1})
        with pytest.raises(ConfigError, match="beta2"):
            entry.build({"beta2": 1.0})
    finally:
        SERVER_OPTIMIZERS.remove("amsgrad_test")
    x = torch.zeros(2, dtype=torch.float64)
    s, s_adam = optimizer.init(x), adam.init(x)
    for g in ([1.0, -2.0], [0.1, 0.1], [0.1, 0.1]):
        d = torch.tensor(g, dtype=torch.float64)
        step, s = optimizer.update(d, s, x)
        adam_step, s_adam = adam.update(d, s_adam, x)
    assert set(s) == {"scale_by_schedule", "scale_by_amsgrad"} and set(s_adam) == {"scale_by_schedule", "scale_by_adam"}
    torch.testing.assert_close(s["scale_by_amsgrad"]["v"], s_adam["scale_by_adam"]["v"], rtol=0, atol=0)
    assert torch.all(
        s["scale_by_amsgrad"]["v_max"] > s["scale_by_amsgrad"]["v"]
    )  # the large first direction is remembered
    assert torch.all(step.abs() < adam_step.abs())  # so AMSGrad's steps are smaller than Adam's afterwards


def test_a_chain_keeps_one_state_per_transform():
    with pytest.raises(ValueError, match="trace"):
        chain(Trace(0.5), Trace(0.9))
