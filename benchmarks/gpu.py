"""What a GPU machine should measure in its first minutes: one command, within ``--budget`` seconds (default 480).

    pip install -e '.[test-all]' -r benchmarks/requirements.txt   # PyTorch with CUDA; pfl-research for its case
    FEDSHUFFLE_DATA=../shared/data python -m benchmarks.gpu        # writes benchmarks/results/gpu.json

1. **Agreement**: ``tests/test_cuda.py`` (CPU ↔ GPU: float64 convex preset to 1e-10, float32 CNN to 1e-3, every
   problem and a stateful method on CUDA), with pytest, its counts and failures recorded.
2. **CNN harness** (``benchmarks/cross_device_cnn.py``'s setup: 1,000 users × 50 CIFAR-shaped images, cohort 50, one
   epoch of batch 10): fedshuffle ``auto`` on the GPU against pfl-research's simulated backend on the same GPU,
   seconds per round (median after a warm-up round) and peak GPU memory, each case in its own process.
3. **Presets**: every ``gpu`` preset's first variant at paper scale on the GPU (the real files where they are on
   the machine, nothing downloaded; else random samples of the source's real shapes and sizes), one warm-up round
   and up to two timed rounds and one timed evaluation, then each preset's projected minutes:
   variants × seeds × (rounds × s/round + evaluations × s/evaluation), tuning runs likewise, stated apart.
4. One JSON under ``benchmarks/results/`` (``--name``), written after every step so that a cut-off run keeps
   what it measured.

``--smoke``: the same steps on this machine's device (the CPU here: the agreement tests skip), the CNN harness at a
cohort of 2 (one timed round) and two presets (:data:`SMOKE_PRESETS`) at smoke scale
(:mod:`fedshuffle.experiments.smoke`, one timed round each); prints the JSON, writes nothing. The test suite runs it,
so the script cannot rot before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import machine, write

ROOT = Path(__file__).resolve().parents[1]
#: the seconds each step may take at most on a GPU (of the default 480): tests, CNN cases, presets
STEP_SECONDS = {"tests": 150, "cnn": 150, "presets": 180}
#: timed rounds of a preset after its warm-up round (fewer when a round takes longer than its share of the budget);
#: ``--smoke`` times one
PRESET_ROUNDS, SMOKE_PRESET_ROUNDS = 2, 1
#: the presets ``--smoke`` times: a closed-form network on real files (cut), a module on random samples of
#: CIFAR's shapes
SMOKE_PRESETS = ["yang-fig3-2nn", "nastya-fig2-lenet-cifar10"]


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gpu_mib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None


# -- 1. agreement -------------------------------------------------------------------------------------


def agreement(timeout: float) -> dict[str, Any]:
    """``tests/test_cuda.py`` under pytest: passed, failed and skipped counts, the failures' names, the skip reasons."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), str(ROOT)])}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n",
        "0",
        "-rs",
        "-p",
        "no:cacheprovider",
        str(ROOT / "tests" / "test_cuda.py"),
    ]
    start = time.perf_counter()
    try:
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    text = out.stdout + out.stderr
    counts = {
        kind: int(n)
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", text.splitlines()[-1] if text.strip() else "")
    }
    return {
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("error", 0),
        "skipped": counts.get("skipped", 0),
        "failures": re.findall(r"^FAILED (\S+)", text, flags=re.M),
        "skip_reasons": sorted(set(re.findall(r"^SKIPPED \[\d+\] \S+ (.*)$", text, flags=re.M))),
        "seconds": round(time.perf_counter() - start, 1),
        "exit": out.returncode,
    }


# -- 2. the CNN harness -------------------------------------------------------------------------------


def cnn_fedshuffle(cohort: int, rounds: int) -> dict[str, Any]:
    """fedshuffle ``auto`` on the harness, on this machine's device."""
    from benchmarks.cross_device_cnn import BATCH, CLASSES, LR, SHAPE, USERS, lazy_data
    from fedshuffle import Simulation, UniformWithoutReplacement, build_algorithm
    from fedshuffle.executors import make_executor
    from fedshuffle.problems import CNN

    alg = build_algorithm("fedavg_rr", {"local": {"lr": LR, "epochs": 1, "batch_size": BATCH}, "server": {"lr": 1.0}})
    problem, data = CNN(SHAPE, CLASSES, dropout=False), lazy_data()
    executor = make_executor("auto", problem, device())
    sim = Simulation(
        problem,
        data,
        alg,
        UniformWithoutReplacement(USERS, cohort),
        seed=0,
        dtype=torch.float32,
        executor=executor,
        device=device(),
    )
    sim.step()  # warm-up
    _sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        sim.step()
        _sync()
        times.append(time.perf_counter() - start)
    return {
        "median_s": float(np.median(times)),
        "rounds": rounds,
        "executor": executor.chosen or executor.name,
        "peak_gpu_mib": _peak_gpu_mib(),
    }


def cnn_pfl(cohort: int, rounds: int) -> dict[str, Any]:
    """pfl-research's simulated backend on the harness (it runs on the GPU when PyTorch sees one)."""
    import benchmarks.frameworks as frameworks

    frameworks.COHORT = cohort  # the harness' cohort, as the fedshuffle case takes it
    timed = frameworks.pfl_round_seconds(1, rounds)
    return {"median_s": timed["median_s"], "rounds": timed["rounds"], "peak_gpu_mib": _peak_gpu_mib()}


CNN_CASES = {"fedshuffle-auto": cnn_fedshuffle, "pfl": cnn_pfl}


def cnn_cases(cohort: int, rounds: int, timeout: float) -> dict[str, Any]:
    """Each CNN case in its own process (its peak memory its own); pfl-research only where it is installed."""
    out: dict[str, Any] = {}
    for name in CNN_CASES:
        if name == "pfl" and not _importable("pfl"):
            out[name] = {"skipped": "pfl-research is not installed (pip install -r benchmarks/requirements.txt)"}
            continue
        out[name] = _subprocess_case(["--cnn", name, "--cohort", str(cohort), "--rounds", str(rounds)], timeout)
    fedshuffle, pfl = out["fedshuffle-auto"], out.get("pfl", {})
    if "median_s" in fedshuffle and "median_s" in pfl:
        out["auto_over_pfl_seconds"] = round(fedshuffle["median_s"] / pfl["median_s"], 3)
        if fedshuffle.get("peak_gpu_mib") and pfl.get("peak_gpu_mib"):
            out["auto_over_pfl_peak_gpu_memory"] = round(fedshuffle["peak_gpu_mib"] / pfl["peak_gpu_mib"], 3)
    return out


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _subprocess_case(args: list[str], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- 3. the presets -----------------------------------------------------------------------------------


def paper_scale_samples(source: str, settings: dict[str, Any]) -> tuple[Any, str]:
    """The source's real samples where its files are on this machine (nothing downloaded), else random samples of its
    real shapes and sizes (:data:`fedshuffle.experiments.smoke.SHAPES`)."""
    from fedshuffle.core.errors import ConfigError, DataError
    from fedshuffle.core.registry import call_with
    from fedshuffle.data.catalog import SOURCES, Samples
    from fedshuffle.experiments.smoke import SHAPES

    try:
        return call_with(SOURCES[source].factory, **{**settings, "download": False}), f"real {source} files"
    except (DataError, ConfigError, OSError):
        pass
    shape, rng = SHAPES[source], np.random.default_rng(0)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        if shape.tokens:
            x = rng.integers(1, shape.classes, size=(n, *shape.sample), dtype=np.int64)
            return x, np.roll(x, -1, axis=1)
        return rng.random((n, *shape.sample), dtype=np.float32), np.arange(n, dtype=np.int64) % shape.classes

    x, y = draw(shape.train)
    sizes = None
    if shape.own_clients:
        clients = int(settings.get("clients") or (500 if source == "tff_cifar100" else 715))
        sizes = np.diff(np.linspace(0, shape.train, clients + 1).astype(np.int64))
    groups = np.arange(shape.classes) % shape.coarse_groups if shape.coarse_groups else None
    return Samples(
        x, y, shape.classes, draw(shape.test), sizes, groups
    ), f"random samples of {source}'s shapes and sizes"


def time_preset(name: str, smoke: bool, budget: float) -> dict[str, Any]:
    """The preset's first variant on this machine's device: seconds per round and per evaluation, and the projection."""
    from fedshuffle import metrics
    from fedshuffle.experiments.runner import build_simulation
    from fedshuffle.experiments.schema import load_experiment
    from fedshuffle.experiments.smoke import _constant, _sources_replaced, smoke_samples, smoke_spec

    experiment = load_experiment(name)
    runs = experiment.runs({})
    label, spec = runs[0]
    wanted = SMOKE_PRESET_ROUNDS if smoke else PRESET_ROUNDS
    if smoke:
        spec = smoke_spec(spec, rounds=1 + wanted)
        samples, origin = smoke_samples(spec.data.source, spec.data.model_dump())
    else:
        spec = spec.model_copy(
            update={
                "run": spec.run.model_copy(
                    update={"device": device(), "executor": "auto", "checkpoint_every": 0, "sinks": []}
                )
            }
        )
        samples, origin = paper_scale_samples(spec.data.source, spec.data.model_dump())
    with _sources_replaced({spec.data.source: _constant(samples)}):
        sim, _ = build_simulation(spec, experiment.seeds(spec)[0])
    evaluate = metrics.ModelScores(sim.problem, sim.data, gradient=spec.run.grad_norm)
    started = time.perf_counter()
    sim.step()  # warm-up
    _sync()
    first = time.perf_counter() - started
    times = []
    while len(times) < wanted and time.perf_counter() - started + first < budget:
        start = time.perf_counter()
        sim.step()
        _sync()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    evaluate(sim.params)
    _sync()
    evaluation = time.perf_counter() - start
    round_s = float(np.median(times)) if times else first
    full = [s for _, s in load_experiment(name).runs({})]
    judged = sum(
        len(experiment.seeds(s)) * (s.run.rounds * round_s + (s.run.rounds // s.run.eval_every + 1) * evaluation)
        for s in full
    )
    tuning = sum(
        len(v.tune.seeds)
        * int(np.prod([len(values) for values in v.tune.grid.values()]))
        * (v.tune.rounds or s.run.rounds)
        * round_s
        for v, s in zip(experiment.variants, full)
        if v.tune is not None
    )
    return {
        "variant": label,
        "data": origin,
        "device": str(sim.params.device),
        "executor": getattr(sim.executor, "chosen", None) or sim.executor.name,
        "warmup_round_s": round(first, 3),
        "round_s": round(round_s, 4),
        "timed_rounds": len(times),
        "evaluation_s": round(evaluation, 4),
        "projected_minutes": round(judged / 60, 2),
        "projected_tuning_minutes": round(tuning / 60, 2),
        "peak_gpu_mib": _peak_gpu_mib(),
        "scale": "smoke" if smoke else "paper",
    }


def gpu_presets() -> list[str]:
    from fedshuffle.experiments.schema import load_experiment, preset_names

    return [n for n in preset_names() if load_experiment(n).experiment.budget == "gpu"]


def presets(smoke: bool, budget: float, only: list[str] | None = None) -> dict[str, Any]:
    """Every ``gpu`` preset timed in turn, each within its share of ``budget`` (a failure is recorded, not raised)."""
    names = only or gpu_presets()
    out: dict[str, Any] = {}
    deadline = time.perf_counter() + budget
    for k, name in enumerate(names):
        left = deadline - time.perf_counter()
        if left <= 0:
            out[name] = {"skipped": "the step's time ran out"}
            continue
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            out[name] = time_preset(name, smoke, left / (len(names) - k))
        except Exception as exc:  # noqa: BLE001 — whatever stops a preset is the finding
            out[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return out


# -- the command --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every step at a tiny scale on this machine's device; prints the JSON, writes nothing",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="seconds for the whole command (shared by the steps as STEP_SECONDS)",
    )
    parser.add_argument("--name", default="gpu", help="results file benchmarks/results/NAME.json")
    parser.add_argument("--preset", action="append", help="time only these presets (default: every gpu preset)")
    parser.add_argument("--cnn", choices=list(CNN_CASES), help="(internal) run this CNN case here")
    parser.add_argument("--cohort", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.cnn:
        print(json.dumps(CNN_CASES[args.cnn](args.cohort, args.rounds)))
        return
    scale = args.budget / sum(STEP_SECONDS.values())
    result: dict[str, Any] = {
        "device": device(),
        "machine": machine() if args.smoke else None,
        "budget_s": args.budget,
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }
    started = time.perf_counter()

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - started, 1)
        if not args.smoke:
            write(args.name, {k: v for k, v in result.items() if k != "machine"})

    result["agreement"] = agreement(STEP_SECONDS["tests"] * scale if not args.smoke else 300)
    save()
    result["cnn"] = cnn_cases(
        2 if args.smoke else 50,
        1 if args.smoke else args.rounds,
        STEP_SECONDS["cnn"] * scale if not args.smoke else 300,
    )
    save()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as folder:
        if args.smoke:  # nothing of the smoke run left in the user's cache
            os.environ.setdefault("FEDSHUFFLE_CACHE", str(Path(folder) / "cache"))
        result["presets"] = presets(
            args.smoke,
            STEP_SECONDS["presets"] * scale if not args.smoke else 600,
            args.preset or (SMOKE_PRESETS if args.smoke else None),
        )
    save()
    if args.smoke:
        print(json.dumps(result))
    else:
        print(ROOT / "benchmarks" / "results" / f"{args.name}.json")


if __name__ == "__main__":
    main()
