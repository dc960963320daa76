"""Benchmark 4 — Ray: the convex setup of benchmark 1 on the Ray executor with one and two workers,
against the in-process vectorized executor (each worker runs the vectorized executor on its share).

    python -m benchmarks.ray_workers       # writes benchmarks/results/ray_workers.json
    # vectorized and one Ray worker, 2 timed rounds: prints the JSON, writes nothing
    python -m benchmarks.ray_workers --smoke
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import emit, run_case, time_rounds, write
from benchmarks.convex import CLIENTS, COHORT, problem_and_data
from fedshuffle import Simulation, UniformWithoutReplacement, build_algorithm
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.executors.ray import RayExecutor

CASES = ("vectorized", "ray-1", "ray-2")
SMOKE_CASES = ("vectorized", "ray-1")


def case(name: str, warmup: int, repeats: int) -> None:
    torch.set_num_threads(1)
    problem, data = problem_and_data()
    executor = VectorizedExecutor() if name == "vectorized" else RayExecutor(workers=int(name.split("-")[1]))
    alg = build_algorithm("fedshuffle", {"local": {"lr": 0.05, "epochs": 1, "batch_size": 1}})
    sim = Simulation(problem, data, alg, UniformWithoutReplacement(CLIENTS, COHORT), seed=0, executor=executor)
    emit({"case": name, **time_rounds(sim.step, warmup, repeats), "threads_per_worker": 1})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the vectorized executor and one Ray worker, 2 timed rounds; prints the JSON, writes nothing",
    )
    args = parser.parse_args()
    warmup, repeats = (1, 2) if args.smoke else (3, 30)
    if args.case:
        case(args.case, warmup, repeats)
        return
    results = {
        name: run_case("benchmarks.ray_workers", name, *(["--smoke"] if args.smoke else []))
        for name in (SMOKE_CASES if args.smoke else CASES)
    }
    t = {name: r["median_s"] for name, r in results.items() if "median_s" in r}
    payload = {
        "setup": {
            "clients": CLIENTS,
            "cohort": COHORT,
            "problem": "benchmark 1 (logistic regression, d = 123, fp64)",
            "ray": "local instance started by the executor",
            "warmup": warmup,
            "rounds": repeats,
        },
        "cases": results,
        "ray_one_worker_over_vectorized": round(t["ray-1"] / t["vectorized"], 2)
        if {"ray-1", "vectorized"} <= set(t)
        else None,
    }
    if not args.smoke:
        payload["speedup_two_workers_over_one"] = (
            round(t["ray-1"] / t["ray-2"], 2) if {"ray-1", "ray-2"} <= set(t) else None
        )
        payload["ray_two_workers_over_vectorized"] = (
            round(t["ray-2"] / t["vectorized"], 2) if {"ray-2", "vectorized"} <= set(t) else None
        )
        print(write("ray_workers", payload).read_text())
        return
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
