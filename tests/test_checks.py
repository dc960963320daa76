"""The public checks (fedshuffle.testing) walked over every registered part, and a user's plugin passing them."""

import json
import os
import subprocess
import sys
import textwrap
import unittest

import pytest

from fedshuffle import testing
from fedshuffle.core.errors import ConfigError
from fedshuffle.data.catalog import PARTITIONS, SOURCES
from fedshuffle.executors import EXECUTORS
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.experiments.sinks import SINKS
from fedshuffle.methods import METHODS
from fedshuffle.problems import PROBLEMS
from fedshuffle.samplers import SAMPLERS
from fedshuffle.schedules import SCHEDULES
from fedshuffle.server import SERVER_OPTIMIZERS

from conftest import SHARED_DATA


#: each checked registry and its check (fedshuffle.testing), by the noun its entries go by
CHECKS = {
    "executor": (EXECUTORS, testing.check_executor),
    "sink": (SINKS, testing.check_sink),
    "method": (METHODS, testing.check_method),
    "server optimizer": (SERVER_OPTIMIZERS, testing.check_server_optimizer),
    "sampler": (SAMPLERS, testing.check_sampler),
    "partition": (PARTITIONS, testing.check_partition),
    "problem": (PROBLEMS, testing.check_problem),
    "source": (SOURCES, testing.check_source),
    "schedule": (SCHEDULES, testing.check_schedule),
}


def registered_by_a_test(entry):
    """A part whose factory is defined outside the package: in this session, one that a test registered for itself
    (and checks itself)."""
    return not getattr(entry.factory, "__module__", "").startswith("fedshuffle.")


@pytest.mark.parametrize(
    "kind, name", [(kind, name) for kind, (registry, _) in CHECKS.items() for name in registry.names()]
)
def test_every_registered_part_passes_its_check_on_the_example_it_declares(kind, name, monkeypatch):
    """Every entry of every checked registry, on its declared example; an example that reads data files skips, naming
    the file, only when the offline datasets beside the repository do not hold it."""
    registry, check = CHECKS[kind]
    entry = registry[name]
    if registered_by_a_test(entry):
        pytest.skip(f"{name} is registered by another test")
    assert entry.example is not None, (
        f"{kind} {name!r} declares no example: give the example its check runs on where it is registered "
        f"({registry.kind} {name!r}: add(..., example=Example(...)), fedshuffle.core.registry.Example)"
    )
    if kind in ("method", "problem"):
        assert entry.citation, f"{kind} {name!r}: give the paper it comes from"
    if SHARED_DATA.is_dir():
        monkeypatch.setenv("FEDSHUFFLE_DATA", str(SHARED_DATA))
    if kind == "executor" and name == "ray":
        pytest.importorskip("ray")
    check(name)


@pytest.mark.parametrize("section", RunSpec.model_fields)
def test_every_section_refuses_the_bad_values_generated_for_its_own_settings(section):
    testing.check_section(section)


def test_a_check_skips_only_for_the_files_its_example_reads_naming_them(monkeypatch, tmp_path):
    """With no data folder, an example that reads files skips naming the first one; one that reads none runs."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(unittest.SkipTest, match="a3a/a3a"):
        testing.check_source("libsvm")
    assert testing.missing_file(SOURCES["npz"].example) is None
    (tmp_path / "a3a").mkdir()
    (tmp_path / "a3a" / "a3a").write_text("")
    monkeypatch.setenv("FEDSHUFFLE_DATA", str(tmp_path))
    assert testing.missing_file(SOURCES["libsvm"].example) is None


def test_bad_values_are_generated_from_the_declared_constraints():
    values = testing.bad_values(METHODS["fedcdr"])
    assert 0 in values["alpha"] and 2 in values["alpha"] and 0 in values["eta"] and "no-such-choice" in values["form"]
    assert values["prox_max_iter"][-1] == 0  # ge=1


PLUGIN = textwrap.dedent('''
    """A method of the user's own, outside the package: FedAvg whose server direction is damped."""
    from typing import Annotated

    from pydantic import Field

    import fedshuffle as fs


    class DampedFedAvg(fs.Method):
        """x ← x − damping·Σ ω_iΔ_i."""

        def __init__(
            self,
            aggregator,
            damping: Annotated[float, Field(gt=0, le=1, description="the server direction's factor")] = 0.5,
        ):
            super().__init__(aggregator)
            self.damping = damping

        def aggregate(self, rnd, params, state, payload):
            direction, state, extras = super().aggregate(rnd, params, state, payload)
            return self.damping * direction, state, extras


    fs.METHODS.add(
        "damped_fedavg",
        DampedFedAvg,
        "FedAvg with a damped server direction",
        "a user's plugin",
        aggregation={"normalization": "sum_one"},
    )
''')


def test_a_method_from_a_users_module_takes_its_setting_from_toml_and_set_and_passes_check_method(tmp_path):
    """One file outside the package: named in [experiment] plugins, configured by TOML and --set, run in worker
    processes (which import it), refused with one line for a bad value, and passing check_method."""
    (tmp_path / "user_methods.py").write_text(PLUGIN)
    (tmp_path / "exp.toml").write_text(
        textwrap.dedent("""
        [experiment]
        name = "damped"
        plugins = ["user_methods"]
        seeds = [0, 1]
        [method]
        name = "damped_fedavg"
        damping = 0.3
        [data]
        client_sizes = [1, 2, 3]
        [local]
        lr = 0.1
        [run]
        rounds = 4
        eval_every = 2
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "fedshuffle", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    run = cli(
        "run",
        "exp.toml",
        "--set",
        "method.damping=0.2",
        "--out",
        "out",
        "--workers",
        "2",
        "--quiet",
        "--plugins",
        "user_methods",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    config = json.loads(next((tmp_path / "out").rglob("config.json")).read_text())
    assert config["spec"]["method"] == {"name": "damped_fedavg", "damping": 0.2}
    bad = cli("run", "exp.toml", "--set", "method.damping=2", "--out", "bad", "--plugins", "user_methods")
    assert bad.returncode == 2 and "method.damping" in bad.stderr and "Traceback" not in bad.stderr
    typo = cli("show", "exp.toml", "--set", "method.dampin=0.2", "--plugins", "user_methods")
    assert typo.returncode == 2 and "did you mean 'damping'" in typo.stderr + typo.stdout
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import user_methods; from fedshuffle.testing import check_method; check_method('damped_fedavg')",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr[-2000:]


def test_a_missing_plugin_is_one_line_naming_it(tmp_path):
    from fedshuffle import plugins
    from fedshuffle.experiments.schema import Experiment

    plugins.allow("no_such_module_here")
    with pytest.raises(ConfigError) as err:
        validate(Experiment, {"experiment": {"plugins": ["no_such_module_here"]}})
    assert err.value.field == "experiment.plugins"
    assert "'no_such_module_here' failed (ModuleNotFoundError" in err.value.message


def test_a_part_defined_in_the_script_cannot_go_to_worker_processes(tmp_path):
    """A script registering a source without a __main__ guard, run with two workers: refused in one line,
    and the script does not run again in the workers."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(f"""
        import numpy as np
        import fedshuffle as fs
        from fedshuffle.data.catalog import SOURCES, Samples

        print("script ran")

        def blobs(rng, samples: int = 30):
            return Samples(rng.normal(size=(samples, 2)), rng.integers(0, 2, samples), 2)

        SOURCES.add("blobs", blobs, "blobs")
        exp = fs.experiment({{"problem": {{"name": "logistic"}},
                              "data": {{"source": "blobs", "partition": "iid", "clients": 3}},
                              "local": {{"lr": 0.1}}, "run": {{"rounds": 2}}}})
        try:
            exp.run({str(tmp_path / "out")!r}, seeds=[0, 1], workers=2, progress=False)
        except fs.ConfigError as error:
            print("refused:", error)
    """)
    )
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.stdout.count("script ran") == 1, done.stdout + done.stderr
    assert "refused: data.source: 'blobs' is defined in the script being run" in done.stdout, done.stdout + done.stderr


def test_workers_take_the_callers_environment_and_the_fork_servers_preload_starts_no_thread(monkeypatch):
    """Workers fork from a fork server started earlier, with the environment of then: each takes the caller's
    environment of now. Its preload (PyTorch, the parts, the compiled streams) leaves one thread, so forking is safe."""
    import multiprocessing.forkserver
    import os
    from concurrent.futures import ProcessPoolExecutor

    from fedshuffle.experiments import sweep

    context = sweep.worker_context()
    if context.get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()
    monkeypatch.setenv("FEDSHUFFLE_WORKER_PROBE", "set after the server started")
    with ProcessPoolExecutor(
        1, mp_context=context, initializer=sweep._start_worker, initargs=((), dict(os.environ))
    ) as pool:
        assert pool.submit(os.getenv, "FEDSHUFFLE_WORKER_PROBE").result(timeout=120) == "set after the server started"
    preload = subprocess.run(
        [sys.executable, "-c", f"import threading, {sweep.PRELOAD}; print(threading.active_count())"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert preload.returncode == 0 and preload.stdout.strip() == "1", preload.stderr[-2000:]


def test_an_override_of_what_the_variants_set_is_refused_and_a_variant_choosing_another_part_starts_from_its_defaults():
    from fedshuffle.experiments.schema import Experiment, load_experiment

    quickstart = load_experiment("quickstart")  # each variant names its own method
    with pytest.raises(ConfigError) as err:
        quickstart.runs({"method": {"name": "fedavg"}})
    assert err.value.field == "method.name" and "the variants set it themselves" in err.value.message
    assert [spec.local.lr for _, spec in quickstart.runs({"local": {"lr": 0.2}})] == [0.2] * len(
        quickstart.variants
    )  # what no variant sets applies to all
    exp = validate(
        Experiment,
        {
            "sampler": {"name": "uniform", "cohort": 2},
            "data": {"client_sizes": [1, 2, 3]},
            "local": {"lr": 0.1},
            "variants": [{"label": "all", "sampler": {"name": "full"}}, {"label": "two"}],
        },
    )
    (_, full), (_, two) = exp.runs()
    assert full.sampler.own_settings() == {} and two.sampler.own_settings() == {"cohort": 2}


def test_runs_that_are_the_same_have_one_config_hash_whether_defaults_are_written_or_not():
    """Defaults are known before building: a setting left out and the same setting written with its default
    give the same spec, so the same identity and hash (the results folder continues, never forks)."""
    from fedshuffle.experiments.folders import config_hash, identity

    plain = {
        "method": {"name": "fedcdr"},
        "sampler": {"name": "cyclic", "cohort": 2},
        "server": {},
        "local": {"lr": 0.1},
        "data": {"client_sizes": [1, 2, 3]},
    }
    spelled = {
        "method": {"name": "fedcdr", "alpha": 1.0, "prox_solver": "sgd"},
        "sampler": {"name": "cyclic", "cohort": 2, "order": "reshuffle"},
        "server": {"optimizer": "sgd", "lr": 1.0},
        "local": {"lr": 0.1},
        "data": {"client_sizes": [1, 2, 3], "partition": "sizes"},
    }
    a, b = (identity(validate(RunSpec, raw).model_dump()) for raw in (plain, spelled))
    assert a == b and config_hash(a) == config_hash(b)
    other = identity(validate(RunSpec, {**spelled, "server": {"optimizer": "sgd", "lr": 0.5}}).model_dump())
    assert config_hash(other) != config_hash(a)


def test_the_cli_refuses_an_override_of_what_variants_set_and_takes_it_for_one_variant(tmp_path):
    from typer.testing import CliRunner

    from fedshuffle.cli import app

    runner = CliRunner()
    refused = runner.invoke(
        app, ["run", "quickstart", "--set", "method.name=fedavg_rr", "--out", str(tmp_path / "all")]
    )
    assert (
        refused.exit_code == 2
        and "method.name: the variants set it themselves" in refused.output
        and "--variant" in refused.output
    )
    one = runner.invoke(
        app,
        [
            "run",
            "quickstart",
            "--variant",
            "FedAvg",
            "--set",
            "method.name=fedavg_rr",
            "--set",
            "run.rounds=4",
            "--out",
            str(tmp_path / "one"),
            "--quiet",
        ],
    )
    assert one.exit_code == 0, one.output
    configs = [json.loads(p.read_text())["spec"]["method"]["name"] for p in (tmp_path / "one").rglob("config.json")]
    assert configs and set(configs) == {"fedavg_rr"}
    unknown = runner.invoke(app, ["run", "quickstart", "--variant", "Nope", "--out", str(tmp_path / "x")])
    assert unknown.exit_code == 2 and "no variant 'Nope'" in unknown.output
