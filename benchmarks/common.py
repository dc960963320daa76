"""Shared helpers of the benchmarks: timing, peak memory, machine description, JSON output.

Each benchmark case runs in its own process (``python -m benchmarks.<name> --case ...``) so that
its peak resident memory is its own; the driver runs the cases side by side and writes one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_rounds(
    step: Callable[[], Any], warmup: int, repeats: int, sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Median and spread of seconds per call of ``step`` after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    sync()
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        sync()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "min_s": min(times),
        "max_s": max(times),
        "cpu_median_s": statistics.median(cpu),
        "rounds": repeats,
        "warmup": warmup,
    }


def run_case(module: str, case: str, *args: str, timeout: float = 3600, python: str | None = None) -> dict[str, Any]:
    """Run one case in a fresh interpreter (``python``, default this one) and parse the JSON line it prints last."""
    cmd = [python or sys.executable, "-m", module, "--case", case, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parents[1])
    if out.returncode != 0:
        return {
            "case": case,
            "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}",
        }
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One case over interleaved runs: the median of the runs' median s/round, the largest peak RSS, every run's
    figures."""
    good = [r for r in runs if "median_s" in r]
    if not good:
        return runs[-1] if runs else {}
    out = {
        k: v for k, v in good[0].items() if k not in ("median_s", "mean_s", "min_s", "max_s", "peak_rss_mib", "wall_s")
    }
    if all("cpu_median_s" in r for r in good):
        out["cpu_median_s"] = statistics.median(r["cpu_median_s"] for r in good)
    out.update(
        median_s=statistics.median(r["median_s"] for r in good),
        peak_rss_mib=max(r["peak_rss_mib"] for r in good),
        runs_median_s=[round(r["median_s"], 3) for r in good],
        runs=len(good),
    )
    return out


def case_or_all(
    module: str, cases: Sequence[str], case: Callable[[str, int, int], None], warmup: int, repeats: int
) -> dict[str, Any] | None:
    """With ``--case NAME`` run that case here (and return None); otherwise run every case side by side."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=list(cases))
    args = parser.parse_args()
    if args.case:
        case(args.case, warmup, repeats)
        return None
    return {name: run_case(module, name) for name in cases}


def emit(result: dict[str, Any]) -> None:
    """Print a case's result as its last line, with its peak memory (plus that of the processes it started, if
    measured)."""
    result["peak_rss_mib"] = round(peak_rss_mib() + result.get("descendants_peak_rss_mib", 0.0), 1)
    print(json.dumps(result))


def write(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), "date": time.strftime("%Y-%m-%d"), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
