"""Benchmark 4 — Ray: the convex setup of benchmark 1 on the Ray executor with one and two workers,
against the in-process vectorized executor (each worker runs the vectorized executor on its share).

    python -m benchmarks.ray_workers       # writes benchmarks/results/ray_workers.json
"""

from __future__ import annotations

import torch

from benchmarks.common import case_or_all, emit, time_rounds, write
from benchmarks.convex import CLIENTS, COHORT, problem_and_data
from fedshuffle import Simulation, UniformWithoutReplacement, build_algorithm
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.executors.ray import RayExecutor

CASES = ("vectorized", "ray-1", "ray-2")


def case(name: str, warmup: int, repeats: int) -> None:
    torch.set_num_threads(1)
    problem, data = problem_and_data()
    executor = VectorizedExecutor() if name == "vectorized" else RayExecutor(workers=int(name.split("-")[1]))
    alg = build_algorithm("fedshuffle", {"lr": 0.05, "epochs": 1, "batch_size": 1})
    sim = Simulation(problem, data, alg, UniformWithoutReplacement(CLIENTS, COHORT), seed=0, executor=executor)
    emit({"case": name, **time_rounds(sim.step, warmup, repeats), "threads_per_worker": 1})


def main() -> None:
    results = case_or_all("benchmarks.ray_workers", CASES, case, warmup=3, repeats=30)
    if results is None:
        return
    t = {name: r["median_s"] for name, r in results.items()}
    path = write("ray_workers", {
        "setup": {"clients": CLIENTS, "cohort": COHORT, "problem": "benchmark 1 (logistic regression, d = 123, fp64)", "ray": "local instance started by the executor"},
        "cases": results,
        "speedup_two_workers_over_one": round(t["ray-1"] / t["ray-2"], 2),
        "ray_one_worker_over_vectorized": round(t["ray-1"] / t["vectorized"], 2),
        "ray_two_workers_over_vectorized": round(t["ray-2"] / t["vectorized"], 2),
    })
    print(path.read_text())


if __name__ == "__main__":
    main()
