"""Operator threads on a busy machine: a one-seed run of a preset with the default settings against the same run
at one operator thread, while other processes keep every core busy — for two source trees (e.g. before and
after the per-problem thread policy of ``run``).

    FEDSHUFFLE_DATA=../shared/data python -m benchmarks.threads --tree before=../before/src --tree after=src \\
        [--preset rrcli-phishing-tuned] [--rounds 400] [--repeats 2]

Each run is ``fedshuffle run PRESET --seeds 0`` in a fresh process, its wall and CPU seconds measured; the cases
(every tree at its default threads, then this tree with ``OMP_NUM_THREADS=1``) alternate in order from repeat to
repeat. ``--busy N`` busy processes (spinning Python loops, default one per core) run the whole time and are stopped
at the end. Goal: the default within 1.2× of one thread. ``--smoke``: 2 rounds of a tiny config, once, one busy
process for its first 2 seconds, printed, nothing written (the test of this benchmark).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write
from benchmarks.profile_shares import SMOKE

ROOT = Path(__file__).resolve().parents[1]
#: a busy process, bounded in time, that also stops when the benchmark that started it is gone (killed or not)
SPIN = (
    "import os, time\nparent = os.getppid()\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end and "
    "os.getppid() == parent:\n    pass\n"
)


def timed_run(src: Path, preset: str, rounds: int | None, threads: int | None, timeout: float) -> dict[str, Any]:
    """Wall and CPU seconds (of the child) of one ``fedshuffle run``."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    if threads:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as folder:
        if preset == "smoke":
            config = Path(folder) / "smoke.toml"
            config.write_text(SMOKE)
            preset = str(config)
        cmd = [
            sys.executable,
            "-m",
            "fedshuffle",
            "run",
            preset,
            "--seeds",
            "0",
            "--out",
            str(Path(folder) / "out"),
            "--quiet",
            *(["--set", f"run.rounds={rounds}"] if rounds else []),
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    chosen = [line for line in out.stdout.splitlines() if line.startswith("operator threads per run:")]
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), **({"chosen": chosen[0]} if chosen else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="LABEL=SRC (default: this tree as 'this')")
    parser.add_argument("--preset", default="rrcli-phishing-tuned")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--busy",
        type=int,
        default=os.cpu_count() or 1,
        help="busy processes started (default: one per core; 0 where the machine is busy already)",
    )
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    trees = [(label, Path(src).resolve()) for label, src in (t.split("=", 1) for t in args.tree)] or [
        ("this", ROOT / "src")
    ]
    preset, rounds, repeats = ("smoke", 2, 1) if args.smoke else (args.preset, args.rounds, args.repeats)
    this = next((src for _, src in trees if src == (ROOT / "src").resolve()), trees[-1][1])
    cases = [(f"{label} default threads", src, None) for label, src in trees] + [("one thread", this, 1)]
    spinners = []
    try:
        # keep the cores busy for the whole benchmark (bounded in time); the smoke case's one busy process spins for
        # its first seconds only, so that the test does not hold a core for the whole case
        for _ in range(1 if args.smoke else args.busy):
            spinners.append(
                subprocess.Popen(
                    [sys.executable, "-c", SPIN.format(seconds=2 if args.smoke else args.timeout * 4 * repeats)],
                    start_new_session=True,
                )
            )
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cases}
        for r in range(repeats):
            for name, src, threads in cases if r % 2 == 0 else cases[::-1]:
                runs[name].append(timed_run(src, preset, rounds, threads, args.timeout))
    finally:
        for spinner in spinners:
            with contextlib.suppress(ProcessLookupError):  # ended already (its time was up)
                os.killpg(spinner.pid, signal.SIGKILL)
            spinner.wait()
    summary = {}
    for name, results in runs.items():
        good = [x for x in results if "error" not in x]
        summary[name] = (
            {
                "wall_s": statistics.median(x["wall_s"] for x in good),
                "cpu_s": statistics.median(x["cpu_s"] for x in good),
                "runs": [x for x in results],
            }
            if good
            else {"error": results[-1]["error"]}
        )
    one = summary["one thread"].get("wall_s")
    ratios = {name: round(s["wall_s"] / one, 2) for name, s in summary.items() if "wall_s" in s and one}
    payload = {
        "setup": {
            "preset": preset,
            "seed": 0,
            "rounds": rounds or "preset's own",
            "busy_processes": len(spinners),
            "repeats": repeats,
            "load_average_at_end": os.getloadavg(),
            "trees": {label: str(src) for label, src in trees},
        },
        "cases": summary,
        "wall_over_one_thread": ratios,
        "goal": "default settings within 1.2x of one operator thread",
    }
    if args.smoke:
        print(json.dumps(payload))
        return
    print(write("threads", payload).read_text())


if __name__ == "__main__":
    main()
