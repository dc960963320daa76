"""Benchmark 3 — population size: the convex setup of benchmark 1 with 1,000 → 1,000,000 clients.

Clients are generated when they take part (:class:`fedshuffle.data.LazyFederatedDataset`), cohort
100, one local epoch of batch-1 RR (FedShuffle), vectorized executor, fp64. Seconds per round and
peak resident memory for each population size, each in its own process.

    python -m benchmarks.scale             # writes benchmarks/results/scale.json
    python -m benchmarks.scale --smoke     # 100 and 10,000 clients, a few rounds: prints the JSON, writes nothing
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from benchmarks.common import emit, run_case, time_rounds, write
from benchmarks.convex import COHORT, DIM, lognormal_sizes
from fedshuffle import LogisticRegression, Simulation, UniformWithoutReplacement, build_algorithm
from fedshuffle.data import LazyFederatedDataset, objective_weights
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.core.streams import Stream, generator

POPULATIONS = (1_000, 10_000, 100_000, 1_000_000)
SMOKE_POPULATIONS = (COHORT, 10_000)


class Clients:
    """Client i's samples from its own stream: sparse binary features around a client shift, labels from one plane."""

    def __init__(self, sizes: np.ndarray, seed: int = 0) -> None:
        self.sizes, self.seed = sizes, seed
        self.plane = np.random.default_rng(seed).normal(size=DIM)

    def __call__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rng = generator(self.seed, Stream.PARTITION, i)
        x = (rng.random((int(self.sizes[i]), DIM)) < 0.11) * 1.0 + 0.1 * rng.normal(size=DIM)
        return x, np.where(x @ self.plane + rng.normal(size=len(x)) > 1.0, 1.0, -1.0)


def case(clients: int, warmup: int, repeats: int) -> None:
    torch.set_num_threads(1)
    sizes = lognormal_sizes(clients, np.random.default_rng(0))
    data = LazyFederatedDataset(sizes, objective_weights(sizes, "size"), Clients(sizes), (DIM,))
    alg = build_algorithm("fedshuffle", {"local": {"lr": 0.05, "epochs": 1, "batch_size": 1}})
    sim = Simulation(
        LogisticRegression(DIM, 1e-3),
        data,
        alg,
        UniformWithoutReplacement(clients, COHORT),
        seed=0,
        executor=VectorizedExecutor(),
    )
    emit({"case": str(clients), "clients": clients, **time_rounds(sim.step, warmup, repeats), "threads": 1})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case")
    parser.add_argument(
        "--smoke", action="store_true", help="two small populations, a few rounds; prints the JSON, writes nothing"
    )
    args = parser.parse_args()
    warmup, repeats = (1, 2) if args.smoke else (3, 40)
    if args.case:
        case(int(args.case), warmup, repeats)
        return
    populations = SMOKE_POPULATIONS if args.smoke else POPULATIONS
    results = {str(n): run_case("benchmarks.scale", str(n), *(["--smoke"] if args.smoke else [])) for n in populations}
    base = results[str(populations[0])]
    payload = {
        "setup": {
            "cohort": COHORT,
            "dim": DIM,
            "sizes": "floor(LogNormal) + 1, mean 50",
            "local": "1 epoch, batch 1, RR (FedShuffle)",
            "data": "generated per client when sampled",
            "executor": "vectorized",
            "dtype": "float64",
            "threads": 1,
            "warmup": warmup,
            "rounds": repeats,
        },
        "cases": results,
        "round_time_over_smallest": {
            n: round(r["median_s"] / base["median_s"], 2) for n, r in results.items() if "median_s" in r
        },
        # on a machine shared with other work the wall times wait for the scheduler; the CPU seconds do not
        "round_cpu_time_over_smallest": {
            n: round(r["cpu_median_s"] / base["cpu_median_s"], 2) for n, r in results.items() if "cpu_median_s" in r
        },
        "load_average_at_end": os.getloadavg(),
        "peak_rss_mib": {n: r.get("peak_rss_mib") for n, r in results.items()},
        "goal": "round time at 1,000,000 within 1.2x of 1,000; memory independent of n",
    }
    if args.smoke:
        print(json.dumps(payload))
        return
    print(write("scale", payload).read_text())


if __name__ == "__main__":
    main()
