"""Benchmark 1 — convex cross-device: L2 logistic regression, d = 123, 1,000 clients with log-normal
sizes (mean 50), cohort 100, one local epoch of batch-1 random reshuffling (FedShuffle), fp64.
Seconds per round of the executors — ``sequential`` (the reference), ``vectorized`` (the torch masked loop),
``compiled`` (the vectorized executor's numba backend, :mod:`fedshuffle.local.fused`), ``auto`` — and of
``limit``, the same round written as one numba loop by hand. Needs numba (``pip install 'fedshuffle[fast]'``).

    python -m benchmarks.convex            # writes benchmarks/results/convex.json
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import emit, run_case, summarize, time_rounds, write
from fedshuffle import LogisticRegression, Simulation, UniformWithoutReplacement, build_algorithm
from fedshuffle.data import FederatedDataset, objective_weights
from fedshuffle.executors import make_executor
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
    return LogisticRegression(DIM, 1e-3), FederatedDataset(
        torch.tensor(x), torch.tensor(y), parts, objective_weights(sizes, "size")
    )


def limit_round(problem: LogisticRegression, data: FederatedDataset):
    """The compiled-loop limit: a round of the same shape as one numba loop — cohort draw, a permutation per client,
    batch-1 logistic steps on dense features, the size-weighted average — without planning, executors or methods."""
    import numba

    @numba.njit(cache=True)
    def steps(x, b, order, starts, ends, lr, l2, params, out):
        for c in range(starts.shape[0]):
            y = params.copy()
            for k in range(starts[c], ends[c]):
                r = order[k]
                margin = 0.0
                for j in range(y.shape[0]):
                    margin += x[r, j] * y[j]
                coef = b[r] / (1.0 + np.exp(b[r] * margin))
                for j in range(y.shape[0]):
                    y[j] -= lr * (l2 * y[j] - coef * x[r, j])
            out[c] = params - y

    x, b = data.features.numpy(), data.labels.numpy()
    offsets = np.concatenate([[0], np.cumsum(data.sizes)])
    params, rounds = np.zeros(DIM), iter(range(10**9))

    def round_() -> None:
        nonlocal params
        r = next(rounds)
        rng = np.random.default_rng(r)
        cohort = rng.choice(CLIENTS, COHORT, replace=False)
        order = np.concatenate([offsets[i] + rng.permutation(data.sizes[i]) for i in cohort])
        ends = np.cumsum(data.sizes[cohort])
        out = np.empty((COHORT, DIM))
        steps(x, b, order, ends - data.sizes[cohort], ends, 0.05 / 1, problem.l2, params, out)
        w = data.sizes[cohort] / data.sizes[cohort].sum()
        params = params - w @ out

    return round_


def case(executor: str, warmup: int, repeats: int) -> None:
    torch.set_num_threads(1)
    problem, data = problem_and_data()
    if executor == "limit":
        emit({"case": executor, **time_rounds(limit_round(problem, data), warmup, repeats), "threads": 1})
        return
    alg = build_algorithm("fedshuffle", {"local": {"lr": 0.05, "epochs": 1, "batch_size": 1}})
    ex = {
        "sequential": SequentialExecutor(),
        "vectorized": VectorizedExecutor(compiled=False),
        "compiled": VectorizedExecutor(),
        "auto": make_executor("auto", problem),
    }[executor]
    sim = Simulation(problem, data, alg, UniformWithoutReplacement(CLIENTS, COHORT), seed=0, executor=ex)
    timing = time_rounds(sim.step, warmup, repeats)
    steps = int(np.mean([data.sizes[sim.sampler.sample(r, 0)].sum() for r in range(sim.counters.rounds)]))
    emit(
        {
            "case": executor,
            **timing,
            "mean_local_steps_per_round": steps,
            "threads": 1,
            "executor": ex.name,
            "compiled_backend": fused_usable(problem, data, ex),
        }
    )


def fused_usable(problem, data, executor) -> bool:
    from fedshuffle.local import fused

    return (
        bool(getattr(executor, "compiled", False))
        and fused.numba is not None
        and fused.problem_code(problem) is not None
    )


CASES = ("sequential", "vectorized", "compiled", "auto", "limit")
REPEATS = {"sequential": 5, "vectorized": 20}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the list of cases this many times, interleaved; medians over the runs",
    )
    args = parser.parse_args()
    if args.case:
        case(args.case, warmup=3, repeats=args.repeats or REPEATS.get(args.case, 100))
        return
    runs: dict[str, list[dict]] = {name: [] for name in CASES}
    for _ in range(args.repeat):
        for name in CASES:
            runs[name].append(run_case("benchmarks.convex", name))
    results = {name: summarize(r) for name, r in runs.items()}
    seconds = {name: r.get("median_s") for name, r in results.items()}
    ratios = {}
    if seconds["sequential"]:
        ratios.update(
            {
                f"speedup_{n}_over_sequential": round(seconds["sequential"] / seconds[n], 2)
                for n in ("vectorized", "compiled", "auto")
                if seconds[n]
            }
        )
    if seconds["limit"]:
        ratios.update(
            {
                f"{n}_over_limit": round(seconds[n] / seconds["limit"], 2)
                for n in ("vectorized", "compiled", "auto")
                if seconds[n]
            }
        )
    path = write(
        "convex",
        {
            "setup": {
                "clients": CLIENTS,
                "cohort": COHORT,
                "dim": DIM,
                "sizes": f"floor(LogNormal) + 1, mean {MEAN_SIZE}, sigma {SIGMA}",
                "local": "1 epoch, batch 1, RR (FedShuffle)",
                "dtype": "float64",
                "threads": 1,
                "protocol": f"each case in its own process, the list run {args.repeat}x interleaved; per case the "
                "median over runs of the per-run median s/round",
            },
            "cases": results,
            "ratios": ratios,
            "goals": {"speedup_auto_over_sequential": ">= 30", "auto_over_limit": "<= 1.5"},
        },
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
