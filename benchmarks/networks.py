"""Benchmark — a client's local work on a neural network: fedshuffle's executors against a hand-written PyTorch loop.

Two harnesses, FedAvg rounds in float32 (server lr 1, one local epoch, random data of the real shapes):

* ``cnn`` — pfl-research's cross-device CIFAR-10 setup of :mod:`benchmarks.cross_device_cnn`: 1,000 users
  × 50 images 3×32×32, 50 per round, batch 10 (5 steps), lr 0.1, pfl-research's CNN without dropout.
* ``lstm`` — Shakespeare-sized next-character model: 200 users × 64 sequences of 80 characters
  (vocabulary 90), 16 per round, batch 32 (2 steps), lr 0.5, embedding 8 and a 2×256 LSTM
  (:class:`fedshuffle.problems.CharLSTM`), a loss at every position.

Cases, each in its own process (seconds per round after a warm-up round, wall and CPU time, peak RSS):

* ``sequential`` — fedshuffle, one client after another (the module's parameters are views of the flat vector);
* ``vectorized`` — fedshuffle, the whole cohort as one masked loop (on CPU: clients one after another inside each step);
* ``vmap`` — fedshuffle, the cohort as one ``vmap`` of ``torch.func.grad`` per step (``vectorize=True``; the CUDA
  default);
* ``auto`` — fedshuffle with ``run.executor = "auto"`` (:mod:`fedshuffle.executors.choice`);
* ``torch_loop`` — the limit case: a plain PyTorch FedAvg round — per client, load the global weights,
  ``module(x)`` / ``loss.backward()`` / ``optimizer.step()`` over the same minibatches, accumulate the update.

    # writes benchmarks/results/networks.json
    python -m benchmarks.networks [--rounds 3] [--threads 1] [--cases cnn_sequential,...]
    python -m benchmarks.networks --profile cnn_sequential                   # torch.profiler table of one round
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.common import RESULTS, emit, run_case, write


@dataclass(frozen=True)
class Harness:
    users: int
    per_user: int
    cohort: int
    batch: int
    lr: float
    make_module: Callable[[], torch.nn.Module]
    sample_shape: tuple[int, ...]
    user_data: Callable[[int], tuple[np.ndarray, np.ndarray]]


def _images(user: int) -> tuple[np.ndarray, np.ndarray]:
    from benchmarks.cross_device_cnn import user_data

    return user_data(user)


def _text(user: int) -> tuple[np.ndarray, np.ndarray]:
    """80-character windows and their next characters (the window shifted by one), as token ids."""
    stream = np.random.default_rng(user).integers(0, VOCABULARY, 64 * 80 + 1)
    return np.lib.stride_tricks.sliding_window_view(stream[:-1], 80)[
        ::80
    ].copy(), np.lib.stride_tricks.sliding_window_view(stream[1:], 80)[::80].copy()


def _cnn() -> torch.nn.Module:
    from fedshuffle.problems import pfl_cnn

    return pfl_cnn((3, 32, 32), 10, dropout=False)


def _lstm() -> torch.nn.Module:
    from fedshuffle.problems import CharLSTM

    return CharLSTM(VOCABULARY, 8, 256, 2)


VOCABULARY = 90
HARNESSES = {
    "cnn": Harness(1000, 50, 50, 10, 0.1, _cnn, (3, 32, 32), _images),
    "lstm": Harness(200, 64, 16, 32, 0.5, _lstm, (80,), _text),
}


def _dataset(h: Harness):
    from fedshuffle.data import FederatedDataset, objective_weights

    xs, ys = zip(*(h.user_data(u) for u in range(h.users)))
    features = torch.from_numpy(np.concatenate(xs).reshape(h.users * h.per_user, -1))
    return FederatedDataset(
        features,
        torch.from_numpy(np.concatenate(ys)),
        np.arange(h.users * h.per_user).reshape(h.users, h.per_user),
        objective_weights(np.full(h.users, h.per_user), "size"),
    )


def _problem(h: Harness, vectorize: bool | None = None):
    from fedshuffle.problems import ModuleProblem, glorot_weights

    return ModuleProblem(h.make_module(), sample_shape=h.sample_shape, initializer=glorot_weights, vectorize=vectorize)


def ours(h: Harness, executor: str) -> Callable[[], object]:
    from fedshuffle import Simulation, UniformWithoutReplacement, build_algorithm
    from fedshuffle.executors.local import SequentialExecutor, VectorizedExecutor

    alg = build_algorithm(
        "fedavg_rr", {"local": {"lr": h.lr, "epochs": 1, "batch_size": h.batch}, "server": {"lr": 1.0}}
    )
    from fedshuffle.executors import make_executor

    problem = _problem(h, vectorize=True if executor == "vmap" else None)
    ex = (
        make_executor("auto", problem)
        if executor == "auto"
        else SequentialExecutor()
        if executor == "sequential"
        else VectorizedExecutor(chunk_size=h.cohort)
    )
    sim = Simulation(
        problem,
        _dataset(h),
        alg,
        UniformWithoutReplacement(h.users, h.cohort),
        seed=0,
        dtype=torch.float32,
        executor=ex,
    )
    return sim.step


def torch_loop(h: Harness) -> Callable[[], object]:
    """A plain PyTorch FedAvg round over the same data and minibatch sizes (random reshuffling per client)."""
    data = _dataset(h)
    module = h.make_module()
    params = list(module.parameters())
    global_ = _problem(h).init_params(torch.Generator().manual_seed(0), torch.float32)
    rounds = iter(range(10**6))

    def step() -> None:
        nonlocal global_
        r = next(rounds)
        cohort = np.random.default_rng(r).choice(h.users, h.cohort, replace=False)
        total = torch.zeros_like(global_)
        for user in cohort:
            torch.nn.utils.vector_to_parameters(
                global_.clone(), params
            )  # a copy: the parameters must not alias the global model
            opt = torch.optim.SGD(params, lr=h.lr)
            rows = torch.from_numpy(data.client_indices[user][np.random.default_rng((r, user)).permutation(h.per_user)])
            for k in range(0, h.per_user, h.batch):
                batch = rows[k : k + h.batch]
                x = data.features[batch].reshape(len(batch), *h.sample_shape)
                opt.zero_grad()
                out = module(x)
                torch.nn.functional.cross_entropy(
                    out.reshape(-1, out.shape[-1]), data.labels[batch].reshape(-1)
                ).backward()
                opt.step()
            total += global_ - torch.nn.utils.parameters_to_vector(params)
        global_ = global_ - total / h.cohort

    return step


def timed(step: Callable[[], object], warmup: int, repeats: int) -> dict[str, float]:
    """Median wall and CPU seconds per round (CPU time: all threads of this process; the machine may be shared)."""
    for _ in range(warmup):
        step()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {
        "median_s": statistics.median(wall),
        "min_s": min(wall),
        "max_s": max(wall),
        "cpu_median_s": statistics.median(cpu),
        "rounds": repeats,
        "warmup": warmup,
    }


def make_step(case: str) -> Callable[[], object]:
    harness, kind = case.split("_", 1)
    h = HARNESSES[harness]
    return torch_loop(h) if kind == "torch_loop" else ours(h, kind)


CASES = [f"{h}_{k}" for h in HARNESSES for k in ("sequential", "vectorized", "vmap", "auto", "torch_loop")]


def profile(case: str) -> None:
    """One round of ``case`` under torch.profiler; the operator table goes to results/networks_profile_<case>.txt."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    step = make_step(case)
    step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"networks_profile_{case}.txt").write_text(table + "\n")
    print(table)


def interleaved(harness: str, kinds: list[str], rounds: int) -> None:
    """The ``kinds`` of one harness in this process, round by round in turn (wall and CPU seconds per round,
    medians): on a shared machine, load changes hit every kind alike. Writes
    results/networks_<harness>_interleaved.json."""
    from fedshuffle.executors import choose

    steps = {kind: make_step(f"{harness}_{kind}") for kind in kinds}
    for step in steps.values():
        step()  # warm-up
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind, step in steps.items():
            w, c = time.perf_counter(), time.process_time()
            step()
            wall[kind].append(time.perf_counter() - w)
            cpu[kind].append(time.process_time() - c)
    cases = {
        k: {
            "median_s": statistics.median(wall[k]),
            "cpu_median_s": statistics.median(cpu[k]),
            "wall_s": wall[k],
            "cpu_s": cpu[k],
        }
        for k in kinds
    }
    best = (
        min(("sequential", "vectorized"), key=lambda k: cases[k]["median_s"])
        if {"sequential", "vectorized"} <= set(kinds)
        else None
    )
    h = HARNESSES[harness]
    payload = {
        "setup": {
            "harness": harness,
            "users": h.users,
            "samples_per_user": h.per_user,
            "cohort": h.cohort,
            "batch": h.batch,
            "lr": h.lr,
            "sample_shape": h.sample_shape,
            "parameters": _problem(h).dim,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "protocol": f"one process, the kinds in turn each round, {rounds} rounds after a warm-up round",
        },
        "auto_picks": choose(_problem(h))[0],
        "cases": cases,
    }
    if best and "auto" in cases:  # wall seconds: the threaded executor spends its CPU seconds on several cores at once
        payload["auto_over_best_seconds"] = round(cases["auto"]["median_s"] / cases[best]["median_s"], 3)
        payload["auto_over_best_cpu"] = round(cases["auto"]["cpu_median_s"] / cases[best]["cpu_median_s"], 3)
    print(write(f"networks_{harness}_interleaved", payload).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--profile", choices=CASES)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (after one warm-up round)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument(
        "--interleaved",
        metavar="HARNESS",
        choices=list(HARNESSES),
        help="run --kinds of HARNESS in one process, round by round in turn",
    )
    parser.add_argument("--kinds", default="sequential,vectorized,auto")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per case (default: PyTorch's, one per core)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        profile(args.profile)
        return
    if args.interleaved:
        interleaved(args.interleaved, args.kinds.split(","), args.rounds)
        return
    if args.case:
        emit({"case": args.case, **timed(make_step(args.case), 1, args.rounds), "threads": torch.get_num_threads()})
        return
    threads = ("--threads", str(args.threads)) if args.threads else ()
    results = {
        name: run_case("benchmarks.networks", name, "--rounds", str(args.rounds), *threads)
        for name in args.cases.split(",")
    }
    ratios = {}
    for h in HARNESSES:
        limit = results.get(f"{h}_torch_loop", {}).get("median_s")
        for kind in ("sequential", "vectorized", "vmap", "auto"):
            ours_s = results.get(f"{h}_{kind}", {}).get("median_s")
            if limit and ours_s:
                ratios[f"{h}_{kind}_over_torch_loop"] = round(ours_s / limit, 3)
    path = write(
        "networks",
        {
            "setup": {
                name: {
                    "users": h.users,
                    "samples_per_user": h.per_user,
                    "cohort": h.cohort,
                    "batch": h.batch,
                    "lr": h.lr,
                    "sample_shape": h.sample_shape,
                    "local": "1 epoch (random reshuffling)",
                    "dtype": "float32",
                    "parameters": _problem(h).dim,
                }
                for name, h in HARNESSES.items()
            },
            "cases": results,
            "ratios": ratios,
            "goal": "sequential_over_torch_loop close to 1 (a client's local work as fast as a hand-written PyTorch "
            "loop)",
        },
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
