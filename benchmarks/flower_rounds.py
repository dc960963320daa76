"""Seconds per round of one fedshuffle run, four ways: ``fedshuffle run``, Flower's simulation runtime, and a real
SuperLink with two SuperNodes on 127.0.0.1, first with a ClientApp process per message (Flower's default
``--isolation subprocess``), then with one long-lived ClientApp process per node (``--isolation process`` and
``python -m fedshuffle.integrations.flower.worker``: the node's runtime is built once per run)::

    python -m benchmarks.flower_rounds            # every case, results/flower_rounds.json
    # seconds: fedshuffle run only, 3 rounds (2 timed); prints the JSON, writes nothing
    python -m benchmarks.flower_rounds --smoke

Every case runs the same experiment (FedShuffle, logistic regression, 4 clients of unequal sizes, full participation:
each node hosts two clients and answers two messages a round) and writes the same results folder; a round's seconds
are the differences of ``timing.csv``'s wall-clock column (the round and the model's central evaluation, as ``fedshuffle
run`` records them), the first round (the nodes' first build, Ray's start) left out. The SuperLink cases use the test
helpers of ``tests/flower_harness.py`` (own process groups, every process stopped at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import emit, run_case, write

ROOT = Path(__file__).resolve().parents[1]
CASES = ("fedshuffle-run", "flower-simulation", "superlink-per-message", "superlink-persistent")
#: seconds a SuperLink case may take (SuperLink start to results)
DEADLINE = 600.0


def experiment(rounds: int):
    from fedshuffle.experiments.schema import Experiment, validate

    return validate(
        Experiment,
        {
            "experiment": {"name": "flower-rounds", "seeds": [7]},
            "problem": {"name": "logistic", "l2": 0.05},
            "data": {
                "source": "synthetic",
                "samples": 48,
                "features": 3,
                "clients": 4,
                "partition": "dirichlet",
                "alpha": 0.8,
            },
            "local": {"lr": 0.2, "batch_size": 3},
            "sampler": {"name": "full"},
            "run": {"rounds": rounds, "eval_every": 1},
            "variants": [{"label": "fedshuffle", "method": {"name": "fedshuffle"}}],
        },
    )


def round_seconds(folder: Path) -> list[float]:
    """Seconds of each round after the first, from the run folder's ``timing.csv`` (cumulative wall-clock seconds)."""
    lines = (folder / "timing.csv").read_text().splitlines()
    column = lines[0].split(",").index("wallclock_seconds")
    stamps = [float(line.split(",")[column]) for line in lines[1:]]
    return np.diff(stamps)[1:].tolist()


def superlink(exp, out: Path, work: Path, persistent: bool) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from flower_harness import local_federation, run_app

    from fedshuffle.integrations.flower.bundle import write_app

    config = work / "exp.json"
    config.write_text(exp.model_dump_json())
    app = write_app(config, work / "app")
    deadline = time.monotonic() + DEADLINE
    summary = out / "fedshuffle" / "seed-7" / "summary.json"
    nodes = ['clients="0-1"', 'clients="2-3"']
    with local_federation(work / "federation", 2, deadline, nodes, persistent=persistent) as (
        connection,
        env,
        watch,
        _,
    ):
        status, _ = run_app(app, connection, env, f'out="{out}" round-timeout=600.0', summary.exists, deadline, watch)
    if status != "finished:completed":
        raise RuntimeError(f"the run ended {status!r}")


def case(name: str, rounds: int) -> None:
    exp = experiment(rounds)
    with tempfile.TemporaryDirectory(prefix="flower-rounds-") as tmp:
        out, started = Path(tmp) / "out", time.monotonic()
        if name == "fedshuffle-run":
            from fedshuffle.experiments.session import run_experiment

            run_experiment(exp, out, show_progress=False)
        elif name == "flower-simulation":
            from fedshuffle.integrations.flower import simulate

            simulate(exp, 4, {"out": str(out), "round-timeout": 600.0}, cpus=2)
        else:
            superlink(exp, out, Path(tmp), persistent=name == "superlink-persistent")
        seconds = round_seconds(out / "fedshuffle" / "seed-7")
        emit(
            {
                "case": name,
                "median_s": statistics.median(seconds),
                "min_s": min(seconds),
                "max_s": max(seconds),
                "rounds": len(seconds),
                "warmup": 1,
                "wall_s": time.monotonic() - started,
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--smoke", action="store_true", help="fedshuffle run only, 3 rounds (2 timed): prints the JSON, writes nothing"
    )
    args = parser.parse_args()
    rounds = 3 if args.smoke else args.rounds
    if args.case:
        case(args.case, rounds)
        return
    names = CASES[:1] if args.smoke else CASES
    results = {
        name: run_case("benchmarks.flower_rounds", name, "--rounds", str(rounds), timeout=DEADLINE + 120)
        for name in names
    }
    payload = {
        "setup": {
            "experiment": "FedShuffle, logistic, 4 clients (synthetic, 48 samples, 3 features), full participation",
            "nodes": "2 SuperNodes hosting clients 0-1 and 2-3 (SuperLink cases); Flower's simulation: 4 virtual "
            "nodes, Ray on 127.0.0.1 with 2 CPUs",
            "rounds": rounds,
            "timed": "timing.csv wall-clock differences, rounds 2..R (the first left out)",
        },
        "cases": results,
        "persistent_speedup": (
            round(results["superlink-per-message"]["median_s"] / results["superlink-persistent"]["median_s"], 1)
            if all("median_s" in results.get(k, {}) for k in ("superlink-per-message", "superlink-persistent"))
            else None
        ),
        "load_average_at_end": os.getloadavg(),
    }
    if args.smoke:
        print(json.dumps(payload))
        return
    print(write("flower_rounds", payload).read_text())


if __name__ == "__main__":
    main()
