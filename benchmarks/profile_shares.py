"""Where a preset's time goes: the shares of writing results, evaluating the model and start-up, under cProfile,
for two source trees side by side (e.g. before and after a change).

    git worktree add --detach ../before <commit>
    FEDSHUFFLE_DATA=../shared/data python -m benchmarks.profile_shares --tree before=../before/src --tree after=src \\
        --preset rrcli-a3a-theory --preset yang-fig1-2nn-cpu=3 [--repeats 2] [--name profile_shares]

``--preset NAME[=ROUNDS]`` runs the preset with its first seed, every variant cut to ROUNDS rounds (default:
its own), as ``fedshuffle run`` in a fresh interpreter of each tree under cProfile; trees alternate in order
from repeat to repeat. A category's seconds are those spent inside its functions (:data:`CATEGORIES`), counted
once where they call each other; shares are of the whole profiled command (imports included).
``--smoke`` runs one tiny built-in config once per tree, in seconds (the test of this benchmark).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write

ROOT = Path(__file__).resolve().parents[1]

#: category → (path suffix, function name) of its entry points, in any tree (old names kept so both trees are measured
#: alike)
CATEGORIES: dict[str, tuple[tuple[str, str], ...]] = {
    "writes": (
        ("experiments/runner.py", "save_tables"),
        ("experiments/runner.py", "save_checkpoint"),
        ("experiments/results.py", "write_metrics"),
        ("experiments/results.py", "write_parquet"),
        ("experiments/results.py", "append"),
        ("experiments/results.py", "sync"),
        ("experiments/results.py", "__init__"),
        ("core/checkpoint.py", "save_checkpoint"),
        ("core/io.py", "write_atomic"),
        ("core/io.py", "write_json"),
        ("experiments/folders.py", "sealed"),
    ),
    "evaluation": (("fedshuffle/metrics.py", "__call__"),),
    "x_star": (("fedshuffle/metrics.py", "__init__"),),
    "preflight": (("experiments/runner.py", "preflight"),),
}

SMOKE = """
[problem]
name = "logistic"
l2 = 0.01
[data]
source = "synthetic"
samples = 90
client_sizes = [30, 30, 30]
features = 5
[method]
name = "fedavg"
[local]
lr = 0.05
[run]
rounds = 3
eval_every = 1
"""


def _matches(func: tuple[str, int, str], entries: tuple[tuple[str, str], ...]) -> bool:
    path, _, name = func
    return any(path.replace(os.sep, "/").endswith(suffix) and name == fn for suffix, fn in entries)


def shares(stats: pstats.Stats) -> dict[str, Any]:
    """Seconds per category: each entry point's cumulative time from callers outside its category (no double
    counting)."""
    raw = stats.stats  # type: ignore[attr-defined]
    total = stats.total_tt  # type: ignore[attr-defined]
    out: dict[str, Any] = {"total_s": round(total, 3)}
    for category, entries in CATEGORIES.items():
        inside = {f for f in raw if _matches(f, entries)}
        seconds = 0.0
        for func in inside:
            _, _, _, cumulative, callers = raw[func]
            outer = [timing[3] for caller, timing in callers.items() if caller not in inside]
            seconds += sum(outer) if callers else cumulative
        out[f"{category}_s"] = round(seconds, 3)
        out[f"{category}_share"] = round(seconds / total, 3) if total else None
    return out


def profile_case(preset: str, rounds: int | None, seed: int) -> dict[str, Any]:
    """Profile ``fedshuffle run`` of one preset in this interpreter (this tree's fedshuffle)."""
    from fedshuffle.cli import app

    with tempfile.TemporaryDirectory(prefix="bench-profile-") as folder:
        args = ["run", preset, "--seeds", str(seed), "--out", str(Path(folder) / "out"), "--quiet"]
        if preset == "smoke":
            config = Path(folder) / "smoke.toml"
            config.write_text(SMOKE)
            args[1] = str(config)
        if rounds:
            args += ["--set", f"run.rounds={rounds}"]
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        try:
            app(args, standalone_mode=False)
        finally:
            profiler.disable()
        wall = time.perf_counter() - start
        if not (Path(folder) / "out" / "summary.json").exists():
            raise SystemExit(f"{preset}: the run did not finish")
    return {"wall_s": round(wall, 3), **shares(pstats.Stats(profiler))}


def run_tree(
    src: Path, preset: str, rounds: int | None, seed: int, timeout: float, threads: int | None
) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT}", "PYTHONHASHSEED": "0"}
    if threads:  # PyTorch's operator threads in both trees alike (a tree may choose fewer for its runs)
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.profile_shares",
        "--case",
        preset,
        "--seed",
        str(seed),
        *(["--rounds", str(rounds)] if rounds else []),
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[-1]
    return {key: round(statistics.median(r[key] for r in good), 3) for key in good[0]} | {"runs": len(good)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", help="(internal) profile this preset here")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree", action="append", default=[], help="LABEL=SRC (default: this tree as 'this')")
    parser.add_argument("--preset", action="append", default=[], help="NAME or NAME=ROUNDS")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--threads", type=int, help="operator threads of every run (OMP_NUM_THREADS); default: PyTorch's"
    )
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--name", default="profile_shares", help="results file benchmarks/results/NAME.json")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny built-in config, once per tree; prints the result, writes nothing"
    )
    args = parser.parse_args()
    if args.case:
        print(json.dumps(profile_case(args.case, args.rounds, args.seed)))
        return
    trees = [(label, Path(src).resolve()) for label, src in (t.split("=", 1) for t in args.tree)] or [
        ("this", ROOT / "src")
    ]
    presets = (
        [("smoke", None)]
        if args.smoke
        else [(p.split("=")[0], int(p.split("=")[1]) if "=" in p else None) for p in args.preset]
    )
    results: dict[str, Any] = {}
    for k, (preset, rounds) in enumerate(presets):
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in trees}
        for r in range(1 if args.smoke else args.repeats):
            order = trees if (k + r) % 2 == 0 else trees[::-1]
            for label, src in order:
                runs[label].append(run_tree(src, preset, rounds, args.seed, args.timeout, args.threads))
        results[preset] = {
            "rounds": rounds or "preset's own",
            "seed": args.seed,
            "threads": args.threads or "default",
            **{label: _median(rs) for label, rs in runs.items()},
            "each_run": runs,
        }
        print(json.dumps({preset: {label: _median(rs) for label, rs in runs.items()}}), flush=True)
        if not args.smoke:  # after every preset, so that a later one failing keeps these
            path = write(args.name, {"trees": {label: str(src) for label, src in trees}, "presets": results})
    if not args.smoke:
        print(path)


if __name__ == "__main__":
    main()
