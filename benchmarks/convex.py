"""Benchmark 1 — convex cross-device: L2 logistic regression, d = 123, 1,000 clients with log-normal
sizes (mean 50), cohort 100, one local epoch of batch-1 random reshuffling (FedShuffle), fp64.
Vectorized vs sequential executor, seconds per round.

    python -m benchmarks.convex            # writes benchmarks/results/convex.json
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import emit, run_case, time_rounds, write
from fedshuffle import LogisticRegression, Simulation, UniformWithoutReplacement, build_algorithm
from fedshuffle.data import FederatedDataset, objective_weights
from fedshuffle.executors.local import SequentialExecutor, VectorizedExecutor

CLIENTS, COHORT, DIM, MEAN_SIZE, SIGMA = 1000, 100, 123, 50, 1.0


def lognormal_sizes(n: int, rng: np.random.Generator) -> np.ndarray:
    """⌊LogNormal(μ, σ)⌋ + 1 with E ≈ 50: μ = ln(49.5) − σ²/2."""
    return np.floor(rng.lognormal(np.log(MEAN_SIZE - 0.5) - SIGMA**2 / 2, SIGMA, n)).astype(np.int64) + 1


def problem_and_data(seed: int = 0) -> tuple[LogisticRegression, FederatedDataset]:
    rng = np.random.default_rng(seed)
    sizes = lognormal_sizes(CLIENTS, rng)
    total = int(sizes.sum())
    shift = np.repeat(rng.normal(size=(CLIENTS, DIM)), sizes, axis=0)
    x = (rng.random((total, DIM)) < 0.11) * 1.0 + 0.1 * shift  # a9a-like sparsity, heterogeneous clients
    w = rng.normal(size=DIM)
    y = np.where(x @ w + rng.normal(size=total) > np.median(x @ w), 1.0, -1.0)
    parts = np.split(np.arange(total), np.cumsum(sizes)[:-1])
    return LogisticRegression(DIM, 1e-3), FederatedDataset(torch.tensor(x), torch.tensor(y), parts, objective_weights(sizes, "size"))


def case(executor: str, warmup: int, repeats: int) -> None:
    torch.set_num_threads(1)
    problem, data = problem_and_data()
    alg = build_algorithm("fedshuffle", {"lr": 0.05, "epochs": 1, "batch_size": 1})
    ex = SequentialExecutor() if executor == "sequential" else VectorizedExecutor()
    sim = Simulation(problem, data, alg, UniformWithoutReplacement(CLIENTS, COHORT), seed=0, executor=ex)
    timing = time_rounds(sim.step, warmup, repeats)
    steps = int(np.mean([data.sizes[sim.sampler.sample(r, 0)].sum() for r in range(sim.counters.rounds)]))
    emit({"case": executor, **timing, "mean_local_steps_per_round": steps, "threads": 1})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["sequential", "vectorized"])
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    if args.case:
        repeats = args.repeats or (5 if args.case == "sequential" else 30)
        case(args.case, warmup=2, repeats=repeats)
        return
    results = {name: run_case("benchmarks.convex", name) for name in ("sequential", "vectorized")}
    ratio = results["sequential"]["median_s"] / results["vectorized"]["median_s"]
    path = write("convex", {
        "setup": {"clients": CLIENTS, "cohort": COHORT, "dim": DIM, "sizes": f"floor(LogNormal) + 1, mean {MEAN_SIZE}, sigma {SIGMA}", "local": "1 epoch, batch 1, RR (FedShuffle)", "dtype": "float64", "threads": 1},
        "cases": results, "speedup_vectorized_over_sequential": round(ratio, 2), "goal": ">= 30x",
    })
    print(path.read_text())


if __name__ == "__main__":
    main()
