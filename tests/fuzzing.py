"""Fuzz cases over configs, CLI options, data files and results folders, and how each one ended.

Every case is drawn from ``random.Random(f"{kind}:{seed}")``, so ``(kind, seed)`` replays it exactly
(``python scripts/fuzz.py --replay data:123``). A case ends as

* ``ran`` — the command or loader finished, and what it produced passed the case's checks;
* ``clean_error`` — a :class:`ConfigError` (loaders), or the CLI's error with exit status 2, 3 or 4
  (no Python traceback in its output);
* ``traceback`` — any other exception, or another exit status;
* ``hang`` — longer than the case's time limit (every case is a few rounds of a tiny problem);
* ``nonsense`` — finished, but the input was nonsense that must be refused (e.g. an all-zero
  aggregation weighting, a fractional label), or its results contradict themselves.

Used by ``tests/test_fuzz.py`` (hypothesis draws the seeds, few examples) and ``scripts/fuzz.py``
(thousands of cases in supervised worker processes, counts as JSON).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import math
import os
import random
import shutil
import signal
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("configs", "cli", "data", "results", "hostile")
OUTCOMES = ("ran", "clean_error", "traceback", "hang", "nonsense")
BAD = ("traceback", "hang", "nonsense")
#: CPU seconds one case may take in process before it counts as a hang (CPU, not wall-clock time, so
#: that a loaded machine does not turn slow cases into hangs; a case blocked without using the CPU is
#: caught by the supervisor of scripts/fuzz.py, which counts wall-clock time)
CASE_SECONDS = 60.0


@dataclass
class Result:
    outcome: str
    detail: str = ""
    case: str = ""
    output: str = ""  # a bad case's command output (its end), where one line of detail cannot say what happened


class Hang(BaseException):
    """Raised by the alarm; a BaseException so that ``except Exception`` in the code under test lets it through."""


@contextlib.contextmanager
def _limit(seconds: float, timer: int, signum: int, message: str) -> Iterator[None]:
    """Raise :class:`Hang` with ``message`` in this (main) thread when the interval ``timer`` of ``seconds`` expires."""

    def alarm(signum, frame):
        raise Hang(message)

    previous = signal.signal(signum, alarm)
    signal.setitimer(timer, seconds)
    try:
        yield
    finally:
        signal.setitimer(timer, 0)
        signal.signal(signum, previous)


def time_limit(seconds: float) -> contextlib.AbstractContextManager[None]:
    """Raise :class:`Hang` once the process has used ``seconds`` of CPU time."""
    return _limit(seconds, signal.ITIMER_PROF, signal.SIGPROF, f"still running after {seconds:.0f} CPU seconds")


def environment(root: Path) -> dict[str, str]:
    """Environment of a fuzzing process: small memory cap, private cache, no downloads, no GUI."""
    return {
        "FEDSHUFFLE_MAX_MEMORY": "1G",
        "FEDSHUFFLE_CACHE": str(root / f"cache-{os.getpid()}"),  # one per process: a download case checks its own
        "FEDSHUFFLE_LIBSVM_URL": "http://127.0.0.1:1/",
        "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }


def _tail(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next(
        (f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames) if "fedshuffle" in f.filename),
        frames[-1].filename if frames else "?",
    )
    return f"{type(exc).__name__}: {str(exc)[:200]} [{where}]"


# -- TOML writing (the standard library only reads TOML) ------------------------------------------------------


def _key(k: str) -> str:
    return k if k and all(c.isalnum() and c.isascii() or c in "-_" for c in k) else json.dumps(k)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


def toml_text(doc: dict[str, Any]) -> str:
    """A TOML document: scalar keys first, then one table per dict, then arrays of tables for lists of dicts."""
    lines = [
        f"{_key(k)} = {toml_value(v)}"
        for k, v in doc.items()
        if not isinstance(v, dict) and not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))
    ]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f"[{_key(k)}]")
            lines.extend(f"{_key(kk)} = {toml_value(vv)}" for kk, vv in v.items())
    for k, v in doc.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                lines.append(f"[[{_key(k)}]]")
                lines.extend(f"{_key(kk)} = {toml_value(vv)}" for kk, vv in item.items())
    return "\n".join(lines) + "\n"


# -- value pools: valid, boundary and nonsense values of every setting -------------------------------------

NUMBERS = [
    0,
    -1,
    1,
    0.5,
    -0.0,
    1e-300,
    1e300,
    float("nan"),
    float("inf"),
    -float("inf"),
    10**12,
    2**70,
    "1",
    "",
    True,
    [],
    {},
]
POOLS: dict[str, dict[str, list[Any]]] = {
    "method": {
        "name": [
            "fedavg",
            "fedavg_rr",
            "fedavg_min",
            "fedavg_mean",
            "fednova",
            "fednova_rr",
            "fedshuffle",
            "fedshuffle_gen",
            "fedshuffle_mvr",
            "nastya",
            "rr_cli",
            "fedprox",
            "generalized_fedavg",
            "scaffold",
            "fedcdr",
            "feddyn",
            "FedAvg",
            "bogus",
            "",
            3,
        ],
        "option": ["I", "II", "III", 1],
        "alpha": [1.0, 0.01, 0.0, 2.0, -1.0, float("nan"), float("inf")],
        "eta": [1.0, 0.0, -1.0],
        "form": ["y", "x", "z"],
        "exact_prox": [True, False, "yes"],
        "warm_start": [True, False],
    },
    "local": {
        "lr": [0.01, 0.1, 0.5, 1e3, "theory", 0, -0.1, float("nan"), float("inf"), "x", [0.1], True, 1e-300],
        "lr_multiplier": [1.0, 2.0, 0.0, -1.0, float("inf")],
        "epochs": [1, 2, [1, 2], [2, 1], [1], 0, -1, 10**10, 1.5, "a", [0, 1]],
        "steps": [1, 3, "min", "mean", 0, -2, "x", 10**10],
        "order": ["reshuffle", "shuffle_once", "with_replacement", "random", 1],
        "batch_size": [1, 2, 3, 10**9, 0, -3, 1.5, 2**70],
        "step_normalization": [
            "none",
            "local_work",
            "max_local_work",
            [1.0],
            [1.0, 2.0],
            [0.0],
            [],
            [-1.0],
            [float("nan")],
            "x",
        ],
        "weight_decay": [0.0, 0.01, -1.0, float("inf")],
        "clip_norm": [0.1, 10.0, 0.0, -1.0, float("nan")],
        "momentum": [0.0, 0.5, 1.0, -0.5],
        "prox_mu": [0.0, 0.1, -1.0],
        "drop_last_steps": [0, 1, 5, -1],
        "straggler_probability": [0.0, 0.5, 1.0, 1.5, -0.1],
    },
    "aggregation": {
        "weighting": [
            "data",
            "normalized",
            "x",
            [1.0],
            [1.0, 1.0],
            [0.0, 0.0],
            [0.0],
            [0.0, 0.0, 0.0, 0.0],
            [1.0, -1.0],
            [float("nan")],
            [],
            [1, 2, 3, 4],
        ],
        "normalization": ["unbiased", "sum_one", "x"],
        "tau_eff": ["planned", "cohort", "x"],
        "direction": ["model_delta", "mean_gradient", "x"],
    },
    "server": {
        "optimizer": ["sgd", "heavy_ball", "adam", "adagrad", "yogi", "adgd", "x", None],
        "lr": [1.0, 0.5, 0.01, 1e-6, "theory", 0, -1.0, float("inf")],
        "momentum": [0.0, 0.9, 1.0, -0.1],
        "beta1": [0.9, 1.0, -0.1],
        "beta2": [0.99, 1.0],
        "eps": [1e-3, 0.0, -1.0, float("nan")],
        "meta_epoch_step": [True, False, "x"],
        "global_lr": [1.0, "theory", 0.0, -1.0],
        "global_momentum": [0.0, 0.9, 1.0, -0.1],
        "momentum_estimator": ["exact", "x"],
    },
    "schedule": {
        "name": ["constant", "inverse_epochs", "step", "x"],
        "decay_at": [[0.5], [0.8, 0.5], [], [1.5], [-0.1], ["a"]],
        "decay_factor": [0.1, 1.0, 0.0, 2.0],
    },
    "sampler": {
        "name": ["full", "uniform", "with_replacement", "importance", "independent", "cyclic", "x"],
        "cohort": [1, 2, 0.5, 3.5, 10**12, 0, -1, float("nan"), "x"],
        "order": ["reshuffle", "shuffle_once", "fixed", "x"],
        "probabilities": ["uniform", "weights", [1.0], [0.5, 0.5], [0.0, 0.0], [-1.0, 2.0], [1.0, 1.0, 1.0, 1.0], "x"],
    },
    "problem": {
        "name": ["quadratic", "logistic", "softmax", "mlp", "x"],
        "l2": [0.0, 0.01, -1.0, float("nan"), float("inf")],
        "hidden": [[2], [3, 2], [], [0], [-1], [10**6, 10**6], [10**12], [1.5], "x"],
    },
    "data": {
        "source": ["targets", "synthetic", "npz", "libsvm", "fedprox_synthetic", "leaf", "x"],
        "samples": [1, 5, 20, 0, -1, 10**12, 1.5, 2**70],
        "features": [1, 3, 0, 10**11, -1],
        "classes": [2, 3, 1, 10**9],
        "clients": [1, 2, 4, 0, -1, 10**9, 10**18],
        "partition": ["sizes", "iid", "equal", "dirichlet", "x"],
        "alpha": [0.5, 0.0, -1.0, 1e-300, float("inf")],
        "client_sizes": [[1, 2, 3], [2], [], [0], [-1], [10**9], [10**7], [1.5], "x"],
        "separation": [1.0, 0.0, -0.0, -1.0, float("nan"), float("inf"), 1e300],
        "test_fraction": [0.0, 0.3, 0.99, 1.0, -0.1],
        "weights": [
            "size",
            "uniform",
            [1.0, 1.0],
            [0.0, 0.0],
            [1.0],
            [float("nan"), 1.0],
            [-1.0, 2.0],
            [1e308, 1e308],
            "x",
        ],
        "seed": [0, 1, -1, 2**70, None],
        "synthetic_alpha": [0.0, 1.0, -1.0],
        "synthetic_beta": [0.0, 1.0, float("nan")],
        "iid": [True, False],
        "path": ["missing.npz", "d.npz", "", "/", ".", "targets.npy", "missing.npy"],
        "libsvm_test": [True, False],
        "download": [False],
        "verify": [True, False],
    },
    "run": {
        "rounds": [1, 2, 3, 0, -1, 1.5, "x", 2**70],
        "seed": [0, 5, -1, 2**70, 1.5],
        "dtype": ["float64", "float32", "float16", "x"],
        "eval_every": [1, 2, 0, -1, 10**12],
        "executor": ["sequential", "vectorized", "x"],
        "device": ["cpu", "cuda", "tpu"],
        "chunk_size": [1, 2, 0, -1, 10**12, None],
        "memory_budget_mb": [1, 1024, 0, 10**12],
        "ray_workers": [1, 0],
        "state_memory_mb": [1, 0, 10**12],
        "checkpoint_every": [0, 1, -1, 10**12],
        "sinks": [[], ["x"]],
    },
    "plot": {
        "metric": ["loss", "f_gap", [], ["loss", "f_gap"], "bogus", ["bogus"]],
        "x": ["round", "epochs", "sample_gradients", "bytes", "x"],
        "log_y": [True, False, "x"],
        "band": ["std", "minmax", "x"],
    },
    "experiment": {
        "name": ["exp", "", "..", "a/b", "ü", "x" * 300],
        "seeds": [[0], [0, 1], [0, 0, 0], [-1], [], [2**70], [1.5], "x"],
        "title": ["t", "ü" * 10, 3],
    },
}


def _declared_values() -> None:
    """Every registered part's settings join the pools: its default and the bad values generated from its
    declared constraints (fedshuffle.testing.bad_values), beside the hand-picked extremes above; every
    registered name joins its chooser's pool. A part added to a registry is fuzzed without editing this file."""
    from fedshuffle.data.catalog import PARTITIONS, SOURCES
    from fedshuffle.methods import METHODS
    from fedshuffle.problems import PROBLEMS
    from fedshuffle.samplers import SAMPLERS
    from fedshuffle.server import SERVER_OPTIMIZERS
    from fedshuffle.testing import bad_values

    choosers = {
        ("method", "name"): METHODS,
        ("problem", "name"): PROBLEMS,
        ("data", "source"): SOURCES,
        ("data", "partition"): PARTITIONS,
        ("sampler", "name"): SAMPLERS,
        ("server", "optimizer"): SERVER_OPTIMIZERS,
    }
    for (section, chooser), registry in choosers.items():
        pool = POOLS[section]
        pool[chooser] = [*pool.get(chooser, []), *(n for n in registry.names() if n not in pool.get(chooser, []))]
        for entry in registry.entries():
            for setting, bad in bad_values(entry).items():
                default = entry.settings.model_fields[setting].default
                known = pool.setdefault(setting, [])
                known.extend(
                    v for v in [default, *bad] if not any(v is k or (type(v) is type(k) and v == k) for k in known)
                )


_declared_values()
LABELS = ["A", "B", "Fed Avg", "fed-avg", "..", ".", "", "/", "a/b", "ü", "ö", "x" * 300, "A", "con", "-", "seed-0"]
METHODS_OK = [m for m in POOLS["method"]["name"] if isinstance(m, str) and m.islower() and m not in ("bogus", "")]

#: inputs that must be refused, whatever else the config says: (name, predicate on the raw config)
MUST_REFUSE: list[tuple[str, Callable[[dict], bool]]] = [
    (
        "all-zero or negative aggregation weighting",
        lambda raw: (
            _is_list(raw.get("aggregation", {}).get("weighting"))
            and (
                not any(_num(w) > 0 for w in raw["aggregation"]["weighting"])
                or any(_num(w) < 0 for w in raw["aggregation"]["weighting"])
            )
        ),
    ),
    (
        "duplicate seeds",
        lambda raw: (
            _is_list(raw.get("experiment", {}).get("seeds"))
            and len(set(map(repr, raw["experiment"]["seeds"]))) < len(raw["experiment"]["seeds"])
        ),
    ),
    (
        "duplicate variant labels",
        lambda raw: (
            isinstance(raw.get("variants"), list)
            and len({str(v.get("label")).strip().lower() for v in raw["variants"] if isinstance(v, dict)})
            < len(raw["variants"])
        ),
    ),
]


def _is_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


# -- running a CLI command in process -------------------------------------------------------------------------


def invoke(argv: list[str], cwd: Path, seconds: float = CASE_SECONDS) -> tuple[Result, str]:
    """Run ``fedshuffle ARGV`` in this process (typer's CliRunner) in ``cwd``; the result and the output."""
    from typer.testing import CliRunner

    from fedshuffle.cli import app

    runner = CliRunner()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with time_limit(seconds):
            result = runner.invoke(app, argv, catch_exceptions=True)
    except Hang as exc:
        return Result("hang", str(exc)), ""
    finally:
        os.chdir(previous)
    output = result.output or ""
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        return Result("traceback", _tail(exc)), output
    if "Traceback (most recent call last)" in output:
        return Result("traceback", output.strip().splitlines()[-1][:200]), output
    code = result.exit_code
    if code == 0:
        return Result("ran"), output
    if code in (2, 3, 4, 130):
        last = next((line for line in output.strip().splitlines()[::-1] if line.strip()), "")
        return Result("clean_error", f"exit {code}: {last[:200]}"), output
    return Result("traceback", f"exit status {code}: {output.strip()[-200:]}"), output


# -- configs ------------------------------------------------------------------------------------------------


def base_config(rng: random.Random) -> dict[str, Any]:
    """A small config that would run (a few rounds of a tiny problem)."""
    method = rng.choice(METHODS_OK)
    problem = rng.choice(["quadratic", "logistic", "softmax", "mlp"])
    if problem == "quadratic":
        data: dict[str, Any] = {
            "source": "targets",
            "client_sizes": [rng.randint(1, 3) for _ in range(rng.randint(1, 4))],
        }
        clients = len(data["client_sizes"])
    else:
        clients = rng.randint(1, 4)
        data = {
            "source": "synthetic",
            "samples": rng.randint(2 * clients, 24),
            "features": rng.randint(1, 3),
            "classes": 2 if problem == "logistic" else rng.randint(2, 3),
            "clients": clients,
            "partition": rng.choice(["iid", "equal", "dirichlet"]),
        }
    raw: dict[str, Any] = {
        "method": {"name": method},
        "local": {"lr": rng.choice([0.01, 0.1, 0.5]), "epochs": rng.randint(1, 2), "batch_size": rng.randint(1, 3)},
        "problem": {"name": problem, **({"hidden": [rng.randint(1, 3)]} if problem == "mlp" else {})},
        "data": data,
        "sampler": {"name": "cyclic", "cohort": 1}
        if method == "rr_cli"
        else {"name": rng.choice(["full", "uniform", "with_replacement"]), "cohort": rng.randint(1, clients)},
        "run": {
            "rounds": rng.randint(1, 3),
            "eval_every": rng.randint(1, 2),
            "dtype": rng.choice(["float32", "float64"]),
            "executor": rng.choice(["sequential", "vectorized"]),
        },
    }
    if method == "fedcdr":
        raw["local"].update(epochs=1, batch_size=2)
    return raw


def mutate(raw: dict[str, Any], rng: random.Random) -> None:
    """One random change: a setting from its pool or junk, a removed or misspelled setting, a section of the wrong
    type, an unknown section."""
    action = rng.choices(
        ["pool", "junk", "remove", "misspell", "section_type", "unknown_section", "nested"], [10, 3, 2, 1, 1, 1, 1]
    )[0]
    if action in ("pool", "junk"):
        section = rng.choice(sorted(POOLS))
        key = rng.choice(sorted(POOLS[section]))
        target = raw.setdefault(section, {}) if isinstance(raw.get(section, {}), dict) else {}
        target[key] = rng.choice(POOLS[section][key]) if action == "pool" else rng.choice(NUMBERS)
    elif action == "remove" and raw:
        section = rng.choice(sorted(raw))
        if isinstance(raw[section], dict) and raw[section]:
            del raw[section][rng.choice(sorted(raw[section]))]
    elif action == "misspell" and raw:
        section = rng.choice(sorted(raw))
        if isinstance(raw[section], dict) and raw[section]:
            key = rng.choice(sorted(raw[section]))
            raw[section][key[:-1] + "_x"] = raw[section].pop(key)
    elif action == "section_type":
        raw[rng.choice(sorted(POOLS))] = rng.choice(NUMBERS[:8] + ["x", [1, 2]])
    elif action == "unknown_section":
        raw[rng.choice(["algorithm", "Local", "extra", "ü"])] = {"lr": 0.1}
    else:
        value: Any = 1
        for _ in range(rng.choice([2, 10, 60])):
            value = {"a": value}
        raw.setdefault("run", {})["rounds"] = value


def config_document(rng: random.Random) -> tuple[str, dict[str, Any] | None]:
    """TOML text of a random config, and the document it encodes (``None`` for text that is not a document)."""
    mode = rng.choices(["mutated", "variants", "garbage", "deep"], [14, 3, 2, 1])[0]
    if mode == "garbage":
        text = toml_text(base_config(rng))
        cut = rng.randint(0, len(text))
        choice = rng.choice(["truncate", "bytes", "duplicate", "splice"])
        if choice == "truncate":
            return text[:cut], None
        if choice == "bytes":
            return "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(1, 200))), None
        if choice == "duplicate":
            return text + text, None
        return text[:cut] + rng.choice(["[", "]", "=", '"', "\n[local]\n", "\x00", "\ud800", "key = \n"]) + text[
            cut:
        ], None
    if mode == "deep":
        depth = rng.choice([100, 1000, 5000])
        return rng.choice(
            [
                f"x = {'[' * depth}{']' * depth}\n",
                f"x = {'{a=' * depth}1{'}' * depth}\n",
                "".join(f"[{'a.' * k}a]\n" for k in range(1, min(depth, 300))),
            ]
        ), None
    raw = base_config(rng)
    for _ in range(rng.choices([0, 1, 2, 3, 4], [2, 5, 4, 2, 1])[0]):
        mutate(raw, rng)
    if isinstance(raw.get("run"), dict):
        raw["run"].setdefault("rounds", 2)  # the default 1000 rounds are legitimately slow, not a hang
    if mode == "variants":
        raw["variants"] = [
            {
                "label": rng.choice(LABELS),
                **({"method": {"name": rng.choice(METHODS_OK)}} if rng.random() < 0.7 else {}),
                **({"local": {"lr": rng.choice([0.05, 0.2])}} if rng.random() < 0.3 else {}),
            }
            for _ in range(rng.randint(1, 3))
        ]
        if rng.random() < 0.05:
            raw["variants"].append({"lr": 0.1})
    if rng.random() < 0.2 and isinstance(raw.setdefault("experiment", {}), dict):
        raw["experiment"]["seeds"] = rng.choice(POOLS["experiment"]["seeds"])
    return toml_text(raw), raw


def run_config_case(seed: int, work: Path) -> Result:
    rng = random.Random(f"configs:{seed}")
    text, raw = config_document(rng)
    if raw is not None and rng.random() < 0.15 and isinstance(raw.get("problem"), dict):
        np.save(
            work / "targets.npy",
            np.eye(
                sum(raw["data"].get("client_sizes", [1, 2, 3]))
                if isinstance(raw.get("data"), dict) and _sizes_ok(raw["data"].get("client_sizes"))
                else 3
            ),
        )
    config = work / "c.toml"
    config.write_text(text, errors="surrogatepass")
    result, _ = invoke(["run", str(config), "--out", str(work / "out"), "--quiet"], work)
    if result.outcome == "ran" and raw is not None:
        for name, rule in MUST_REFUSE:
            if rule(raw):
                return Result("nonsense", f"accepted: {name}")
        problem = _results_problem(work / "out")
        if problem:
            return Result("nonsense", problem)
    return result


def _sizes_ok(sizes: Any) -> bool:
    return isinstance(sizes, list) and 0 < len(sizes) < 10 and all(isinstance(s, int) and 0 < s < 10 for s in sizes)


def _results_problem(out: Path) -> str:
    """What contradicts itself in a finished results folder ('' when nothing)."""
    from fedshuffle.experiments.results import read_metrics

    summaries = [p for p in out.rglob("summary.json") if (p.parent / "metrics.csv").exists()]
    if not summaries:
        return "exit 0 but no run folder was written"
    for path in summaries:
        try:
            summary = json.loads(path.read_text())
            rows = read_metrics(path.parent / "metrics.csv")
        except (OSError, ValueError) as exc:
            return f"{path.parent.name}: unreadable after exit 0 ({type(exc).__name__})"
        if not isinstance(summary, dict) or len(rows.get("round", ())) == 0:
            return f"{path.parent.name}: summary or metrics empty after exit 0"
        if summary.get("status") == "complete":
            if rows["round"][-1] != summary.get("rounds"):
                return (
                    f"{path.parent.name}: metrics end at round {rows['round'][-1]} but the summary says "
                    f"{summary.get('rounds')}"
                )
            if not math.isfinite(summary["final"].get("loss", math.nan)):
                return f"{path.parent.name}: complete with a non-finite loss"
    if not (out / "summary.json").exists():
        return "exit 0 but the experiment's summary.json is missing"
    return ""


# -- CLI options --------------------------------------------------------------------------------------------

SMALL_CONFIG = """[local]
lr = 0.1
[problem]
name = "logistic"
[data]
source = "synthetic"
samples = 12
features = 2
clients = 2
partition = "iid"
[run]
rounds = 2
eval_every = 1
[[variants]]
label = "A"
method = { name = "fedavg" }
[[variants]]
label = "B"
method = { name = "fedshuffle" }
"""

SET_VALUES = [
    "local.lr=0.1",
    "run.rounds=2",
    "run.seed=5",
    "local.lr=x",
    "x",
    "=",
    "a.b.c=1",
    "local.lr=[",
    "local.=1",
    ".lr=1",
    "local.lr=",
    "data.samples=1e12",
    "problem.hidden=[1000000, 1000000]",
    "local.batch_size=1e9",
    "run.rounds=-1",
    "aggregation.weighting=[0.0, 0.0]",
    "local.lr=nan",
    "plot.metric=[]",
    "data.separation=-0.0",
    "experiment.seeds=[0]",
    'run.executor="vectorized"',
    "local.epochs=[2, 1]",
    "sampler.cohort=1e12",
    "ü.x=1",
    "local.lr=1e400",
]
SEEDS = ["0", "0..2", "0,1", "2..0", "-1", "a", "", "0..99999999999", "1,1", "0..1e3", "9" * 30, "0..", ",,"]
GRIDS = [
    "local.lr=0.1,0.2",
    "local.lr=",
    "bad",
    "local.lr=0.1",
    "x.y=1,2",
    "local.epochs=[1,2],[2,3]",
    "local.lr=0.1,0.1",
    "=1",
    'local.lr="a,b"',
]
METRIC_NAMES = ["loss", "f_gap", "bogus", "", "round", "train_accuracy"]


def _path_value(rng: random.Random, work: Path) -> str:
    return rng.choice(
        [
            str(work / "c.toml"),
            str(work / "results"),
            str(work / "missing"),
            "",
            ".",
            str(work / "file.txt"),
            str(work / "emptydir"),
            str(work / "bad.toml"),
            "quickstart",
            "nonexistent-preset",
            str(work / "results" / "A"),
            str(work / "c.toml") + "/x",
        ]
    )


def cli_argv(rng: random.Random, work: Path) -> list[str]:
    command = rng.choices(
        ["run", "sweep", "plot", "table", "show", "inspect", "presets", "bogus", "--help", ""],
        [6, 4, 4, 4, 2, 4, 1, 1, 1, 1],
    )[0]
    argv = [command] if command else []
    p = lambda: _path_value(rng, work)  # noqa: E731
    if command in ("run", "sweep", "show"):
        argv.append(rng.choice([str(work / "c.toml")] * 4 + [p()]))
    if command in ("plot", "table"):
        argv += [rng.choice([str(work / "results")] * 3 + [p()]) for _ in range(rng.choice([1, 1, 2]))]
    options: dict[str, list[Callable[[], list[str]]]] = {
        "run": [
            lambda: ["--set", rng.choice(SET_VALUES)],
            lambda: ["--out", rng.choice([str(work / "out"), p()])],
            lambda: ["--resume", rng.choice([str(work / "results"), p()])],
            lambda: ["--workers", rng.choice(["1", "0", "-1", "x", "2"])],
            lambda: ["--quiet"],
            lambda: ["--bogus"],
        ],
        "sweep": [
            lambda: ["--grid", rng.choice(GRIDS)],
            lambda: ["--seeds", rng.choice(SEEDS)],
            lambda: ["--set", rng.choice(SET_VALUES)],
            lambda: ["--out", rng.choice([str(work / "out"), p()])],
            lambda: ["--workers", rng.choice(["1", "1", "0", "x"])],
            lambda: ["--pick", rng.choice(METRIC_NAMES)],
            lambda: ["--variant", rng.choice(["A", "B", "C", ""])],
            lambda: ["--quiet"],
        ],
        "plot": [
            lambda: ["--metric", rng.choice(METRIC_NAMES)],
            lambda: ["--x", rng.choice(["round", "epochs", "bytes", "bogus", ""])],
            lambda: ["--band", rng.choice(["std", "minmax", "x"])],
            lambda: ["--linear"],
            lambda: ["--out", rng.choice([str(work / "plotout"), p(), str(work / "newdir" / "p")])],
            lambda: ["--title", rng.choice(["t", "ü" * 50, "$\\frac{$"])],
        ],
        "table": [
            lambda: ["--metric", rng.choice(METRIC_NAMES)],
            lambda: ["--stat", rng.choice(["final", "best", "x", ""])],
        ],
        "inspect": [
            lambda: ["--method", rng.choice(METHODS_OK + ["x"])],
            lambda: ["--sizes", rng.choice(["1,2,3", "0", "", "1,a", "99999999999", "1,-2", "5", "1,1,1,1,1,1,1,1"])],
            lambda: [
                "--sampler",
                rng.choice(["full", "uniform", "with_replacement", "importance", "independent", "cyclic", "x"]),
            ],
            lambda: ["--cohort", rng.choice(["1", "0", "-1", "1e9", "nan", "2.5"])],
            lambda: ["--epochs", rng.choice(["1", "2-5", "5-2", "a", "-1", "0", "1-"])],
            lambda: ["--lr", rng.choice(["0.01", "-1", "nan", "inf", "0"])],
            lambda: ["--weights", rng.choice(["size", "uniform", "1,2,3", "a", "0,0,0", "1", "-1,1,1", "nan,1,1"])],
            lambda: ["--set", rng.choice(SET_VALUES)],
            lambda: ["--monte-carlo"],
            lambda: ["--samples", rng.choice(["10", "0", "-5", "100"])],
            lambda: ["--json"],
            lambda: ["--config", rng.choice([str(work / "c.toml"), p()])],
        ],
    }
    for _ in range(rng.randint(0, 4)):
        if command in options:
            argv += rng.choice(options[command])()
    return argv


def prepare_cli_folder(work: Path, template: Path | None) -> None:
    (work / "c.toml").write_text(SMALL_CONFIG)
    (work / "bad.toml").write_text("[local\nlr = ")
    (work / "file.txt").write_text("not a folder")
    (work / "emptydir").mkdir(exist_ok=True)
    if template is not None:
        shutil.copytree(template, work / "results")


def run_cli_case(seed: int, work: Path, template: Path | None = None) -> Result:
    rng = random.Random(f"cli:{seed}")
    prepare_cli_folder(work, template)
    argv = cli_argv(rng, work)
    if argv[:1] in (["run"], ["sweep"]) and "--workers" not in argv:
        argv += ["--workers", "1"]
    if argv[:2] in (["run", "quickstart"], ["sweep", "quickstart"]):
        argv += ["--set", "run.rounds=2"]  # the preset's 1000 rounds × 12 runs are legitimately slow
    if "--monte-carlo" in argv and "--samples" not in argv:
        argv += ["--samples", "200"]  # the default 20,000 Monte Carlo rounds are legitimately slow
    result, _ = invoke(argv, work)
    result.case = " ".join(a.replace(str(work), "W") for a in argv)
    return result


# -- data files ---------------------------------------------------------------------------------------------


@dataclass
class DataCase:
    raw: dict[str, Any]
    refuse: str  # why it must be refused, '' when it may load
    samples: int | None = None  # the training samples a load must have (None: not checked)


def _svmlight_case(rng: random.Random, work: Path) -> DataCase:
    n, d = rng.randint(2, 8), rng.randint(1, 5)
    values = [rng.choice(["-1", "+1"]) for _ in range(n)]
    values[0], values[1] = "-1", "+1"
    lines = [
        f"{values[i]} "
        + " ".join(f"{j}:{rng.uniform(-2, 2):.3g}" for j in sorted(rng.sample(range(1, d + 1), rng.randint(1, d))))
        for i in range(n)
    ]
    fault = rng.choice(
        [
            "none",
            "none",
            "float_label",
            "third_label",
            "nan",
            "inf",
            "huge_index",
            "decreasing",
            "duplicate_index",
            "junk_token",
            "empty",
            "binary",
            "crlf",
            "comments_only",
            "qid",
            "long_line",
            "negative_index",
            "zero_index",
            "truncate",
            "label_only",
            "one_class",
            "nan_label",
        ]
    )
    refuse = ""
    k = rng.randrange(n)
    if fault == "float_label":
        lines[k] = "0.5" + lines[k][lines[k].index(" ") :]
        refuse = "a fractional label"
    elif fault == "nan_label":
        lines[k] = "nan" + lines[k][lines[k].index(" ") :]
        refuse = "a NaN label"
    elif fault == "third_label":  # both −1 and +1 stay (rows 0 and 1): three values
        k = rng.randrange(2, n) if n > 2 else None
        if k is not None:
            lines[k] = "7" + lines[k][lines[k].index(" ") :]
            refuse = "a third label value"
    elif fault in ("nan", "inf"):
        lines[k] += f" {d + 1}:{fault}"
        refuse = "a non-finite feature"
    elif fault == "huge_index":
        lines[k] += " 999999999:1"
        refuse = "a dense matrix beyond memory"
    elif fault == "decreasing":
        lines[k] += " 3:1 2:1"
    elif fault == "duplicate_index":
        lines[k] += f" {d + 1}:1 {d + 1}:2"
    elif fault == "junk_token":
        lines[k] += " abc"
    elif fault == "empty":
        lines, refuse = [], "an empty file"
    elif fault == "crlf":
        lines = [line + "\r" for line in lines]
    elif fault == "comments_only":
        lines, refuse = ["# nothing", ""], "no samples"
    elif fault == "qid":
        lines = [line.replace(" ", " qid:1 ", 1) for line in lines]
    elif fault == "long_line":
        lines[k] += " " + " ".join(f"{j}:1" for j in range(d + 1, d + 20000))
    elif fault == "negative_index":
        lines[k] += " -3:1"
    elif fault == "zero_index":
        lines[k] = lines[k].split(" ")[0] + " 0:1"
    elif fault == "label_only":
        lines = [line.split(" ")[0] for line in lines]
        refuse = "no features at all"
    elif fault == "one_class":
        lines = ["+1" + line[line.index(" ") :] for line in lines]
        refuse = "a single class"
    text = "\n".join(lines) + ("\n" if lines else "")
    path = work / "d.svm"
    if fault == "binary":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))))
    elif fault == "truncate":
        path.write_text(text[: rng.randint(0, len(text))])
    else:
        path.write_text(text)
    clients = rng.randint(1, 3)
    raw = {
        "problem": {"name": "logistic"},
        "data": {"source": "libsvm", "path": str(path), "partition": "iid", "clients": clients},
    }
    return DataCase(raw, refuse)


def _leaf_case(rng: random.Random, work: Path) -> DataCase:
    width, classes = rng.randint(1, 4), rng.randint(2, 4)

    def user(n: int) -> dict[str, Any]:
        return {
            "x": [[round(rng.uniform(-1, 1), 3) for _ in range(width)] for _ in range(n)],
            "y": [rng.randrange(classes) for _ in range(n)],
        }

    names = [f"u{i}" for i in range(rng.randint(1, 4))]
    train = {"users": list(names), "num_samples": [], "user_data": {}}
    test = {"users": list(names), "num_samples": [], "user_data": {}}
    for name in names:
        train["user_data"][name], test["user_data"][name] = user(rng.randint(1, 4)), user(rng.randint(0, 2))
    for split in (train, test):
        split["num_samples"] = [len(split["user_data"][u]["y"]) for u in split["users"]]
    fault = rng.choice(
        [
            "none",
            "none",
            "float_label",
            "integral_float_label",
            "negative_label",
            "scalar_label",
            "matrix_label",
            "bool_label",
            "string_label",
            "duplicate_user",
            "duplicate_across_files",
            "list_user",
            "width_mismatch",
            "test_width_mismatch",
            "deep",
            "truncate",
            "gz_corrupt",
            "empty_file",
            "num_samples",
            "missing_test",
            "ragged",
            "string_x",
            "nan_x",
            "huge_x",
            "no_users",
            "missing_user_data",
            "empty_rows",
            "huge_label",
            "x_scalar",
        ]
    )
    refuse, extra, victim = "", None, rng.choice(names)
    record = train["user_data"][victim]
    if fault == "float_label":
        record["y"][0] = 0.5
        refuse = "a fractional label"
    elif fault == "integral_float_label":
        record["y"] = [float(v) for v in record["y"]]
    elif fault == "negative_label":
        record["y"][0] = -1
        refuse = "a negative label"
    elif fault == "scalar_label":
        record["y"] = 1
        refuse = "a scalar label list"
    elif fault == "matrix_label":
        record["y"] = [[v] for v in record["y"]]
        refuse = "2-D labels"
    elif fault == "bool_label":
        record["y"] = [True] * len(record["y"])
        refuse = "boolean labels"
    elif fault == "string_label":
        record["y"] = [str(v) for v in record["y"]]
        refuse = "string labels"
    elif fault == "duplicate_user":
        train["users"].append(victim)
        train["num_samples"].append(len(record["y"]))
        refuse = "a user listed twice"
    elif fault == "duplicate_across_files":
        extra = {"users": [victim], "user_data": {victim: user(2)}}
        refuse = "a user in two files"
    elif fault == "list_user":
        train["users"].append([victim])
        refuse = "a list-valued user name"
    elif fault == "width_mismatch" and len(names) > 1:
        other = train["user_data"][names[0] if victim != names[0] else names[1]]
        other["x"] = [row + [0.0] for row in other["x"]]
        refuse = "users of different widths"
    elif fault == "test_width_mismatch":
        test["user_data"][victim] = {"x": [[0.0] * (width + 1)], "y": [0]}
        test["num_samples"] = [len(test["user_data"][u]["y"]) for u in test["users"]]
        refuse = "train/test width mismatch"
    elif fault == "num_samples":
        train["num_samples"][0] += 3
        refuse = "num_samples disagreeing with the data"
    elif fault == "ragged" and len(record["x"]) > 1:
        record["x"][0] = record["x"][0] + [1.0]
        refuse = "ragged rows"
    elif fault == "string_x":
        record["x"][0][0] = "a"
        refuse = "a string feature"
    elif fault == "huge_x":
        record["x"][0][0] = 1e39
        refuse = "a feature beyond float32"
    elif fault == "no_users":
        train["users"] = []
        refuse = "no users"
    elif fault == "missing_user_data":
        del train["user_data"][victim]
        refuse = "a user without data"
    elif fault == "empty_rows":
        record["x"] = [[] for _ in record["y"]]
        refuse = "zero-feature samples"
    elif fault == "huge_label":
        record["y"][0] = 10**12
        refuse = "a class count beyond memory"
    elif fault == "x_scalar":
        record["x"] = 3
        refuse = "x that is not a list"
    folder = work / "leaf"
    (folder / "train").mkdir(parents=True)
    (folder / "test").mkdir()
    text = json.dumps(train)
    if fault == "nan_x":
        text = text.replace(str(record["x"][0][0]), "NaN", 1)
        refuse = "a NaN feature"
    if fault == "deep":
        text, refuse = "[" * 200_000 + "]" * 200_000, "deeply nested JSON"
    if fault == "truncate":
        text, refuse = text[: rng.randint(0, len(text) - 1)], "truncated JSON"
    if fault == "empty_file":
        text, refuse = "", "an empty file"
    if fault == "gz_corrupt":
        (folder / "train" / "a.json.gz").write_bytes(gzip.compress(text.encode())[: rng.randint(1, 30)])
        refuse = "a corrupt gzip file"
    else:
        (folder / "train" / "a.json").write_text(text)
    if extra is not None:
        (folder / "train" / "b.json").write_text(json.dumps(extra))
    if fault == "missing_test":
        (folder / "test").rmdir()
        refuse = "no test folder"
    else:
        (folder / "test" / "a.json").write_text(json.dumps(test))
    raw = {
        "problem": {"name": rng.choice(["softmax", "mlp"]), "hidden": [2]},
        "data": {"source": "leaf", "path": str(folder)},
    }
    samples = sum(len(train["user_data"][u]["y"]) for u in names) if fault in ("none", "integral_float_label") else None
    return DataCase(raw, refuse, samples)


def _forged_npy(fh, shape: tuple[int, ...], descr: str = "<f8") -> None:
    np.lib.format.write_array_header_1_0(fh, {"descr": descr, "fortran_order": False, "shape": shape})
    fh.write(b"\0" * 64)


def _arrays_case(rng: random.Random, work: Path) -> DataCase:
    n, d, classes = rng.randint(2, 10), rng.randint(1, 3), rng.choice([2, 3])
    x = np.random.default_rng(rng.randrange(2**32)).normal(size=(n, d))
    y = np.arange(n) % classes
    targets = rng.random() < 0.3
    fault = rng.choice(
        [
            "none",
            "none",
            "complex_x",
            "complex_y",
            "zero_width",
            "nan",
            "inf",
            "strings",
            "bool_y",
            "integral_float_y",
            "fractional_y",
            "negative_y",
            "mismatch",
            "empty",
            "truncate",
            "forged_header",
            "forged_small",
            "x_scalar",
            "y_matrix",
            "missing_key",
            "extra_key",
            "not_zip",
            "three_d",
            "huge_label",
            "object",
        ]
    )
    refuse = {
        "complex_x": "complex features",
        "complex_y": "complex labels",
        "zero_width": "zero-feature data",
        "nan": "NaN features",
        "inf": "infinite features",
        "strings": "string features",
        "bool_y": "boolean labels",
        "fractional_y": "fractional labels",
        "negative_y": "negative labels",
        "mismatch": "x/y length mismatch",
        "empty": "no samples",
        "truncate": "a truncated file",
        "forged_header": "a header claiming 10^12 rows",
        "x_scalar": "scalar features",
        "y_matrix": "2-D labels",
        "missing_key": "a missing array",
        "not_zip": "not an archive",
        "huge_label": "a class count beyond memory",
        "object": "pickled objects",
        "forged_small": "a header claiming more than the file",
    }.get(fault, "")
    if targets:
        refuse = {
            "complex_x": "complex targets",
            "zero_width": "zero-width targets",
            "nan": "NaN targets",
            "inf": "infinite targets",
            "strings": "string targets",
            "empty": "no samples",
            "truncate": "a truncated file",
            "forged_header": "a header claiming 10^12 rows",
            "forged_small": "a header claiming more than the file",
            "x_scalar": "a scalar",
            "three_d": "3-D targets",
            "object": "pickled objects",
            "not_zip": "",
        }.get(fault, "")
    x_out: Any = x
    y_out: Any = y
    if fault == "complex_x":
        x_out = x + 1j
    elif fault == "complex_y":
        y_out = y + 0j
    elif fault == "zero_width":
        x_out = x[:, :0]
    elif fault in ("nan", "inf"):
        x_out = x.copy()
        x_out[rng.randrange(n), 0] = np.nan if fault == "nan" else np.inf
    elif fault == "strings":
        x_out = np.array([["a"] * d] * n)
    elif fault == "bool_y":
        y_out = y.astype(bool)
    elif fault == "integral_float_y":
        y_out = y.astype(float)
    elif fault == "fractional_y":
        y_out = y + 0.5
    elif fault == "negative_y":
        y_out = y - 1
    elif fault == "mismatch":
        y_out = y[:-1]
    elif fault == "empty":
        x_out, y_out = x[:0], y[:0]
    elif fault == "x_scalar":
        x_out = np.float64(3.0)
    elif fault == "y_matrix":
        y_out = y[:, None]
    elif fault == "three_d":
        x_out = x[:, :, None]
    elif fault == "huge_label":
        y_out = y.copy()
        y_out[0] = 10**12
    elif fault == "object":
        x_out = np.array([{"a": 1}] * n, dtype=object)
    path = work / ("t.npy" if targets else "d.npz")
    if fault in ("forged_header", "forged_small"):
        shape = (10**12, d) if fault == "forged_header" else (n, d + 50)
        if targets:
            with open(path, "wb") as fh:
                _forged_npy(fh, shape)
        else:
            import zipfile

            with zipfile.ZipFile(path, "w") as archive:
                with archive.open("x.npy", "w") as fh:
                    _forged_npy(fh, shape)
                with archive.open("y.npy", "w") as fh:
                    np.lib.format.write_array(fh, y)
    elif fault == "not_zip":
        path.write_bytes(b"PK\x03\x04 not really" if not targets else b"\x93NUMPY garbage")
        refuse = "not an array file"
    elif targets:
        if fault == "object":
            np.save(path, x_out, allow_pickle=True)
        else:
            np.save(path, x_out)
    else:
        arrays = {"x": x_out, "y": y_out}
        if fault == "missing_key":
            del arrays["y"]
        if fault == "extra_key":
            arrays["z"] = np.zeros(3)
        np.savez(path, **arrays, allow_pickle=True) if fault == "object" else np.savez(path, **arrays)
    if fault == "truncate":
        payload = path.read_bytes()
        path.write_bytes(payload[: rng.randint(0, len(payload) - 1)])
    if targets:
        sizes = [1] * (n - 1) + [1] if fault not in ("empty",) else [1]
        raw = {
            "problem": {"name": "quadratic"},
            "data": {"source": "targets", "path": str(path), "client_sizes": sizes},
        }
    else:
        raw = {
            "problem": {"name": rng.choice(["softmax", "logistic", "mlp"]), "hidden": [2]},
            "data": {"source": "npz", "path": str(path), "partition": "iid", "clients": rng.randint(1, 3)},
        }
    return DataCase(raw, refuse)


def run_data_case(seed: int, work: Path) -> Result:
    from fedshuffle.core.errors import ConfigError
    from fedshuffle.experiments.build import build_problem_and_data
    from fedshuffle.experiments.schema import RunSpec, validate

    rng = random.Random(f"data:{seed}")
    maker = rng.choice([_svmlight_case, _leaf_case, _arrays_case])
    case = maker(rng, work)
    label = f"{maker.__name__.strip('_').removesuffix('_case')}: {case.refuse or 'valid'}"
    try:
        with time_limit(CASE_SECONDS):
            problem, data = build_problem_and_data(validate(RunSpec, case.raw))
    except Hang as exc:
        return Result("hang", str(exc), label)
    except ConfigError as exc:
        if not exc.field or "Traceback" in str(exc):
            return Result("traceback", f"ConfigError without a field: {exc}", label)
        return Result("clean_error", str(exc)[:200], label)
    except Exception as exc:  # noqa: BLE001 (classified, not hidden)
        return Result("traceback", _tail(exc), label)
    if case.refuse:
        return Result("nonsense", f"accepted {case.refuse}", label)
    features = data.features.numpy()
    labels = data.labels.numpy()
    if not np.isfinite(features).all() or features.reshape(len(features), -1).shape[1] == 0:
        return Result("nonsense", "loaded non-finite or zero-width features", label)
    if (
        problem.name != "quadratic"
        and problem.name != "logistic"
        and (labels.min() < 0 or not np.array_equal(labels, np.round(labels)))
    ):
        return Result("nonsense", "loaded labels that are not class indices", label)
    if case.samples is not None and data.num_samples != case.samples:
        return Result("nonsense", f"loaded {data.num_samples} samples, the files hold {case.samples}", label)
    return Result("ran", "", label)


# -- results folders ----------------------------------------------------------------------------------------

RESULTS_CONFIG = (
    SMALL_CONFIG.replace("rounds = 2\neval_every = 1", "rounds = 4\neval_every = 1\ncheckpoint_every = 1")
    + "[experiment]\nseeds = [0, 1]\n"
)


def make_template(root: Path) -> Path:
    """A finished two-variant, two-seed results folder (and its config), built once per process."""
    folder = root / "template"
    if (folder / "summary.json").exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    (root / "template.toml").write_text(RESULTS_CONFIG)
    result, output = invoke(
        ["run", str(root / "template.toml"), "--out", str(folder), "--quiet", "--workers", "1"], root, seconds=600
    )
    if result.outcome != "ran":
        raise RuntimeError(f"could not build the results template: {result.detail} {output[-500:]}")
    return folder


CORRUPTIONS = (
    "truncate",
    "empty",
    "bytes",
    "flip",
    "delete",
    "directory",
    "append",
    "json_type",
    "json_fields",
    "csv_rows",
    "csv_header",
)


def corrupt(path: Path, how: str, rng: random.Random) -> None:
    data = path.read_bytes() if path.is_file() else b""
    if how == "truncate":
        path.write_bytes(data[: rng.randint(0, max(len(data) - 1, 0))])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bytes":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(1, 500))))
    elif how == "flip" and data:
        buf = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(buf))
    elif how == "delete":
        path.unlink()
    elif how == "directory":
        path.unlink()
        path.mkdir()
    elif how == "append":
        path.write_bytes(data + rng.choice([b"\x00garbage", b"\n1,2,3\n", b"}", b"\xff\xfe"]))
    elif how == "json_type":
        path.write_text(
            rng.choice(
                [
                    "[]",
                    '"x"',
                    "{}",
                    "null",
                    "1e999",
                    '{"status": 5}',
                    '{"final": []}',
                    '{"status": "complete", "final": {"loss": "x"}}',
                    '{"label": [], "seed": "x"}',
                ]
            )
        )
    elif how == "json_fields" and path.suffix == ".json":
        try:
            doc = json.loads(data)
        except ValueError:
            doc = {}
        if isinstance(doc, dict) and doc:
            key = rng.choice(sorted(doc))
            doc[key] = rng.choice([None, [], "x", -1, {"a": 1}, 1e308])
        path.write_text(json.dumps(doc))
    elif how == "csv_rows" and path.suffix == ".csv":
        lines = data.decode(errors="replace").splitlines()
        if len(lines) > 1:
            k = rng.randrange(1, len(lines))
            lines[k] = rng.choice(
                ["", "x,y", ",".join(["nan"] * 13), lines[k] + ",extra", lines[k].replace(",", ";"), "1" * 5000]
            )
        path.write_text("\n".join(lines) + "\n")
    elif how == "csv_header" and path.suffix == ".csv":
        lines = data.decode(errors="replace").splitlines()
        lines[0:1] = [rng.choice(["", "a,b,c", lines[0].replace("round", "rnd") if lines else ""])]
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_bytes(data[: len(data) // 2])


def run_results_case(seed: int, work: Path, template: Path) -> Result:
    rng = random.Random(f"results:{seed}")
    folder = work / "results"
    shutil.copytree(template, folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    preferred = [
        p
        for p in files
        if p.name
        in (
            "checkpoint.pt",
            "summary.json",
            "metrics.csv",
            "config.json",
            "final_params.npy",
            "journal.npz",
            "applied",
            "metrics.parquet",
        )
    ] or files
    interrupted = rng.random() < 0.4
    if interrupted:  # as if killed after a checkpoint: no summaries
        for summary in folder.rglob("summary.json"):
            if rng.random() < 0.7:
                summary.unlink()
    targets = [p for p in preferred if p.exists()]
    touched = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if not targets:
            break
        path = rng.choice(targets)
        how = rng.choice(CORRUPTIONS)
        if path.exists() and path.is_file():
            corrupt(path, how, rng)
            touched.append(f"{path.relative_to(folder)}:{how}")
    command = rng.choices(["resume", "plot", "table", "table_best", "plot_metric"], [5, 2, 2, 1, 1])[0]
    argv = {
        "resume": ["run", str(template.parent / "template.toml"), "--resume", str(folder), "--quiet", "--workers", "1"],
        "plot": ["plot", str(folder)],
        "table": ["table", str(folder)],
        "table_best": ["table", str(folder), "--stat", "best"],
        "plot_metric": ["plot", str(folder), "--metric", rng.choice(METRIC_NAMES)],
    }[command]
    result, _ = invoke(argv, work)
    result.case = f"{command} after {', '.join(touched) or 'no change'}{' (interrupted)' if interrupted else ''}"
    if result.outcome == "ran" and command == "resume":
        problem = _resume_problem(folder, template)
        if problem:
            return Result("nonsense", problem, result.case)
    return result


def _resume_problem(folder: Path, template: Path) -> str:
    """After ``--resume`` exited 0, every seed must end as the uncorrupted run did."""
    for reference in template.rglob("final_params.npy"):
        mine = folder / reference.relative_to(template)
        try:
            if not np.array_equal(np.load(mine), np.load(reference)):
                return f"{mine.relative_to(folder)} differs from the uninterrupted run"
        except (OSError, ValueError, EOFError) as exc:
            return f"{mine.relative_to(folder)} unreadable after a successful resume ({type(exc).__name__})"
    problem = _results_problem(folder)
    return problem


# -- hostile results folders ----------------------------------------------------------------------------------

#: what a hostile results folder tries: write through a link, block on a FIFO, escape through a name that is
#: a path, pass off another run's checkpoint, run code from a checkpoint or client-state file, exhaust recursion
HOSTILE = ("symlink", "fifo", "name", "swap", "malicious", "deep")
#: wall-clock seconds a hostile case may take (a process blocked on a FIFO uses no CPU time)
HOSTILE_SECONDS = 120
VICTIM = b"precious\n"
RESULTS_FILES = (
    "metrics.csv",
    "summary.json",
    "config.json",
    "timing.csv",
    "checkpoint.pt",
    ".lock",
    ".write-test",
    "final_params.npy",
)
PATH_NAMES = [
    "..",
    "../x",
    "../../x",
    "/tmp/fedshuffle-fuzz-abs",
    ".",
    "a/b",
    "..\\x",
    " ",
    "a\u0000b",
    "x\u0007",
    "~",
    "x" * 300,
    "ok-name",
]


class _Payload:
    """Unpickled, runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def hostile_checkpoint(marker: Path, form: str) -> bytes:
    """A checkpoint file whose payload runs ``touch MARKER`` when unpickled, behind a correct SHA-256 header."""
    import hashlib
    import io
    import pickle

    import torch

    from fedshuffle.core.checkpoint import MAGIC, OLD_MAGIC

    buf = io.BytesIO()
    if form == "pickle":
        buf.write(pickle.dumps(_Payload(marker)))
    else:
        torch.save({"run": {}, "state": _Payload(marker)} if form == "zip" else _Payload(marker), buf)
    payload = buf.getvalue()
    return (OLD_MAGIC if form == "old" else MAGIC) + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def wall_limit(seconds: float) -> contextlib.AbstractContextManager[None]:
    """Raise :class:`Hang` once ``seconds`` of wall-clock time have passed (a blocked ``open`` is interrupted too)."""
    return _limit(seconds, signal.ITIMER_REAL, signal.SIGALRM, f"blocked for {seconds:.0f} s")


def nest(folder: Path, depth: int) -> None:
    """``folder/d/d/.../d``, ``depth`` levels, made through file descriptors (the path is longer than one may name)."""
    fd = os.open(folder, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def unnest(folder: Path) -> None:
    """Remove what :func:`nest` made, deepest first, without recursion."""
    fds = [os.open(folder, os.O_RDONLY)]
    while True:
        try:
            fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
        except (FileNotFoundError, NotADirectoryError):
            break
    os.close(fds.pop())
    while fds:
        os.rmdir("d", dir_fd=fds[-1])
        os.close(fds.pop())


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` (not following links) and its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


def run_hostile_case(seed: int, work: Path, template: Path) -> Result:
    """Attack ``HOSTILE[seed % 6]`` on a copy of a finished results folder; outside the folder lie a victim
    file and folder whose bytes must not change and a marker file that code run from a file would create."""
    rng = random.Random(f"hostile:{seed}")
    attack = HOSTILE[seed % len(HOSTILE)]
    folder, victim, victim_dir, marker = work / "results", work / "victim.txt", work / "victim-dir", work / "marker"
    shutil.copytree(template, folder, symlinks=True)
    victim.write_bytes(VICTIM)
    victim_dir.mkdir()
    (victim_dir / "kept.txt").write_bytes(VICTIM)
    config = str(template.parent / "template.toml")
    runs = sorted(p.parent for p in folder.rglob("checkpoint.pt"))
    run = rng.choice(runs)
    if rng.random() < 0.6:  # as if killed after a checkpoint: resume reads what is left
        (run / "summary.json").unlink(missing_ok=True)
    command = rng.choice(["resume", "resume", "plot", "table"])
    argv = {
        "resume": ["run", config, "--resume", str(folder), "--quiet", "--workers", "1"],
        "plot": ["plot", str(folder), "--out", str(work / "p")],
        "table": ["table", str(folder)],
    }[command]
    cwd, deep = work, None
    if attack == "symlink":
        where = rng.choice(
            [
                *(run / name for name in RESULTS_FILES),
                folder / ".lock",
                folder / ".write-test",
                folder / "manifest.json",
                run,
                run.parent,
                run / "client_state",
            ]
        )
        if where == folder / "manifest.json" or where in (run, run.parent):
            command = "resume"
            argv = ["run", config, "--resume", str(folder), "--quiet", "--workers", "1"]
        if where.is_dir() and not where.is_symlink():
            shutil.rmtree(where)
        else:
            where.unlink(missing_ok=True)
        where.symlink_to(victim_dir if where in (run, run.parent, run / "client_state") else victim)
        case = f"{where.relative_to(folder)} → outside; {command}"
    elif attack == "fifo":
        where = run / rng.choice(RESULTS_FILES)
        where.unlink(missing_ok=True)
        os.mkfifo(where)
        case = f"FIFO {where.relative_to(folder)}; {command}"
    elif attack == "name":
        name = rng.choice(PATH_NAMES)
        text = RESULTS_CONFIG + f"name = {json.dumps(name)}\n"
        (work / "named.toml").write_text(text, errors="surrogatepass")
        cwd = work / "cwd"
        cwd.mkdir()
        command = rng.choice(["run", "sweep"])
        argv = [command, str(work / "named.toml"), "--quiet", "--workers", "1", "--set", "run.rounds=1"]
        case = f"experiment.name = {name[:20]!r}; {command}"
    elif attack == "swap":
        other = rng.choice([r for r in runs if r != run])
        shutil.copy(other / "checkpoint.pt", run / "checkpoint.pt")
        (run / "summary.json").unlink(missing_ok=True)
        command, argv = "resume", ["run", config, "--resume", str(folder), "--quiet", "--workers", "1"]
        case = f"{other.relative_to(folder)}/checkpoint.pt over {run.relative_to(folder)}; resume"
    elif attack == "malicious":
        form = rng.choice(["pickle", "zip", "old"])
        (run / "checkpoint.pt").write_bytes(hostile_checkpoint(marker, form))
        (run / "summary.json").unlink(missing_ok=True)
        command = rng.choice(["resume", "resume", "sweep"])
        argv = (
            ["run", config, "--resume", str(folder), "--quiet", "--workers", "1"]
            if command == "resume"
            else ["sweep", config, "--out", str(folder), "--quiet", "--workers", "1"]
        )
        case = f"pickled os.system in {run.relative_to(folder)}/checkpoint.pt ({form}); {command}"
    else:
        deep = rng.choice([folder, run, run.parent])
        nest(deep, rng.choice([40, 1100, 1500]))
        case = f"folders nested below {deep.relative_to(work)}; {command}"
    before = _snapshot(victim_dir)
    try:
        with wall_limit(HOSTILE_SECONDS):
            result, _ = invoke(argv, cwd)
    finally:
        if deep is not None:
            unnest(deep)
    result.case = case = f"{attack}: {case}"
    if marker.exists():
        return Result("nonsense", "code ran from a file of the results folder (the marker exists)", case)
    if (
        victim.read_bytes() != VICTIM
        or _snapshot(victim_dir) != before
        or sorted(p.name for p in victim_dir.iterdir()) != ["kept.txt"]
    ):
        return Result("nonsense", "a file outside the results folder was written", case)
    if attack == "name":
        outside = sorted(p.name for p in cwd.iterdir() if p.name != "results")
        if outside or Path("/tmp/fedshuffle-fuzz-abs").exists():
            return Result("nonsense", f"the experiment was written outside results/: {outside}", case)
    if result.outcome == "ran" and attack == "swap":
        problem = _resume_problem(folder, template)
        if problem:
            return Result("nonsense", f"another run's checkpoint was continued: {problem}", case)
    if result.outcome == "ran" and attack == "malicious":
        return Result("nonsense", "a run whose checkpoint holds code finished", case)
    return result


def run_case(kind: str, seed: int, work: Path, template: Path | None) -> Result:
    """One case of ``kind`` drawn from ``seed``, run in the empty folder ``work``."""
    try:
        if kind in INPUT_KINDS:
            return run_input_case(kind, seed, work)
        if kind in TRUST_KINDS:
            from fuzzing_trust import run_trust_case

            return run_trust_case(kind, seed, work)
        if kind == "configs":
            return run_config_case(seed, work)
        if kind == "cli":
            return run_cli_case(seed, work, template)
        if kind == "data":
            return run_data_case(seed, work)
        assert template is not None
        if kind == "hostile":
            return run_hostile_case(seed, work, template)
        return run_results_case(seed, work, template)
    except Hang as exc:
        return Result("hang", str(exc))
    except Exception as exc:  # noqa: BLE001 (a failure of the harness itself is reported as one)
        return Result("traceback", f"harness: {_tail(exc)}")


# == inputs from outside: hostile HTTP servers, decompression and allocation bombs, special files, huge values ==
#
# Four kinds, each case bounded in wall-clock time (a FIFO blocks without using the CPU, so these cases
# use SIGALRM rather than the CPU-time alarm): ``downloads`` (a server on 127.0.0.1 that answers
# garbage, too much, too slowly or not at all; a mirror that is not a URL), ``bombs`` (a gzip IDX file
# that inflates past its header, a CIFAR pickle or .npy header claiming a terabyte, an archive member
# declaring one, corrupt .tar.xz and LZMA .npz, TFF HDF5 files of the wrong structure), ``special``
# (a FIFO, a device, a socket or a folder where a config or data file is expected) and ``values``
# (numbers of thousands of digits, brackets nested a thousand deep, names over 255 bytes, weights that
# overflow, client counts and sizes that cannot fit). Every case of these kinds must be refused: a run
# that accepts one is ``nonsense``.

import socket
import threading
import time

INPUT_KINDS = ("downloads", "bombs", "special", "values")
#: what a run must not trust (tests/fuzzing_trust.py)
TRUST_KINDS = ("plugins", "nodedata", "checkpoints", "privacy", "signals", "tmpdir")
KINDS = (*KINDS, *INPUT_KINDS, *TRUST_KINDS)
#: wall-clock seconds an input case may take (downloads run under DOWNLOAD_LIMITS: a 1.5 s deadline)
INPUT_CASE_SECONDS = 30.0


def _status(code: int = 200, headers: tuple[str, ...] = (), length: int | None = None) -> bytes:
    lines = [
        f"HTTP/1.1 {code} X",
        *headers,
        *([f"Content-Length: {length}"] if length is not None else []),
        "Connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _trickle(conn: socket.socket, stop: threading.Event, data: bytes, pause: float) -> None:
    for byte in data[:400]:
        if stop.wait(pause):
            return
        conn.sendall(bytes([byte]))


def _endless(conn: socket.socket, stop: threading.Event, head: bytes) -> None:
    conn.sendall(head)
    for _ in range(4096):  # at most 256 MiB, stopped as soon as the client hangs up
        if stop.is_set():
            return
        conn.sendall(b"\0" * 65536)


def _reset(conn: socket.socket, stop: threading.Event) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close with RST


#: reply name → reply(conn, stop, body); ``body`` is the genuine file, which only "good" sends as it is
HOSTILE_REPLIES: dict[str, Callable[[socket.socket, threading.Event, bytes], None]] = {
    "good": lambda c, s, body: c.sendall(_status(200, length=len(body)) + body),
    "garbage_status": lambda c, s, body: c.sendall(b"GARBAGE \x00\xff\r\n\r\n"),
    "empty_reply": lambda c, s, body: None,
    "incomplete": lambda c, s, body: c.sendall(_status(200, length=len(body)) + body[: len(body) // 2]),
    "long_header_line": lambda c, s, body: c.sendall(
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n" + body
    ),
    "too_many_headers": lambda c, s, body: c.sendall(
        _status(200, tuple(f"X-{k}: 1" for k in range(150)), len(body)) + body
    ),
    "huge_length": lambda c, s, body: c.sendall(_status(200, length=10**15) + body),
    "endless_body": lambda c, s, body: _endless(c, s, _status(200)),
    "trickle_headers": lambda c, s, body: _trickle(c, s, _status(200, length=len(body)) + body, 0.2),
    "trickle_body": lambda c, s, body: (c.sendall(_status(200, length=len(body))), _trickle(c, s, body, 0.2)),
    "silent": lambda c, s, body: s.wait(INPUT_CASE_SECONDS),
    "server_error": lambda c, s, body: c.sendall(_status(503, length=0)),
    "not_found": lambda c, s, body: c.sendall(_status(404, length=0)),
    "reset": lambda c, s, body: _reset(c, s),
    "redirect_loop": lambda c, s, body: c.sendall(_status(302, ("Location: /again",), 0)),
    "wrong_file": lambda c, s, body: c.sendall(_status(200, length=len(body)) + bytes(b ^ 1 for b in body)),
}


class HostileServer:
    """An HTTP "server" on 127.0.0.1 answering each connection with ``replies[k]`` (the last one repeated),
    in a thread; at most ``connections`` connections; stopped (its thread joined) on exit."""

    def __init__(self, replies: list[str], body: bytes, connections: int = 32) -> None:
        self.replies, self.body, self.connections = replies, body, connections
        self.served: list[str] = []
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> HostileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.listener.close()

    def _serve(self) -> None:
        while not self.stop.is_set() and len(self.served) < self.connections:
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            name = self.replies[min(len(self.served), len(self.replies) - 1)]
            self.served.append(name)
            with conn:
                try:
                    conn.settimeout(1)
                    conn.recv(65536)  # the request
                    HOSTILE_REPLIES[name](conn, self.stop, self.body)
                except OSError:
                    pass


def download_limits():
    """Download bounds small enough for tests: 1 s to connect or read, a 1.5 s deadline, two tries."""
    from fedshuffle.data.sources.fetch import DownloadLimits

    return DownloadLimits(
        connect_timeout=1.0,
        read_timeout=1.0,
        deadline=1.5,
        min_rate=1e12,
        attempts=2,
        backoff=0.05,
        max_bytes=1 << 20,
        margin=0.0,
        slack=0,
    )


MIRRORS = [
    "not a url",
    "http://[::1",
    "ftp://127.0.0.1/x",
    "http://",
    "http://127.0.0.1:99999",
    "http://exa mple/",
    "file:///etc",
    "http://127.0.0.1:1\r\nX: y",
    "\0",
]


def run_download_case(seed: int, work: Path) -> Result:
    from fedshuffle.core.errors import ConfigError
    from fedshuffle.data.sources import fetch

    rng = random.Random(f"downloads:{seed}")
    body = rng.randbytes(rng.choice([1, 100, 5000]))

    def remote(url: str) -> fetch.RemoteFile:
        return fetch.RemoteFile("toy", "toy.bin", url, hashlib.sha256(body).hexdigest(), len(body))

    replies = [rng.choice(sorted(HOSTILE_REPLIES)) for _ in range(rng.choice([1, 1, 2]))]
    mirror = rng.choice(MIRRORS) if rng.random() < 0.15 else None
    label = f"mirror {mirror!r}" if mirror is not None else "→".join(replies)
    retried = (
        "server_error",
        "reset",
        "incomplete",
        "empty_reply",
        "garbage_status",
        "long_header_line",
        "too_many_headers",
    )
    must_succeed = mirror is None and (replies[0] == "good" or (replies[-1] == "good" and replies[0] in retried))
    previous = fetch.LIMITS
    fetch.LIMITS = download_limits()
    began = time.monotonic()
    try:
        with wall_limit(INPUT_CASE_SECONDS), HostileServer(replies, body) as server:
            if mirror is not None:
                fetch.locate(remote(""), mirror=mirror)
            else:
                path = fetch.locate(remote(server.url + "/toy.bin"))
                if path.read_bytes() != body:
                    return Result("nonsense", "kept a file that is not the one served", label)
    except Hang as exc:
        return Result("hang", str(exc), label)
    except ConfigError as exc:
        leftovers = list(fetch.cache_dir().rglob("*.part")) if fetch.cache_dir().exists() else []
        if "\n" in str(exc) or leftovers:
            return Result(
                "nonsense", f"not one line, or a partial file left: {str(exc)[:120]!r} {leftovers[:1]}", label
            )
        if must_succeed:
            return Result("nonsense", f"refused a download that the last try served: {exc}", label)
        return Result("clean_error", str(exc)[:200], label)
    except Exception as exc:  # noqa: BLE001 (classified, not hidden)
        return Result("traceback", _tail(exc), label)
    finally:
        fetch.LIMITS = previous
        shutil.rmtree(fetch.cache_dir() / "toy", ignore_errors=True)
    if time.monotonic() - began > 10:
        return Result("hang", f"took {time.monotonic() - began:.1f} s with a 1.5 s deadline", label)
    if mirror is not None or not set(replies) & {
        "good",
        "trickle_body",
        "trickle_headers",
    }:  # the replies that send the genuine file (slowly: in time for a small one)
        return Result("nonsense", "accepted a download that must fail", label)
    return Result("ran", "", label)


class _HugeArray:
    """Pickles as numpy's ``_reconstruct(ndarray, shape, dtype)``, which allocates ``shape`` at once."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __reduce__(self):
        from numpy._core.multiarray import _reconstruct

        return _reconstruct, (np.ndarray, self.shape, b"b")


def tar_bytes(members: dict[str, bytes], mode: str = "w:gz", declared: dict[str, int] | None = None) -> bytes:
    """A tar archive of ``members``; ``declared`` overrides a member's size in its header (the data is not padded)."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as archive:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    raw = buffer.getvalue()
    for name, size in (declared or {}).items():  # rewrite the octal size field of an uncompressed archive's header
        at = raw.index(name.encode())
        raw = raw[: at + 124] + f"{size:011o}\0".encode()[-12:] + raw[at + 136 :]  # sizes up to 8**11 - 1 (8 GiB)
        checksum = sum(raw[at : at + 148]) + 8 * 32 + sum(raw[at + 156 : at + 512])
        raw = raw[: at + 148] + f"{checksum:06o}\0 ".encode() + raw[at + 156 :]
    return raw


def _cifar_member(rng: random.Random, labels: Any = None, data: Any = None) -> bytes:
    import pickle

    n = 4
    return pickle.dumps(
        {
            "data": np.zeros((n, 3072), np.uint8) if data is None else data,
            "labels": list(range(n)) if labels is None else labels,
        },
        protocol=2,
    )


def _h5(path: Path, build: Callable[[Any], None]) -> Path:
    import h5py

    with h5py.File(path, "w") as h5:
        build(h5)
    return path


def _tff_cifar_client(h5, images: Any, labels: Any, coarse: Any = None) -> None:
    record = h5.require_group("examples").create_group("0")
    record.create_dataset("image", data=images)
    record.create_dataset("label", data=labels)
    record.create_dataset("coarse_label", data=labels if coarse is None else coarse)


def bomb(rng: random.Random, work: Path) -> tuple[str, Callable[[], Any]]:
    """One decompression or allocation bomb, or a damaged compressed or HDF5 file: (name, the call that reads it)."""
    import gzip
    import io
    import zipfile

    from fedshuffle.data.sources import arrays, cifar, fetch, mnist, shakespeare

    members = [
        f"cifar-10-batches-py/{m}" for m in (*cifar.CIFAR_ARCHIVES["cifar10"][2], cifar.CIFAR_ARCHIVES["cifar10"][3])
    ]
    kind = rng.choice(
        [
            "gzip_idx",
            "idx_header",
            "reconstruct",
            "cifar_labels",
            "tar_member_size",
            "corrupt_xz",
            "lzma_npz",
            "npy_header",
            "tff_cifar",
            "tff_shakespeare",
            "gunzip",
            "leaf_gzip",
        ]
    )
    path = work / f"{kind}.bin"
    if kind == "gzip_idx":
        path.write_bytes(
            gzip.compress(b"\0\0\x08\x01" + (10).to_bytes(4, "big") + b"\0" * rng.choice([11, 1 << 20, 30 << 20]), 1)
        )
        return kind, lambda: mnist.read_idx(path, 1)
    if kind == "idx_header":
        path.write_bytes(
            b"\0\0\x08\x03"
            + b"".join(
                n.to_bytes(4, "big") for n in (rng.choice([2**31, 2**32 - 1, 60000]), 28, rng.choice([28, 2**30]))
            )
            + b"\0" * 100
        )
        return kind, lambda: mnist.read_idx(path, 3)
    if kind in ("reconstruct", "cifar_labels"):
        import pickle

        bad = (
            pickle.dumps(
                {"data": _HugeArray(rng.choice([(2**40,), (2**20, 2**20), (2**62, 4)])), "labels": [0]}, protocol=2
            )
            if kind == "reconstruct"
            else _cifar_member(
                rng,
                labels=rng.choice(
                    [["3"] * 4, [2**70] * 4, None if rng.random() < 0.5 else {"a": 1}, [1.5] * 4, [[1, 2]] * 4]
                ),
            )
        )
        if kind == "cifar_labels" and bad == _cifar_member(rng):
            bad = _cifar_member(rng, labels="abcd")
        path.write_bytes(tar_bytes({m: bad if k == 0 else _cifar_member(rng) for k, m in enumerate(members)}))
        return kind, lambda: cifar.read_cifar_archive(path, "cifar10")
    if kind == "tar_member_size":
        path.write_bytes(tar_bytes({members[0]: _cifar_member(rng)}, "w", {members[0]: rng.choice([2**32, 8**11 - 1])}))
        return kind, lambda: cifar.read_cifar_archive(path, "cifar10")
    if kind == "corrupt_xz":
        raw = bytearray(tar_bytes({m: _cifar_member(rng) for m in members}, "w:xz"))
        for _ in range(rng.randint(1, 20)):
            raw[rng.randrange(12, len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw[: rng.choice([len(raw), len(raw) // 2])]))
        return kind, lambda: cifar.read_cifar_archive(path, "cifar10")
    if kind in ("lzma_npz", "npy_header"):
        buffer = io.BytesIO()
        np.savez(buffer, x=np.ones((4, 2)), y=np.arange(4))
        source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
        path = work / "d.npz"
        with zipfile.ZipFile(
            path, "w", compression=zipfile.ZIP_LZMA if kind == "lzma_npz" else zipfile.ZIP_DEFLATED
        ) as out:
            for name in source.namelist():
                payload = source.read(name)
                if kind == "npy_header" and name == "x.npy":
                    payload = payload.replace(
                        b"(4, 2)", rng.choice([b"(1000000000000, 2)", b"(4, 100000000000)", b"(-1, 2)"]).ljust(6)
                    )
                out.writestr(name, payload)
        if kind == "lzma_npz":
            raw = bytearray(path.read_bytes())
            for _ in range(rng.randint(1, 10)):
                raw[rng.randrange(40, len(raw) - 100)] ^= 0xFF
            path.write_bytes(bytes(raw))
        return kind, lambda: arrays.load_npz(path)
    if kind == "tff_cifar":
        images = np.zeros((rng.choice([0, 2]), 32, 32, 3), np.uint8)
        variant = rng.choice(["strings", "2d", "empty", "dataset_as_client", "floats_image"])
        if variant == "strings":
            _h5(
                path,
                lambda h5: _tff_cifar_client(
                    h5, images[:2] if len(images) else np.zeros((2, 32, 32, 3), np.uint8), np.array([b"1", b"2"])
                ),
            )
        elif variant == "2d":
            _h5(path, lambda h5: _tff_cifar_client(h5, np.zeros((2, 32, 32, 3), np.uint8), np.zeros((2, 2), np.int64)))
        elif variant == "empty":
            _h5(path, lambda h5: _tff_cifar_client(h5, np.zeros((0, 32, 32, 3), np.uint8), np.zeros(0, np.int64)))
        elif variant == "dataset_as_client":
            _h5(path, lambda h5: h5.require_group("examples").create_dataset("0", data=np.zeros(3)))
        else:
            _h5(path, lambda h5: _tff_cifar_client(h5, np.zeros((2, 32, 32, 3)), np.zeros(2, np.int64)))
        return f"{kind}:{variant}", lambda: cifar.read_tff_cifar100(path)
    if kind == "tff_shakespeare":
        variant = rng.choice(["examples_dataset", "role_dataset", "snippets_ints", "snippets_group", "snippets_2d"])

        def build(h5):
            if variant == "examples_dataset":
                h5.create_dataset("examples", data=np.zeros(3))
                return
            examples = h5.create_group("examples")
            if variant == "role_dataset":
                examples.create_dataset("ROLE", data=np.zeros(3))
            elif variant == "snippets_ints":
                examples.create_group("ROLE").create_dataset("snippets", data=np.arange(3))
            elif variant == "snippets_group":
                examples.create_group("ROLE").create_group("snippets")
            else:
                examples.create_group("ROLE").create_dataset("snippets", data=np.array([[b"ab", b"c"]]))

        _h5(path, build)
        return f"{kind}:{variant}", lambda: shakespeare.read_tff_shakespeare(path)
    if (
        kind == "leaf_gzip"
    ):  # a JSON file that inflates past what memory allows (the fuzzing environment's 1 GiB: 102 MiB of text)
        from fedshuffle.data.sources.leaf import load_leaf

        text = json.dumps({"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[1.0]], "y": [1]}}})
        for split in ("train", "test"):
            (work / split).mkdir()
            (work / split / "a.json").write_text(text)
        (work / "train" / "a.json").unlink()
        (work / "train" / "a.json.gz").write_bytes(
            gzip.compress((text + " " * rng.choice([200 << 20, 300 << 20])).encode(), 1)
        )
        return kind, lambda: load_leaf(work, None)
    path.write_bytes(gzip.compress(b"\0" * (4 << 20), 1))
    return kind, lambda: fetch.gunzip(path, work / "out.bin", 1 << 20)


def _refused(exc: BaseException, label: str) -> Result:
    """An input case that stopped with ``exc``: a hang, a one-line refusal (clean), a refusal of several lines, or a
    traceback."""
    from fedshuffle.core.errors import ConfigError

    if isinstance(exc, Hang):
        return Result("hang", str(exc), label)
    if isinstance(exc, ConfigError):
        return Result("nonsense" if "\n" in str(exc) else "clean_error", str(exc)[:200], label)
    return Result("traceback", _tail(exc), label)


def run_bomb_case(seed: int, work: Path) -> Result:
    rng = random.Random(f"bombs:{seed}")
    label, read = bomb(rng, work)
    try:
        with wall_limit(INPUT_CASE_SECONDS):
            loaded = read()
    except (Hang, Exception) as exc:  # noqa: BLE001 (classified, not hidden)
        return _refused(exc, label)
    if label == "lzma_npz" and np.array_equal(loaded[0], np.ones((4, 2))) and np.array_equal(loaded[1], np.arange(4)):
        return Result("ran", "the flipped bytes were in fields that do not matter", label)
    return Result("nonsense", "accepted a bomb or a damaged file", label)


def special_file(rng: random.Random, work: Path) -> tuple[str, Path]:
    """A FIFO, a device, a socket or a folder at ``work/<name>``, or a device's own path: (what, path)."""
    kind = rng.choice(["fifo", "fifo", "dev_zero", "dev_null", "dev_urandom", "socket", "folder"])
    path = work / f"special-{kind}.toml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        listener.close()  # the socket file stays
    elif kind == "folder":
        path.mkdir()
    else:
        return kind, Path("/dev") / kind.removeprefix("dev_")
    return kind, path


def run_special_case(seed: int, work: Path) -> Result:
    """A special file where a config file (``run``, ``show``, ``inspect --config``) or a data file is expected."""
    from fedshuffle.experiments.build import build_problem_and_data
    from fedshuffle.experiments.schema import RunSpec, validate

    rng = random.Random(f"special:{seed}")
    what, path = special_file(rng, work)
    use = rng.choice(["run", "show", "inspect", "npz", "targets", "libsvm", "leaf", "mnist"])
    label = f"{what} as {use}"
    try:
        with wall_limit(INPUT_CASE_SECONDS):
            if use in ("run", "show", "inspect"):
                argv = {
                    "run": ["run", str(path), "--quiet", "--out", str(work / "out")],
                    "show": ["show", str(path)],
                    "inspect": ["inspect", "--config", str(path)],
                }[use]
                result, _ = invoke(argv, work)
                result.case = label
                return (
                    Result("nonsense", "exit 0 with a special file as the config", label)
                    if result.outcome == "ran"
                    else result
                )
            data = {
                "npz": {"source": "npz", "path": str(path)},
                "targets": {"source": "targets", "path": str(path), "client_sizes": [1]},
                "libsvm": {"source": "libsvm", "path": str(path)},
                "leaf": {"source": "leaf", "path": str(work)},
                "mnist": {"source": "mnist", "data_dirs": [str(work)], "download": False},
            }[use]
            if use == "leaf":
                (work / "train").mkdir(exist_ok=True)
                (work / "test").mkdir(exist_ok=True)
                os.mkfifo(work / "train" / "all_data.json")
            if use == "mnist":
                (work / "mnist").mkdir(exist_ok=True)
                for name in (
                    "train-images-idx3-ubyte.gz",
                    "train-labels-idx1-ubyte.gz",
                    "t10k-images-idx3-ubyte.gz",
                    "t10k-labels-idx1-ubyte.gz",
                ):
                    os.mkfifo(work / "mnist" / name)
            problem = {"name": "quadratic"} if use == "targets" else {"name": "logistic"}
            build_problem_and_data(validate(RunSpec, {"data": data, "problem": problem}))
    except (Hang, Exception) as exc:  # noqa: BLE001 (classified, not hidden)
        return _refused(exc, label)
    return Result("nonsense", "loaded data from a special file", label)


def huge_values(rng: random.Random) -> list[list[str]]:
    """Settings (``section.key=value``, applied together) that are too large, too deep or overflow."""
    digits = "9" * rng.choice([4301, 5000, 100_000])
    depth = rng.choice([500, 1000, 3000])
    return [
        [f"local.lr={digits}"],
        [f"local.lr={'[' * depth}"],
        [f"local.lr={'[' * depth}1{']' * depth}"],
        [f"run.rounds={digits}"],
        [f"run.seed={digits}"],
        [f"local.prox_mu={rng.choice(['1e308', '1e300', '1e30'])}"],
        [f'data.path="{"a" * rng.choice([256, 300, 5000])}"'],
        ["aggregation.weighting=[1e308, 1e308]", 'aggregation.normalization="sum_one"'],
        [f'local.lr="{"x" * 200_000}"'],
        ['plot.metric="test_accuracy"'],
        [f"local.epochs={digits}"],
        ['data.source="fedprox_synthetic"', f"data.clients={rng.choice([10**9, 10**6])}", 'data.partition="sizes"'],
    ]


def _with_settings(config: str, settings: list[str]) -> str:
    """``config`` (TOML) with ``section.key = value`` settings written into its sections."""
    for setting in settings:
        key, value = setting.split("=", 1)
        section, name = key.split(".")
        lines = config.splitlines()
        header = lines.index(f"[{section}]") if f"[{section}]" in lines else None
        lines = [line for line in lines if not (header is not None and line.startswith(f"{name} ="))]
        if header is None:
            lines = [f"[{section}]", f"{name} = {value}", *lines]
        else:
            lines.insert(lines.index(f"[{section}]") + 1, f"{name} = {value}")
        config = "\n".join(lines) + "\n"
    return config


def run_values_case(seed: int, work: Path) -> Result:
    """A huge or deeply nested value through ``--set``, ``--grid``, a config file, ``--workers``, ``--seeds`` or
    ``inspect``: exit 2 with one line, never a traceback, never a run."""
    rng = random.Random(f"values:{seed}")
    (work / "c.toml").write_text(SMALL_CONFIG)
    settings = rng.choice(huge_values(rng))
    how = rng.choice(["set", "set", "grid", "file", "workers", "seeds", "inspect"])
    run = ["run", str(work / "c.toml"), "--quiet", "--out", str(work / "out")]
    if how == "set":
        argv = [*run, *(a for s in settings for a in ("--set", s))]
    elif how == "grid":
        key, value = settings[0].split("=", 1)
        argv = [
            "sweep",
            str(work / "c.toml"),
            "--grid",
            f"{key}=0.1,{value}",
            *(a for s in settings[1:] for a in ("--set", s)),
            "--workers",
            "1",
            "--quiet",
            "--out",
            str(work / "out"),
        ]
    elif how == "file":
        (work / "c.toml").write_text(_with_settings(SMALL_CONFIG, settings))
        argv = run
    elif how == "workers":
        argv = [*run, "--workers", rng.choice(["9999999999999999999999", "-" + "9" * 30, "100000", "0"])]
    elif how == "seeds":
        argv = [*run, "--seeds", rng.choice(["9" * 4301, "0.." + "9" * 40, "0,1,2" + ",1" * 100])]
    else:
        argv = [
            "inspect",
            *rng.choice(
                [
                    ["--sizes", "1000000000,1"],
                    ["--sizes", "100000000,1"],
                    ["--lr", "1e308"],
                    [
                        "--sizes",
                        "1000,1000,1000",
                        "--sampler",
                        "uniform",
                        "--cohort",
                        "1",
                        "--monte-carlo",
                        "--samples",
                        "100000000",
                    ],
                ]
            ),
        ]
    case = f"{how}: {' '.join(argv).replace(str(work), 'W')[:160]}"
    try:
        with wall_limit(INPUT_CASE_SECONDS):
            result, _ = invoke(argv, work)
    except Hang as exc:
        return Result("hang", str(exc), case)
    result.case = case
    if result.outcome == "ran":
        return Result("nonsense", "exit 0 with a value that cannot be used", case)
    return result


def run_input_case(kind: str, seed: int, work: Path) -> Result:
    """One case of the inputs-from-outside kinds (:data:`INPUT_KINDS`)."""
    runner = {
        "downloads": run_download_case,
        "bombs": run_bomb_case,
        "special": run_special_case,
        "values": run_values_case,
    }[kind]
    return runner(seed, work)
