"""Benchmark 2 — pfl-research's cross-device CIFAR-10 setup, with random images of that shape.

1,000 users × 50 images of 3×32×32, 50 users per round, one local epoch with batch 10 (5 steps),
client lr 0.1, server lr 1.0, FedAvg, the small two-convolution CNN (:class:`fedshuffle.problems.CNN`),
float32. Seconds per round (median after warm-up) for

* ``vectorized`` — fedshuffle, the whole cohort as one vmap-ed batch (``vectorized_chunk10``: in
  chunks of 10 clients, which on CPU keeps each grouped convolution in cache);
* ``sequential`` — fedshuffle, one client after another;
* ``auto`` — fedshuffle's choice (on a multi-core CPU ``threaded``: clients in parallel, one thread each);
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

from benchmarks.common import emit, run_case, summarize, time_rounds, write

USERS, PER_USER, COHORT, BATCH, LR, CLASSES = 1000, 50, 50, 10, 0.1, 10
SHAPE = (3, 32, 32)


def user_data(user: int) -> tuple[np.ndarray, np.ndarray]:
    """User ``user``'s 50 random images and labels (the same for every framework)."""
    rng = np.random.default_rng(user)
    return rng.random((PER_USER, *SHAPE), dtype=np.float32), rng.integers(0, CLASSES, PER_USER)


def cohort(round_index: int) -> np.ndarray:
    return np.sort(np.random.default_rng(10_000 + round_index).choice(USERS, COHORT, replace=False))


def lazy_data():
    """The users' data as fedshuffle's lazy dataset: a user's images are made when it takes part, as pfl-research's
    harness does."""
    from fedshuffle.data import LazyFederatedDataset, objective_weights

    def make(user: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = user_data(user)
        return x.reshape(PER_USER, -1), y

    return LazyFederatedDataset(
        np.full(USERS, PER_USER),
        objective_weights(np.full(USERS, PER_USER), "size"),
        make,
        (int(np.prod(SHAPE)),),
        dtype=torch.float32,
    )


def ours(executor: str, warmup: int, repeats: int, chunk_size: int | None = None, workers: int = 2) -> dict:
    from fedshuffle import Simulation, UniformWithoutReplacement, build_algorithm
    from fedshuffle.executors import make_executor
    from fedshuffle.problems import CNN

    alg = build_algorithm("fedavg_rr", {"local": {"lr": LR, "epochs": 1, "batch_size": BATCH}, "server": {"lr": 1.0}})
    problem, data = CNN(SHAPE, CLASSES, dropout=False), lazy_data()
    ex = make_executor(
        executor, problem, chunk_size=chunk_size, **({"ray_workers": workers} if executor == "ray" else {})
    )
    sim = Simulation(
        problem, data, alg, UniformWithoutReplacement(USERS, COHORT), seed=0, dtype=torch.float32, executor=ex
    )
    try:
        timed = time_rounds(sim.step, warmup, repeats)
        if executor == "ray":  # Ray's processes (started by this one) count too
            timed["descendants_peak_rss_mib"] = descendants_peak_rss_mib()
        return {**timed, "executor": ex.name}
    finally:
        getattr(ex, "close", lambda: None)()


def descendants_peak_rss_mib() -> float:
    """Sum of the peak resident memory (VmHWM) of every process this one started (Ray's GCS, raylet, workers)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{child.pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
        except (OSError, StopIteration):
            pass
    return round(total, 1)


def torch_loop(warmup: int, repeats: int) -> dict:
    """The limit case: a plain PyTorch FedAvg round — per user, load the global weights, SGD over its minibatches
    (``module(x)`` / ``loss.backward()`` / ``optimizer.step()``), add its update to the sum."""
    from benchmarks.frameworks import local_epoch, make_module

    module = make_module()
    params = list(module.parameters())
    global_ = torch.nn.utils.parameters_to_vector(params).detach().clone()
    rounds = iter(range(10**6))

    def round_() -> None:
        nonlocal global_
        r = next(rounds)
        total = torch.zeros_like(global_)
        for user in cohort(r):
            torch.nn.utils.vector_to_parameters(
                global_.clone(), params
            )  # a copy: the parameters must not alias the global model
            local_epoch(module, int(user), seed=r * USERS + int(user))
            total += global_ - torch.nn.utils.parameters_to_vector(params).detach()
        global_ = global_ - total / COHORT

    return time_rounds(round_, warmup, repeats)


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


CASES = {
    "sequential": lambda w, r: ours("sequential", w, r),
    "auto": lambda w, r: ours("auto", w, r),
    "vectorized_chunk10": lambda w, r: ours("vectorized", w, r, 10),
    "ray_sequential": lambda w, r: ours("ray", w, r, 1),
    "vectorized": lambda w, r: ours("vectorized", w, r),
    "torch_loop": torch_loop,
    "limit": limit,
    "flower": flower,
    "pfl": pfl,
}


def save(runs: dict[str, list[dict]], repeat: int, output: str = "cross_device_cnn"):
    """Write the cases measured so far, with their ratios to pfl-research."""
    results = {name: summarize(rs) for name, rs in runs.items()}
    reference = results.get("pfl", {}).get("median_s")
    ratios = {}
    for name, r in results.items():
        if name != "pfl" and reference and "median_s" in r:
            ratios[f"{name}_over_pfl_seconds"] = round(r["median_s"] / reference, 3)
            if "cpu_median_s" in r and "cpu_median_s" in results["pfl"]:
                ratios[f"{name}_over_pfl_cpu_seconds"] = round(r["cpu_median_s"] / results["pfl"]["cpu_median_s"], 3)
            ratios[f"{name}_over_pfl_peak_rss"] = round(r["peak_rss_mib"] / results["pfl"]["peak_rss_mib"], 3)
    return write(
        output,
        {
            "setup": {
                "users": USERS,
                "images_per_user": PER_USER,
                "image": SHAPE,
                "cohort": COHORT,
                "local": "1 epoch, batch 10 (5 steps)",
                "client_lr": LR,
                "server_lr": 1.0,
                "model": "pfl-research simple_cnn without dropout (1.63M parameters)",
                "dtype": "float32",
                "data": "generated per user when it takes part (fedshuffle: LazyFederatedDataset)",
                "protocol": f"each case in its own process, the list run {repeat}x interleaved; per case the median "
                "over runs of the per-run median s/round, and the largest peak RSS",
            },
            "cases": results,
            "ratios": ratios,
            "goals": {
                "sequential_over_pfl_seconds": "<= 0.9",
                "sequential_over_pfl_peak_rss": "<= 1.5",
                "auto_over_pfl_seconds": "<= 0.9",
            },
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (after one warm-up round)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the list of cases this many times, interleaved; medians over the runs",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads in every case (default: PyTorch's, one per core)"
    )
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="CASE=PYTHON",
        help="interpreter for a case (e.g. pfl=/path/to/venv/bin/python)",
    )
    parser.add_argument("--output", default="cross_device_cnn", help="name of the JSON file in benchmarks/results/")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.case:
        start = time.perf_counter()
        result = CASES[args.case](1, args.rounds)
        emit(
            {
                "case": args.case,
                **result,
                "threads": torch.get_num_threads(),
                "wall_s": round(time.perf_counter() - start, 1),
            }
        )
        return
    pythons = dict(item.split("=", 1) for item in args.python)
    names = args.cases.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.repeat):
        for name in names:
            threads = ("--threads", str(args.threads)) if args.threads else ()
            runs[name].append(
                run_case(
                    "benchmarks.cross_device_cnn",
                    name,
                    "--rounds",
                    str(args.rounds),
                    *threads,
                    python=pythons.get(name),
                )
            )
            path = save(
                {n: rs for n, rs in runs.items() if rs}, args.repeat, args.output
            )  # after every case: a cut-off run keeps what it measured
    print(path.read_text())


if __name__ == "__main__":
    main()
