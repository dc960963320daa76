"""A sweep's cost: a grid of G step sizes × S seeds as one batched simulation of G·S replicas, against one run of the
same preset and against the G·S runs made separately (``FEDSHUFFLE_REPLICAS=0``: parallel worker processes, one per
core, as ``sweep`` runs runs that are not replicas).

    FEDSHUFFLE_DATA=../shared/data nice -n 10 python -m benchmarks.sweep [--repeats 1] [--mnist-rounds 3] [--only
    rrcli|2nn]

Two cases, interleaved (one command of each case in turn, the order reversed from repeat to repeat):

* RR-CLI: ``rrcli-a3a-theory``'s RR-CLI variant, ``local.lr_multiplier`` ∈ 1..7 × seeds 0..4, its full 400 rounds, with
  ``run.executor = "auto"`` (the compiled convex loop; the preset's default, sequential, runs every member as its
  own loop, which replicas cannot batch without changing the numbers). Goal: the batched sweep ≤ 3× one run.
* 2NN MNIST: ``yang-fig1-2nn-cpu``'s digits_2 variant cut to ``--mnist-rounds`` rounds, ``local.lr`` ∈ 7 values ×
  seeds 0..4. Goal: the batched sweep ≤ 0.5× the 35 separate runs.

Every command is ``python -m fedshuffle sweep ...`` in a fresh process (start-up, data and writing included), its wall
seconds measured. (Not its CPU seconds: the workers fork from the command's fork server, which reaps them, and the
command leaves the fork server to end with it unreaped, so no process' resource usage holds the workers'.)
``--smoke``: a tiny synthetic config, 2 step sizes × 2 seeds, once each, printed, nothing written
(the test of this benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write

ROOT = Path(__file__).resolve().parents[1]

SMOKE = """
[problem]
name = "logistic"
l2 = 0.01
[data]
source = "synthetic"
samples = 120
features = 5
partition = "equal"
clients = 6
seed = 0
[method]
name = "fedshuffle"
[local]
lr = 0.05
batch_size = 5
[sampler]
name = "uniform"
cohort = 2
[run]
rounds = 2
eval_every = 1
executor = "vectorized"
"""

MULTIPLIERS = "1,2,3,4,5,6,7"
MNIST_LRS = "0.01,0.02,0.05,0.1,0.2,0.3,0.5"


def cases(smoke: bool, mnist_rounds: int) -> dict[str, dict[str, Any]]:
    """name → the sweep's arguments (after the config) and whether its runs are batched."""
    if smoke:
        grid = ["--grid", "local.lr=0.02,0.05", "--seeds", "0,1"]
        return {
            "smoke: one run": {"config": "smoke", "args": ["--seeds", "0"], "batched": True},
            "smoke: 4 runs, separate": {"config": "smoke", "args": grid, "batched": False},
            "smoke: 4 runs, batched": {"config": "smoke", "args": grid, "batched": True},
        }
    rrcli = ["--variant", "RR-CLI", "--set", "run.executor=auto"]
    rrcli_grid = [*rrcli, "--grid", f"local.lr_multiplier={MULTIPLIERS}", "--seeds", "0..4"]
    mnist_grid = [
        "--variant",
        "digits_2",
        "--set",
        f"run.rounds={mnist_rounds}",
        "--grid",
        f"local.lr={MNIST_LRS}",
        "--seeds",
        "0..4",
    ]
    return {
        "rrcli: one run": {"config": "rrcli-a3a-theory", "args": [*rrcli, "--seeds", "0"], "batched": True},
        "2nn: 35 runs, separate": {"config": "yang-fig1-2nn-cpu", "args": mnist_grid, "batched": False},
        "rrcli: 35 runs, batched": {"config": "rrcli-a3a-theory", "args": rrcli_grid, "batched": True},
        "2nn: 35 runs, batched": {"config": "yang-fig1-2nn-cpu", "args": mnist_grid, "batched": True},
        "rrcli: 35 runs, separate": {"config": "rrcli-a3a-theory", "args": rrcli_grid, "batched": False},
    }


def timed_sweep(config: str, args: list[str], batched: bool, timeout: float) -> dict[str, Any]:
    """Wall seconds of one ``fedshuffle sweep``, and the note it printed on batching."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONHASHSEED": "0"}
    if not batched:
        env["FEDSHUFFLE_REPLICAS"] = "0"
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as folder:
        if config == "smoke":
            path = Path(folder) / "smoke.toml"
            path.write_text(SMOKE)
            config = str(path)
        cmd = [
            sys.executable,
            "-m",
            "fedshuffle",
            "sweep",
            config,
            *args,
            "--out",
            str(Path(folder) / "out"),
            "--quiet",
        ]
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        wall = time.perf_counter() - start
        runs = len(list((Path(folder) / "out").rglob("seed-*/metrics.csv")))
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    note = next((line.strip() for line in out.stderr.splitlines() if "batched simulation" in line), None)
    return {"wall_s": round(wall, 2), "runs": runs, "note": note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--mnist-rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--only", choices=("rrcli", "2nn"), help="only this case (written to sweep_<case>.json)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    chosen = {
        name: case
        for name, case in cases(args.smoke, args.mnist_rounds).items()
        if not args.only or name.startswith(args.only)
    }
    order = list(chosen)
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in order}
    for r in range(1 if args.smoke else args.repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            case = chosen[name]
            measured[name].append(timed_sweep(case["config"], case["args"], case["batched"], args.timeout))
            print(name, measured[name][-1], file=sys.stderr, flush=True)
    summary = {}
    for name, results in measured.items():
        good = [x for x in results if "error" not in x]
        summary[name] = (
            {
                "wall_s": statistics.median(x["wall_s"] for x in good),
                "runs": good[0]["runs"],
                "note": good[0]["note"],
                "measured": results,
            }
            if good
            else {"error": results[-1]["error"]}
        )

    def ratio(a: str, b: str) -> float | None:  # of the cases measured
        return (
            round(summary[a]["wall_s"] / summary[b]["wall_s"], 2)
            if "wall_s" in summary.get(a, {}) and "wall_s" in summary.get(b, {})
            else None
        )

    if args.smoke:
        ratios = {
            "batched over one run": ratio("smoke: 4 runs, batched", "smoke: one run"),
            "batched over separate": ratio("smoke: 4 runs, batched", "smoke: 4 runs, separate"),
        }
    else:
        ratios = {
            "rrcli: batched over one run (goal <= 3)": ratio("rrcli: 35 runs, batched", "rrcli: one run"),
            "rrcli: separate over one run": ratio("rrcli: 35 runs, separate", "rrcli: one run"),
            "2nn: batched over separate (goal <= 0.5)": ratio("2nn: 35 runs, batched", "2nn: 35 runs, separate"),
        }
    payload = {
        "setup": {
            "repeats": args.repeats,
            "mnist_rounds": args.mnist_rounds,
            "rrcli_multipliers": MULTIPLIERS,
            "mnist_lrs": MNIST_LRS,
            "seeds": "0..4",
            "load_average_at_end": os.getloadavg(),
            "commands": {name: c["args"] for name, c in chosen.items()},
        },
        "cases": summary,
        "ratios": ratios,
    }
    if args.smoke:
        print(json.dumps(payload))
        return
    print(write(f"sweep_{args.only}" if args.only else "sweep", payload).read_text())


if __name__ == "__main__":
    main()
