"""Settings that would do nothing are refused in one line naming the setting and what is accepted."""

import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.runner import build_simulation
from fedshuffle.experiments.schema import Experiment, validate

BASE = {"data": {"client_sizes": [2, 3]}, "local": {"lr": 0.1}, "run": {"rounds": 2}}


def spec(**sections):
    raw = {name: {**BASE.get(name, {}), **sections.get(name, {})} for name in {*BASE, *sections}}
    return validate(Experiment, raw).runs()[0][1]


def test_an_empty_seed_list_is_refused():
    with pytest.raises(ConfigError) as err:
        validate(Experiment, {**BASE, "experiment": {"seeds": []}})
    assert err.value.field == "experiment.seeds" and "one or more seeds" in err.value.message
    assert validate(Experiment, {**BASE, "experiment": {"seeds": [3]}}).seeds(spec()) == [3]


@pytest.mark.parametrize("executor", ["sequential", "threaded"])
def test_a_chunk_size_for_an_executor_without_chunks_is_refused(executor):
    with pytest.raises(ConfigError) as err:
        spec(run={"executor": executor, "chunk_size": 2})
    assert err.value.field == "run.chunk_size" and "executor 'auto', executor 'vectorized', executor 'ray'" in str(
        err.value
    )
    assert f"executor {executor!r} takes" in err.value.message


@pytest.mark.parametrize("executor", ["vectorized", "auto"])
def test_a_chunk_size_for_an_executor_that_chunks_is_kept(executor):
    assert spec(run={"executor": executor, "chunk_size": 2}).run.chunk_size == 2


def test_dropping_every_planned_step_is_refused_and_fewer_is_kept():
    """Sizes 2 and 3 at batch size 1, one epoch: the most a client plans is 3 steps."""
    with pytest.raises(ConfigError) as err:
        build_simulation(spec(local={"drop_last_steps": 3}), 0)
    assert err.value.field == "local.drop_last_steps" and "the most a client plans is 3" in err.value.message
    assert "accepted: 0..2" in err.value.message
    with pytest.raises(ConfigError, match="local.drop_last_steps: 30 drops"):
        build_simulation(spec(local={"drop_last_steps": 30}), 0)
    sim, _ = build_simulation(spec(local={"drop_last_steps": 2}), 0)
    sim.step()
    assert sim.counters.sample_gradients == 2  # each client keeps one step: max(1, 2 - 2) + max(1, 3 - 2)
    sim, _ = build_simulation(spec(local={"drop_last_steps": 2, "epochs": 2}), 0)  # 6 steps planned at most
    sim.step()
    assert sim.counters.sample_gradients == 2 + 4


def test_the_run_command_refuses_them_before_writing_anything(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[data]\nclient_sizes = [2, 3]\n[local]\nlr = 0.1\ndrop_last_steps = 5\n[run]\nrounds = 2\n")
    result = CliRunner().invoke(app, ["run", str(config), "--out", str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 2 and "local.drop_last_steps: 5 drops every planned step" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "method,aggregation",
    [("fedavg_min", {}), ("fedshuffle", {}), ("fednova", {"normalization": "sum_one"})],
)
def test_fednovas_tau_eff_is_refused_where_the_aggregation_does_not_use_it(method, aggregation):
    """τ_eff enters only FedNova's unbiased normalized weighting (with sum-one normalization it cancels)."""
    with pytest.raises(ConfigError) as err:
        build_simulation(spec(method={"name": method}, aggregation={**aggregation, "tau_eff": "cohort"}), 0)
    assert err.value.field == "aggregation.tau_eff" and "only weighting = 'normalized'" in err.value.message
    sim, _ = build_simulation(spec(method={"name": "fednova"}, aggregation={"tau_eff": "cohort"}), 0)
    assert sim.algorithm.aggregator.tau_eff == "cohort"


def test_more_minibatches_per_epoch_than_the_smallest_client_has_samples_is_refused_before_the_first_round():
    """Sizes 2 and 3: K = 3 minibatches per epoch cannot split client 0's 2 samples (found at build, not when client 0
    is first sampled)."""
    with pytest.raises(ConfigError) as err:
        build_simulation(spec(local={"epoch_batches": 3}, sampler={"name": "uniform", "cohort": 1}), 0)
    assert err.value.field == "local.epoch_batches" and "client 0 has 2 (accepted: 1..2" in err.value.message
    sim, _ = build_simulation(spec(local={"epoch_batches": 2}), 0)
    sim.step()
    assert sim.counters.sample_gradients == 2 + 3  # K = 2 minibatches per client are one pass over its samples
