"""Benchmark 2 — pfl-research's cross-device CIFAR-10 setup, with random images of that shape.

1,000 users × 50 images of 3×32×32, 50 users per round, one local epoch with batch 10 (5 steps),
client lr 0.1, server lr 1.0, FedAvg, the small two-convolution CNN (:class:`fedshuffle.problems.CNN`),
float32. Seconds per round (median after warm-up) for

* ``vectorized`` — fedshuffle, the whole cohort as one vmap-ed batch (``vectorized_chunk10``: in
  chunks of 10 clients, which on CPU keeps each grouped convolution in cache);
* ``sequential`` — fedshuffle, one client after another;
* ``limit`` — the vectorization limit: 5 steps of one forward/backward of a single model on 50·10 images;
* ``flower`` — Flower's simulation engine (Ray backend), FedAvg with NumPyClients;
* ``pfl`` — pfl-research's simulated backend, FederatedAveraging with a PyTorch model.

Flower and pfl-research are only in the benchmark environment: ``pip install -r benchmarks/requirements.txt``.

    python -m benchmarks.cross_device_cnn [--rounds 3]      # writes benchmarks/results/cross_device_cnn.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.common import emit, run_case, time_rounds, write

USERS, PER_USER, COHORT, BATCH, LR, CLASSES = 1000, 50, 50, 10, 0.1, 10
SHAPE = (3, 32, 32)


def user_data(user: int) -> tuple[np.ndarray, np.ndarray]:
    """User ``user``'s 50 random images and labels (the same for every framework)."""
    rng = np.random.default_rng(user)
    return rng.random((PER_USER, *SHAPE), dtype=np.float32), rng.integers(0, CLASSES, PER_USER)


def cohort(round_index: int) -> np.ndarray:
    return np.sort(np.random.default_rng(10_000 + round_index).choice(USERS, COHORT, replace=False))


def ours(executor: str, warmup: int, repeats: int, chunk_size: int | None = None) -> dict:
    from fedshuffle import Simulation, UniformWithoutReplacement, build_algorithm
    from fedshuffle.data import FederatedDataset, objective_weights
    from fedshuffle.executors.local import SequentialExecutor, VectorizedExecutor
    from fedshuffle.problems import CNN

    xs, ys = zip(*(user_data(u) for u in range(USERS)))
    data = FederatedDataset(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)),
                            np.arange(USERS * PER_USER).reshape(USERS, PER_USER), objective_weights(np.full(USERS, PER_USER), "size"))
    alg = build_algorithm("fedavg_rr", {"local": {"lr": LR, "epochs": 1, "batch_size": BATCH}, "server": {"lr": 1.0}})
    ex = VectorizedExecutor(chunk_size) if executor == "vectorized" else SequentialExecutor()
    sim = Simulation(CNN(SHAPE, CLASSES, dropout=False), data, alg, UniformWithoutReplacement(USERS, COHORT), seed=0, dtype=torch.float32, executor=ex)
    return time_rounds(sim.step, warmup, repeats)


def limit(warmup: int, repeats: int) -> dict:
    """One model, C·B images per step, as many steps as a client's epoch: the cost of the arithmetic alone."""
    from fedshuffle.problems import CNN

    problem = CNN(SHAPE, CLASSES, dropout=False)
    params = problem.init_params(torch.Generator().manual_seed(0), torch.float32).requires_grad_(True)
    x, y = user_data(0)
    images = torch.from_numpy(np.concatenate([x] * COHORT)).reshape(COHORT * PER_USER, *SHAPE)
    labels = torch.from_numpy(np.concatenate([y] * COHORT))
    steps = PER_USER // BATCH

    def round_():
        nonlocal params
        for s in range(steps):
            rows = slice(s * COHORT * BATCH, (s + 1) * COHORT * BATCH)
            loss = problem.losses(params, images[rows], labels[rows]).mean()
            (g,) = torch.autograd.grad(loss, params)
            with torch.no_grad():
                params = (params - LR * g).requires_grad_(True)

    return time_rounds(round_, warmup, repeats)


def flower(warmup: int, repeats: int) -> dict:
    from benchmarks.frameworks import flower_round_seconds

    return flower_round_seconds(warmup, repeats)


def pfl(warmup: int, repeats: int) -> dict:
    from benchmarks.frameworks import pfl_round_seconds

    return pfl_round_seconds(warmup, repeats)


CASES = {"vectorized": lambda w, r: ours("vectorized", w, r), "vectorized_chunk10": lambda w, r: ours("vectorized", w, r, 10), "sequential": lambda w, r: ours("sequential", w, r), "limit": limit, "flower": flower, "pfl": pfl}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (after one warm-up round)")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if args.case:
        start = time.perf_counter()
        result = CASES[args.case](1, args.rounds)
        emit({"case": args.case, **result, "threads": torch.get_num_threads(), "wall_s": round(time.perf_counter() - start, 1)})
        return
    results = {name: run_case("benchmarks.cross_device_cnn", name, "--rounds", str(args.rounds)) for name in args.cases.split(",")}
    ours_s = results["vectorized"].get("median_s")
    ratios = {f"{name}_over_vectorized": round(r["median_s"] / ours_s, 2) for name, r in results.items() if name != "vectorized" and "median_s" in r and ours_s}
    path = write("cross_device_cnn", {
        "setup": {"users": USERS, "images_per_user": PER_USER, "image": SHAPE, "cohort": COHORT, "local": "1 epoch, batch 10 (5 steps)", "client_lr": LR, "server_lr": 1.0, "model": "pfl-research simple_cnn without dropout (1.63M parameters)", "dtype": "float32"},
        "cases": results, "ratios": ratios,
        "goals": {"flower_over_vectorized": ">= 3", "pfl_over_vectorized": ">= 3", "vectorized_over_limit": "<= 1.5"},
    })
    print(path.read_text())


if __name__ == "__main__":
    main()
