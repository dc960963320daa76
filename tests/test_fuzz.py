"""Property-based fuzzing: random malformed configs and data files end in a clear error or a correct run.

"Clear error" is a :class:`ConfigError` naming a field (or a data file and line); "correct run" is a
complete or diverged run whose files agree with each other. Anything else — another exception, a
hang (every case is a few rounds of a tiny problem) — fails the test.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import nested
from fedshuffle.methods import METHODS
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.experiments.build import build_problem_and_data
from fedshuffle.data.sources import read_svmlight
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.results import read_metrics
from fedshuffle.experiments.runner import run_single

CASES = {"configs": 0, "runs": 0, "files": 0, "datasets": 0}

numbers = st.one_of(
    st.integers(-3, 12),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0, 1e-3, 0.5, 1e6, -1.0]),
)
junk = st.one_of(numbers, st.text(max_size=6), st.booleans(), st.lists(st.integers(-2, 6), max_size=4))


@st.composite
def config_strategy(draw):
    """A config that would run, then up to three corruptions: a field replaced by junk, removed, or misspelled."""
    method = draw(st.sampled_from(sorted(METHODS)))
    quadratic = draw(st.booleans())
    if quadratic:
        problem = {"name": "quadratic"}
        data = {"client_sizes": draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))}
        n = len(data["client_sizes"])
    else:
        n = draw(st.integers(1, 4))
        problem = {
            "name": draw(st.sampled_from(["logistic", "softmax", "mlp"])),
            "l2": draw(st.sampled_from([0.0, 1e-2])),
            "hidden": [draw(st.integers(1, 3))],
        }
        classes = 2 if problem["name"] == "logistic" else draw(st.integers(2, 3))
        data = {
            "source": "synthetic",
            "samples": draw(st.integers(n, 24)),
            "features": draw(st.integers(1, 3)),
            "classes": classes,
            "clients": n,
            "partition": draw(st.sampled_from(["iid", "equal", "dirichlet"])),
            "alpha": 1.0,
        }
    algorithm = {
        "lr": draw(st.sampled_from([1e-3, 0.05, 0.5, 1e3])),
        "epochs": draw(st.integers(1, 2)),
        "batch_size": draw(st.integers(1, 3)),
    }
    if method in ("nastya", "rr_cli", "generalized_fedavg"):
        algorithm["server_lr"] = draw(st.sampled_from([0.1, 1.0]))
    algorithm.update(
        draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "clip_norm": st.sampled_from([0.1, 10.0]),
                    "local_momentum": st.sampled_from([0.0, 0.5]),
                    "weight_decay": st.sampled_from([0.0, 1e-2]),
                    "straggler_probability": st.sampled_from([0.0, 0.5]),
                    "schedule_name": st.sampled_from(["constant", "inverse_epochs"]),
                },
            )
        )
    )
    cohort = draw(st.integers(1, n))
    sampler = (
        {"name": "cyclic", "cohort": 1}
        if method == "rr_cli"
        else {"name": draw(st.sampled_from(["full", "uniform", "with_replacement", "importance"])), "cohort": cohort}
    )
    raw = {
        "problem": problem,
        "data": data,
        **nested(algorithm),
        "method": {"name": method},
        "sampler": sampler,
        "run": {
            "rounds": draw(st.integers(1, 4)),
            "eval_every": draw(st.integers(1, 3)),
            "dtype": draw(st.sampled_from(["float32", "float64"])),
        },
    }
    for _ in range(draw(st.integers(0, 3))):
        section = draw(st.sampled_from(sorted(raw)))
        keys = sorted(raw[section])
        action = draw(st.sampled_from(["junk", "remove", "misspell"]))
        if not keys:
            continue
        key = draw(st.sampled_from(keys))
        if action == "junk":
            raw[section][key] = draw(junk)
        elif action == "remove":
            del raw[section][key]
        else:
            raw[section][key + "x"] = raw[section].pop(key)
    return raw


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(raw=config_strategy())
def test_random_configs_end_in_a_clear_error_or_a_correct_run(raw, tmp_path):
    CASES["configs"] += 1
    try:
        spec = validate(RunSpec, raw)
        outcome = run_single(spec, tmp_path / f"case-{CASES['configs']}", seed=0)
    except ConfigError as exc:
        assert exc.field and exc.message and "Traceback" not in exc.message
        return
    assert outcome.status in ("complete", "diverged")
    CASES["runs"] += 1
    rows = read_metrics(outcome.run_dir / "metrics.csv")
    summary = json.loads((outcome.run_dir / "summary.json").read_text())
    assert summary["status"] == outcome.status and rows["round"][-1] == summary["final"]["round"]
    if outcome.status == "complete":
        assert rows["round"][-1] == spec.run.rounds and math.isfinite(summary["final"]["loss"])
    else:
        assert "diverged at round" in summary["message"]


def _npz_bytes(tmp_path, x, y):
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y)
    return path.read_bytes()


@st.composite
def npz_case(draw):
    """A valid (x, y) pair, then at most one fault: NaN features, strings, negative or fractional labels,
    mismatched lengths, no samples, labels out of range for the model, or a truncated file."""
    n, d, classes = draw(st.integers(6, 14)), draw(st.integers(1, 3)), draw(st.sampled_from([2, 2, 3]))
    rng = np.random.default_rng(n * 31 + d)
    x, y = rng.normal(size=(n, d)), rng.integers(0, classes, n)
    fault = draw(
        st.sampled_from(
            ["none", "none", "nan", "strings", "negative", "fractional", "mismatch", "empty", "truncate", "scalar"]
        )
    )
    if fault == "nan":
        x[draw(st.integers(0, n - 1)), 0] = np.nan
    elif fault == "strings":
        x = np.array([["a"] * d] * n)
    elif fault == "negative":
        y[0] = -1
    elif fault == "fractional":
        y = y + 0.5
    elif fault == "mismatch":
        y = y[:-1]
    elif fault == "empty":
        x, y = x[:0], y[:0]
    elif fault == "scalar":
        x = np.float64(3.0)
    cut = draw(st.integers(0, 300)) if fault == "truncate" else None
    return x, y, cut


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=npz_case(), clients=st.integers(1, 6), problem=st.sampled_from(["softmax", "logistic"]))
def test_random_and_broken_npz_files_end_in_a_clear_error_or_a_consistent_dataset(case, clients, problem, tmp_path):
    CASES["files"] += 1
    x, y, cut = case
    payload = _npz_bytes(tmp_path, x, y)
    path = tmp_path / "data.npz"
    path.write_bytes(payload if cut is None else payload[:cut])
    raw = {
        "problem": {"name": problem},
        "data": {"source": "npz", "path": str(path), "partition": "iid", "clients": clients},
    }
    try:
        _, data = build_problem_and_data(validate(RunSpec, raw))
    except ConfigError as exc:
        assert exc.field and exc.message
        return
    CASES["datasets"] += 1
    assert data.num_clients == clients and data.num_samples == len(y) and min(data.sizes) >= 1
    assert np.isfinite(data.features.numpy()).all()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="+-0123456789.:# \nnaex", max_size=80))
def test_random_svmlight_text_is_read_or_rejected_with_its_line(text, tmp_path):
    CASES["files"] += 1
    path = tmp_path / "f.svm"
    path.write_text(text)
    try:
        features, y = read_svmlight(path, 9)
    except ConfigError as exc:
        assert str(path) in exc.field
        return
    assert features.shape == (len(y), 9) and set(np.unique(y)) == {0, 1} and np.isfinite(features).all()


@pytest.fixture(scope="module", autouse=True)
def report_cases():
    yield
    print(
        f"\nfuzz cases: {CASES['configs']} configs ({CASES['runs']} ran), {CASES['files']} data files "
        f"({CASES['datasets']} loaded)"
    )


# --- the fuzz cases of tests/fuzzing.py (scripts/fuzz.py runs thousands of them) ----------------------------

import fuzzing

OUTCOMES: dict[str, dict[str, int]] = {kind: {} for kind in fuzzing.KINDS}


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    """The fuzzing environment (memory cap, private cache, no downloads) and a finished results folder."""
    root = tmp_path_factory.mktemp("fuzz")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in fuzzing.environment(root).items():
            mp.setenv(key, value)
        yield root, fuzzing.make_template(root / "template")
    print("\nfuzz outcomes: " + "; ".join(f"{k}: {v}" for k, v in OUTCOMES.items() if v))


def check_case(kind, seed, env):
    root, template = env
    work = root / f"{kind}-{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    result = fuzzing.run_case(kind, seed, work, template)
    OUTCOMES[kind][result.outcome] = OUTCOMES[kind].get(result.outcome, 0) + 1
    shutil.rmtree(work, ignore_errors=True)
    assert result.outcome not in fuzzing.BAD, (
        f"{result.outcome}: {result.detail} [{result.case}] — replay: python scripts/fuzz.py --replay {kind}:{seed}"
    )


FUZZ = settings(
    deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@settings(FUZZ, max_examples=40)
@given(seed=st.integers(0, 2**31 - 1))
def test_fuzzed_data_files_load_or_are_refused_naming_the_file(seed, fuzz_env):
    """svmlight, LEAF JSON, .npz and .npy files with one fault each: refused with a ConfigError, never
    accepted when the fault is nonsense (fractional or negative labels, duplicate users, ...)."""
    check_case("data", seed, fuzz_env)


@settings(FUZZ, max_examples=12)
@given(seed=st.integers(0, 2**31 - 1))
def test_fuzzed_config_files_run_or_fail_cleanly(seed, fuzz_env):
    check_case("configs", seed, fuzz_env)


@settings(FUZZ, max_examples=10)
@given(seed=st.integers(0, 2**31 - 1))
def test_fuzzed_command_lines_run_or_fail_cleanly(seed, fuzz_env):
    check_case("cli", seed, fuzz_env)


@settings(FUZZ, max_examples=6)
@given(seed=st.integers(0, 2**31 - 1))
def test_fuzzed_corrupt_results_folders_fail_cleanly(seed, fuzz_env):
    """A finished results folder with truncated or corrupt checkpoint, metrics, summary or config files:
    --resume, plot and table end in a clean error or a correct result."""
    check_case("results", seed, fuzz_env)


@settings(FUZZ, max_examples=4)
@given(seed=st.integers(0, 2**31 - 1))
@pytest.mark.parametrize("kind", ["plugins", "nodedata", "checkpoints", "privacy"])
def test_fuzzed_plugins_node_files_checkpoints_and_privacy_end_cleanly(kind, seed, fuzz_env):
    """A plugin never imported without consent; a node's bad client file refused naming it; a checkpoint that
    decodes but is not the run's state refused, never resumed to other numbers; privacy at the accountant's
    edges refused or reported with an ε ≥ 0 (tests/fuzzing_trust.py; signals and TMPDIR: scripts/fuzz.py)."""
    check_case(kind, seed, fuzz_env)


def test_the_signal_cases_excuse_only_pythons_own_start(tmp_path):
    """Ctrl-C before the interpreter runs any of the package's code ends with Python's own message (a real one:
    ``site`` interrupted through a ``sitecustomize`` that sends it); one landing in the package's code is still
    a traceback of the command's."""
    from fuzzing_trust import _interpreter_start

    (tmp_path / "sitecustomize.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n")
    started = subprocess.run(
        [sys.executable, "-c", "pass"], env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert _interpreter_start(started.returncode, started.stdout + started.stderr), started
    ours = "Traceback (most recent call last):\n" + started.stderr.split("Traceback (most recent call last):\n")[1]
    in_package = ours.replace('File "<frozen site>"', 'File "/site-packages/fedshuffle/__main__.py"')
    assert not _interpreter_start(-2, in_package), in_package
    assert not _interpreter_start(130, started.stderr), "the command's own status is not Python's"
