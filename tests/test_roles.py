"""Roles of settings and theorems as registry entries: a plugin method in a user's own module declares that its
``gamma`` is a step size and its ``eta`` is not, and names its own theorem; then ``gamma = 'theory'`` resolves through
that theorem, a sweep over ``gamma`` runs as replicas and one over ``eta`` does not, and ``check_method`` passes."""

from __future__ import annotations

import importlib
import sys

from typing import Annotated

import pytest
from pydantic import Field
from typer.testing import CliRunner

from fedshuffle.analysis.theory import THEOREMS, smoothness, theoretical_step_sizes
from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import ModelSize, StepScale, StepSize
from fedshuffle.experiments.build import build_algorithm_from, build_problem_and_data, build_sampler, resolve_step_sizes
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.methods import METHODS, Method
from fedshuffle.problems import PROBLEMS, Problem
from fedshuffle.testing import check_method

PLUGIN = '''
"""A user's method: FedAvg whose server direction is scaled by its own step size gamma and damped by eta."""

from typing import Annotated

from pydantic import Field

import fedshuffle as fs
from fedshuffle.analysis.theory import THEOREMS
from fedshuffle.core.registry import StepSize


class ScaledFedAvg(fs.Method):
    """x ← x − γ(1 − η)·Σ ω_iΔ_i."""

    def __init__(
        self,
        aggregator,
        gamma: Annotated[float, Field(gt=0, description="the server step γ"), StepSize()] = 1.0,
        eta: Annotated[float, Field(ge=0, lt=1, description="a damping share, not a step size")] = 0.0,
    ):
        super().__init__(aggregator)
        self.gamma, self.eta = gamma, eta

    def aggregate(self, rnd, params, state, payload):
        direction, state, extras = super().aggregate(rnd, params, state, payload)
        return self.gamma * (1 - self.eta) * direction, state, extras


def half_inverse_smoothness(L_client_max: float) -> dict[str, float]:
    """γ = 1/(2L), L the largest client smoothness."""
    return {"gamma": 0.5 / L_client_max}


THEOREMS.add("half_inverse", half_inverse_smoothness, "γ = 1/(2L)", "a closed form of the tests", gives=("gamma",))
fs.METHODS.add(
    "scaled_fedavg",
    ScaledFedAvg,
    "FedAvg with a scaled, damped server direction",
    theorems=("half_inverse",),
    aggregation={"normalization": "sum_one"},
)
'''

CONFIG = """
[experiment]
plugins = ["rolesplugin"]
[problem]
name = "logistic"
l2 = 0.01
[data]
source = "synthetic"
samples = 120
features = 4
partition = "dirichlet"
clients = 6
seed = 1
[method]
name = "scaled_fedavg"
[local]
lr = 0.05
batch_size = 4
[sampler]
name = "uniform"
cohort = 3
[run]
rounds = 3
eval_every = 3
executor = "vectorized"
"""

RAW = {
    "problem": {"name": "logistic", "l2": 0.01},
    "data": {"source": "synthetic", "samples": 120, "features": 4, "partition": "dirichlet", "clients": 6, "seed": 1},
    "local": {"lr": 0.05, "batch_size": 4},
    "sampler": {"name": "uniform", "cohort": 3},
}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The plugin module, imported from a folder of its own (as a user's module is), forgotten afterwards."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "rolesplugin.py").write_text(PLUGIN)
    (folder / "scaled.toml").write_text(CONFIG)
    sys.path.insert(0, str(folder))
    try:
        importlib.import_module("rolesplugin")
        yield folder
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("rolesplugin", None)
        METHODS.remove("scaled_fedavg")
        THEOREMS.remove("half_inverse")


def spec(method: dict, **server) -> RunSpec:
    return validate(RunSpec, {**RAW, "method": {"name": "scaled_fedavg", **method}, "server": server})


def test_a_plugin_step_size_set_to_theory_resolves_through_the_theorem_its_method_names(plugin):
    given = spec({"gamma": "theory", "eta": 0.25})
    assert given.step_sizes() == {"method.gamma": "gamma", "local.lr": "lr", "server.lr": "server_lr"} | {
        "server.global_lr": "global_lr"
    }
    problem, data = build_problem_and_data(given)
    resolved, info = resolve_step_sizes(given, problem, data, build_sampler(given.sampler, data))
    gamma = 0.5 / smoothness(problem, data).client_max
    assert resolved.method.gamma == gamma and info["used"] == {"gamma": gamma} and info["rule"] == "half_inverse"
    assert resolved.method.eta == 0.25 and resolved.local.lr == 0.05  # the settings that are numbers stay as given
    assert build_algorithm_from(resolved).method.gamma == gamma
    with pytest.raises(ConfigError) as err:  # eta is not a step size: 'theory' is not a value of it
        spec({"eta": "theory"})
    assert err.value.field == "method.eta"
    with pytest.raises(ConfigError, match="accepted for scaled_fedavg: half_inverse") as err:
        resolve_step_sizes(
            spec({"gamma": "theory"}, theory_rule="yang_1"), problem, data, build_sampler(given.sampler, data)
        )
    assert err.value.field == "server.theory_rule"
    with pytest.raises(ConfigError, match="half_inverse gives no lr for scaled_fedavg") as err:
        resolve_step_sizes(
            validate(RunSpec, {**RAW, "method": {"name": "scaled_fedavg"}, "local": {"lr": "theory"}}),
            problem,
            data,
            build_sampler(given.sampler, data),
        )
    assert err.value.field == "local.lr"


def test_a_sweep_over_a_plugin_step_size_runs_as_replicas_and_one_over_another_setting_does_not(plugin, tmp_path):
    def sweep(grid: str, out: str):
        result = CliRunner().invoke(
            app,
            [
                "sweep",
                str(plugin / "scaled.toml"),
                "--grid",
                grid,
                "--out",
                str(tmp_path / out),
                "--plugins",
                "rolesplugin",
                "--workers",
                "1",
            ],
        )
        assert result.exit_code == 0, result.output
        return " ".join(result.stderr.split())

    assert "2 runs as 1 batched simulation of 2 replicas" in sweep("method.gamma=0.5,1.0", "gamma")
    on_their_own = sweep("method.eta=0.0,0.5", "eta")
    assert "batched simulation" not in on_their_own and "they differ in method.eta" in on_their_own


def test_a_node_without_the_federation_s_data_refuses_a_plugin_step_size_set_to_theory(plugin):
    from fedshuffle.integrations.flower.nodedata import refuse_theory

    with pytest.raises(ConfigError, match="'theory' step sizes need the whole federation's data") as err:
        refuse_theory(spec({"gamma": "theory"}), "this node brings only its own")
    assert err.value.field == "method.gamma"
    refuse_theory(spec({"gamma": 0.5}), "this node brings only its own")  # numbers pass


def test_the_plugin_method_passes_check_method(plugin):
    check_method("scaled_fedavg")


def test_the_built_in_step_sizes_are_declared_where_the_settings_are():
    def roles(method: str, **server) -> dict:
        return validate(RunSpec, {"method": {"name": method}, "server": server}).roles()

    common = {
        "local.lr": StepSize("lr"),
        "local.lr_multiplier": StepScale(),
        "server.lr": StepSize("server_lr"),
        "server.global_lr": StepSize("global_lr"),
    }
    assert roles("fedavg") == roles("scaffold") == roles("fedavg", optimizer="adam") == common
    assert roles("fedcdr") == {"method.alpha": StepSize("alpha"), "method.eta": StepSize("eta"), **common}
    assert roles("feddyn") == {"method.alpha": StepSize("alpha"), **common}
    assert validate(RunSpec, {"method": {"name": "fedcdr", "eta": "theory", "alpha": "theory"}}).method.eta == "theory"


def test_theorems_are_registry_entries_that_declare_what_they_read_and_give():
    for name in ("rr_cli_c1", "rr_cli_c2", "karimireddy_i", "yang_1"):
        assert THEOREMS[name].citation and THEOREMS[name].gives == ("lr", "server_lr")
    assert THEOREMS["rr_cli_c2"].reads == ("L_sample_max", "N", "kappa")
    assert THEOREMS["karimireddy_i"].reads == ("L_client_max", "N")
    with pytest.raises(ValueError, match="reads 'L'"):
        THEOREMS.add("bad", lambda L: {"lr": 1 / L}, "", gives=("lr",))
    assert "bad" not in THEOREMS
    with pytest.raises(ConfigError, match="unknown 'c3'"):
        theoretical_step_sizes("c3", None, 1)
    # each method names the theorems that cover it, its own first: server.theory_rule defaults to it
    assert METHODS["nastya"].theorems == ("rr_cli_c2", "rr_cli_c1") and METHODS["fedshuffle"].theorems == ()
    assert validate(RunSpec, {"method": {"name": "nastya"}}).server.theory_rule == "rr_cli_c2"
    assert validate(RunSpec, {"method": {"name": "fedshuffle"}}).server.theory_rule is None


class Wide(Problem):
    """A problem of ``width`` parameters (never trained: it is refused before)."""

    def __init__(self, width: int) -> None:
        self.width = width

    @property
    def dim(self) -> int:
        return self.width

    def losses(self, params, features, labels):
        return ((params[: features.shape[1]] - features) ** 2).sum(-1)


def wide(samples, width: Annotated[int, Field(ge=1, description="parameters"), ModelSize()] = 4) -> Wide:
    return Wide(width)


def test_a_model_too_large_to_fit_is_refused_naming_the_setting_declared_to_size_it():
    """The role ModelSize: the MLP's widths and the synthetic source's class count are declared so, and a plugin
    problem's own width is named like them."""
    PROBLEMS.add("wide", wide, "a problem as wide as asked")
    try:
        raw = {"data": {"source": "targets", "client_sizes": [2, 3]}, "local": {"lr": 0.1}}
        spec = validate(RunSpec, {**raw, "problem": {"name": "wide", "width": 10**13}})
        assert spec.roles()["problem.width"] == ModelSize()
        with pytest.raises(ConfigError, match="needs about") as err:
            build_problem_and_data(spec)
        assert err.value.field == "problem.width"
    finally:
        PROBLEMS.remove("wide")
    mlp = validate(RunSpec, {"problem": {"name": "mlp"}, "data": {"source": "synthetic"}}).roles()
    assert mlp["problem.hidden"] == mlp["data.classes"] == ModelSize()


def test_inspect_shows_every_step_size_of_a_run_the_plugin_s_included(plugin):
    import json

    path = str(plugin / "scaled.toml")
    result = CliRunner().invoke(app, ["inspect", "--config", path, "--json", "--plugins", "rolesplugin"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["run"]
    assert row["step_sizes"] == {"method.gamma": 1.0, "local.lr": 0.05, "server.global_lr": None, "server.lr": 1.0}
    table = CliRunner().invoke(app, ["inspect", "--config", path, "--plugins", "rolesplugin"])
    assert table.exit_code == 0 and "method.gamma" in table.stdout and "method.eta" not in table.stdout, table.output


def test_replicas_differ_only_in_step_sizes_and_their_multipliers_not_in_other_roles(tmp_path):
    from fedshuffle.replicas import replica_key

    def key(**sections) -> str:
        raw = {"problem": {"name": "mlp", "hidden": [8]}, "data": {"source": "synthetic", "classes": 3, "seed": 0}}
        raw.update({"local": {"lr": 0.1}, "run": {"executor": "vectorized"}})
        for name, values in sections.items():
            raw[name] = {**raw.get(name, {}), **values}
        return replica_key(validate(RunSpec, raw))

    same = {
        key(),
        key(local={"lr": 0.3}),
        key(local={"lr_multiplier": 2}),
        key(server={"lr": 0.5}),
        key(run={"seed": 4}),
    }
    assert len(same) == 1
    assert key(problem={"hidden": [16]}) not in same and key(data={"classes": 4}) not in same  # ModelSize: other data


class RequiredStep(Method):
    """FedAvg whose server direction is scaled by a step size that has no default."""

    def __init__(self, aggregator, gamma: Annotated[float, Field(gt=0, description="the server step γ"), StepSize()]):
        super().__init__(aggregator)
        self.gamma = gamma


def test_a_required_step_size_may_be_theory_and_is_still_required(plugin):
    METHODS.add("required_step", RequiredStep, "a step size without a default", theorems=("half_inverse",))
    try:
        given = spec_of_method("required_step", gamma="theory")
        assert given.method.gamma == "theory"
        problem, data = build_problem_and_data(given)
        resolved, _ = resolve_step_sizes(given, problem, data, build_sampler(given.sampler, data))
        assert resolved.method.gamma == 0.5 / smoothness(problem, data).client_max
        with pytest.raises(ConfigError, match="method 'required_step' needs it") as err:
            spec_of_method("required_step")
        assert err.value.field == "method.gamma"
    finally:
        METHODS.remove("required_step")


def spec_of_method(name: str, **settings) -> RunSpec:
    return validate(RunSpec, {**RAW, "method": {"name": name, **settings}})
