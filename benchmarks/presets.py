"""Wall time of the reproduction presets, two source trees side by side (e.g. before and after a change).

    git worktree add --detach ../before <commit>
    FEDSHUFFLE_DATA=../shared/data python -m benchmarks.presets --tree before=../before/src [--presets ...]

For every preset (default: every ``cpu`` preset of this tree) and each tree in turn (the order alternates
from preset to preset), the preset runs as that tree defines it (``fedshuffle show`` resolves its
variants, rounds and seeds there), with its first seed only and its rounds cut:

* t₁ = seconds of a run of 1 round (start-up, data, the first round and its evaluation);
* t₃ = seconds of 3 rounds gives a first per-round cost p̂ = (t₃ − t₁)/2, which sets R so that
  R·p̂ ≈ ``--target`` seconds;
* t = seconds of 1 + R rounds, R at least two evaluation intervals (``run.eval_every``) so that p holds
  its share of the evaluations; p = (t − t₁)/R is one round of every variant, start-up s = t₁ − p.

The full preset is then estimated as seeds × (s + p·r̄) − (seeds − 1)·i, r̄ the variants' mean rounds and i
the interpreter's start with its imports, which a run pays once for all its seeds; a preset whose 1 + R
reaches its rounds is run whole for one seed instead (``exact``, s + p·r̄ measured). Settings that differ between the
trees' preset files (claims and descriptions aside) are listed, so that a change of the preset is not
read as a change of speed. Each run is a fresh process (``python -m fedshuffle run``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, write

HERE = Path(__file__).resolve().parents[1] / "src"


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}


def resolved(src: Path, preset: str) -> dict[str, Any]:
    """The preset as ``src`` resolves it: ``{"experiment": ..., "runs": {label: config}}``."""
    out = subprocess.run(
        [sys.executable, "-m", "fedshuffle", "show", preset], capture_output=True, text=True, env=_env(src), check=True
    )
    return json.loads(out.stdout)


def timed_run(src: Path, preset: str, rounds: int, seed: int, timeout: float) -> float:
    """Seconds of ``fedshuffle run PRESET`` with every variant cut to ``rounds`` rounds, one seed, in a fresh folder."""
    with tempfile.TemporaryDirectory(prefix="bench-presets-") as folder:
        cmd = [
            sys.executable,
            "-m",
            "fedshuffle",
            "run",
            preset,
            "--set",
            f"run.rounds={rounds}",
            "--seeds",
            str(seed),
            "--out",
            folder,
            "--quiet",
        ]
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=_env(src), timeout=timeout)
        seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"{preset}: exit {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1]}")
    return seconds


def preset_file(src: Path, preset: str) -> dict[str, Any]:
    """The preset's TOML file in ``src``, parsed."""
    return tomllib.loads((src / "fedshuffle" / "presets" / f"{preset}.toml").read_text())


def preset_settings(src: Path, preset: str) -> dict[str, Any]:
    """The preset file's settings as written (its claims and description left out, its seeds kept)."""
    settings = preset_file(src, preset)
    settings.pop("claims", None)
    settings["experiment"] = {"seeds": settings.get("experiment", {}).get("seeds")}
    return settings


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Settings written differently in two preset files (a key only one of them sets counts)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(a.keys() | b.keys())
            for d in differences(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
        ]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


def process_start(src: Path) -> float:
    """Median seconds of a fresh interpreter importing what every run imports (paid once per command, not per seed)."""
    code = "import torch, matplotlib.pyplot, fedshuffle.cli"
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=_env(src), check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(src: Path, preset: str, target_s: float, timeout: float) -> dict[str, Any]:
    """One seed of the preset under ``src``, cut (see the module docstring): the figures :func:`estimate`
    extrapolates."""
    plan = resolved(src, preset)
    rounds = [int(config["run"]["rounds"]) for config in plan["runs"].values()]
    eval_every = max(int(config["run"].get("eval_every") or 1) for config in plan["runs"].values())
    seeds = plan["experiment"]["seeds"]
    full = max(rounds)
    base = {"variants": len(rounds), "rounds": full, "mean_rounds": statistics.fmean(rounds), "seeds": len(seeds)}
    t1 = timed_run(src, preset, 1, seeds[0], timeout)
    if full <= 3:
        return {**base, "exact": True, "one_seed_s": round(timed_run(src, preset, full, seeds[0], timeout), 2)}
    first = max((timed_run(src, preset, 3, seeds[0], timeout) - t1) / 2, 1e-3)
    extra = min(full - 1, max(2, 2 * eval_every, math.ceil(target_s / first)))
    t = timed_run(src, preset, 1 + extra, seeds[0], timeout)
    if 1 + extra >= full:
        return {**base, "exact": True, "one_seed_s": round(t, 2)}
    per_round = max((t - t1) / extra, 0.0)
    return {
        **base,
        "exact": False,
        "measured_rounds": 1 + extra,
        "startup_s": round(max(t1 - per_round, 0.0), 2),
        "round_s": round(per_round, 4),
    }


def estimate(entry: dict[str, Any], process_s: float) -> float:
    """Seconds of the whole preset: per seed its start-up and rounds, the interpreter's start paid once."""
    one_seed = (
        entry["one_seed_s"]
        if entry["exact"]
        else entry["startup_s"] + entry["round_s"] * entry.get("mean_rounds", entry["rounds"])
    )
    return round(entry["seeds"] * one_seed - (entry["seeds"] - 1) * process_s, 1)


def cpu_presets() -> list[str]:
    folder = HERE / "fedshuffle" / "presets"
    return sorted(
        p.stem for p in folder.glob("*.toml") if preset_file(HERE, p.stem).get("experiment", {}).get("budget") == "cpu"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=SRC",
        help="another source tree (its src folder); this one is 'current'",
    )
    parser.add_argument("--presets", nargs="*", help="default: every cpu preset of this tree")
    parser.add_argument(
        "--target", type=float, default=10.0, help="seconds of rounds measured per preset and tree (default 10)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed to one run")
    parser.add_argument("--output", default="presets", help="name of the JSON under benchmarks/results/")
    parser.add_argument(
        "--update", action="store_true", help="measure --presets again inside the existing JSON of --output"
    )
    args = parser.parse_args()
    trees = {"current": HERE}
    for item in args.tree:
        label, sep, src = item.partition("=")
        if not sep or not Path(src, "fedshuffle").is_dir():
            parser.error(f"--tree: expected LABEL=SRC with SRC holding the fedshuffle package, got {item!r}")
        trees[label] = Path(src).resolve()
    presets = args.presets or cpu_presets()
    labels = list(trees)
    results: dict[str, dict[str, Any]] = (
        json.loads((RESULTS / f"{args.output}.json").read_text())["presets"] if args.update else {}
    )
    process = {label: round(process_start(src), 2) for label, src in trees.items()}
    for k, preset in enumerate(presets):
        results[preset] = {}
        for label in labels if k % 2 == 0 else labels[::-1]:
            try:
                results[preset][label] = measure(trees[label], preset, args.target, args.timeout)
            except (
                RuntimeError,
                subprocess.CalledProcessError,
                subprocess.TimeoutExpired,
                json.JSONDecodeError,
                KeyError,
            ) as err:
                results[preset][label] = {"error": str(err).splitlines()[0] if str(err) else type(err).__name__}
            print(preset, label, results[preset][label], flush=True)
    if len(labels) == 2:
        for preset, entries in results.items():
            entries["settings_changed"] = differences(
                preset_settings(trees[labels[1]], preset), preset_settings(trees["current"], preset)
            )
    for entries in results.values():
        for label in labels:
            if "error" not in entries.get(label, {"error": None}):
                entries[label]["estimate_s"] = estimate(entries[label], process[label])
    payload = {
        "target_s": args.target,
        "trees": {k: str(v) for k, v in trees.items()},
        "process_start_s": process,
        "presets": results,
        **totals(results, labels),
    }
    print(json.dumps({k: v for k, v in payload.items() if k.startswith(("total", "presets_in", "current_over"))}))
    print(write(args.output, payload))


def totals(results: dict[str, dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Estimated totals per tree over the presets every tree ran, and over those whose settings did not change."""
    ran = [p for p in results if all("estimate_s" in results[p].get(label, {}) for label in labels)]
    same = [p for p in ran if not results[p].get("settings_changed")]
    out: dict[str, Any] = {"presets_in_total": len(ran), "presets_unchanged": len(same)}
    for name, chosen in (("total_estimate_s", ran), ("total_unchanged_estimate_s", same)):
        out[name] = {label: round(sum(results[p][label]["estimate_s"] for p in chosen), 1) for label in labels}
        if len(labels) == 2 and out[name][labels[1]]:
            out[name][f"current_over_{labels[1]}"] = round(out[name]["current"] / out[name][labels[1]], 3)
    return out


if __name__ == "__main__":
    main()
