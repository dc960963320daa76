"""Benchmark 7 — what a Ray round costs as the dataset grows while the round's work stays the same.

Logistic regression, d = 100, fp64; clients of 500 samples each (400 KB of features), so the dataset
is 8, 80 or 400 MB (20, 200 or 1,000 clients); every round the same work: FedAvg, a cohort of 10
clients, 2 local steps of batch 10. Each size runs on the Ray executor (2 workers, a local Ray bound
to 127.0.0.1 and shut down when the case ends) and on the in-process vectorized executor; the
per-round overhead of Ray is the difference of their median seconds per round. The time to start
(Ray, and putting the data in its object store) is reported apart as ``setup_s``.

    python -m benchmarks.ray_data [--label after]     # merges the label's cases into benchmarks/results/ray_data.json
    python -m benchmarks.ray_data --smoke OUT.json    # seconds: one 0.8 MB dataset, 3 rounds, OUT.json

Run it once per source tree (``PYTHONPATH=…/src``) with its own label to compare two versions.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS, emit, machine, run_case, time_rounds, write
from fedshuffle import LogisticRegression, Simulation, UniformWithoutReplacement, build_algorithm
from fedshuffle.data import FederatedDataset, objective_weights
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.executors.ray import RayExecutor

DIM, CLIENT_SIZE, COHORT, WORKERS = 100, 500, 10, 2
SIZES_MB = (8, 80, 400)
SETUP = {
    "problem": f"logistic regression, d = {DIM}, fp64",
    "client_size": CLIENT_SIZE,
    "cohort": COHORT,
    "local": "FedAvg, 2 steps of batch 10",
    "ray": f"local instance of {WORKERS} workers started by the executor, bound to 127.0.0.1",
    "threads": 1,
}


def dataset(megabytes: float, seed: int = 0) -> FederatedDataset:
    """Clients of ``CLIENT_SIZE`` samples, ``megabytes`` MB of features in all (10⁶ bytes)."""
    clients = max(COHORT, round(megabytes * 1e6 / (CLIENT_SIZE * DIM * 8)))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(clients * CLIENT_SIZE, DIM, generator=gen, dtype=torch.float64)
    y = torch.where(x[:, 0] + 0.5 * torch.randn(len(x), generator=gen, dtype=torch.float64) > 0, 1.0, -1.0).to(
        torch.float64
    )
    parts = np.split(np.arange(len(x)), clients)
    return FederatedDataset(x, y, parts, objective_weights(np.full(clients, CLIENT_SIZE), "size"))


def measure(megabytes: float, executor_name: str, warmup: int, repeats: int) -> dict:
    """Seconds per round (and to start) of one executor on one dataset size; Ray is always shut down."""
    torch.set_num_threads(1)
    data = dataset(megabytes)
    executor = VectorizedExecutor() if executor_name == "vectorized" else RayExecutor(workers=WORKERS)
    try:
        alg = build_algorithm("fedavg", {"local": {"lr": 0.05, "steps": 2, "batch_size": 10}})
        sim = Simulation(
            LogisticRegression(DIM, 1e-3),
            data,
            alg,
            UniformWithoutReplacement(data.num_clients, COHORT),
            seed=0,
            executor=executor,
        )
        started = time.perf_counter()
        sim.step()  # starts Ray and puts the data in its object store
        setup = time.perf_counter() - started
        timed = time_rounds(sim.step, warmup, repeats)
    finally:
        close = getattr(executor, "close", None)
        if close is not None:
            close()
    return {"megabytes": megabytes, "clients": data.num_clients, "executor": executor_name, "setup_s": setup, **timed}


def case(name: str, warmup: int = 3, repeats: int = 20) -> None:
    """``<MB>-<executor>``, e.g. ``80-ray``."""
    megabytes, executor_name = name.split("-")
    emit({"case": name, **measure(float(megabytes), executor_name, warmup, repeats)})


def overheads(cases: dict[str, dict]) -> dict[str, float]:
    """Ray's median s/round minus the vectorized executor's, per dataset size."""
    out = {}
    for mb in SIZES_MB:
        ray, local = cases.get(f"{mb}-ray", {}), cases.get(f"{mb}-vectorized", {})
        if "median_s" in ray and "median_s" in local:
            out[str(mb)] = ray["median_s"] - local["median_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case")
    parser.add_argument("--label", default="current", help="the name this source tree's cases are stored under")
    parser.add_argument(
        "--smoke", type=Path, help="a seconds-long check: one 0.8 MB dataset, 3 rounds; JSON to this file"
    )
    args = parser.parse_args()
    if args.case:
        case(args.case)
        return
    if args.smoke:
        # the first round (Ray started, the data put) is the warm-up: 3 rounds in all
        result = {name: measure(0.8, name, warmup=0, repeats=2) for name in ("vectorized", "ray")}
        args.smoke.write_text(json.dumps({"setup": SETUP, "machine": machine(), "cases": result}, indent=2))
        return
    cases = {
        f"{mb}-{name}": run_case("benchmarks.ray_data", f"{mb}-{name}")
        for mb in SIZES_MB
        for name in ("vectorized", "ray")
    }
    previous = RESULTS / "ray_data.json"
    labels = json.loads(previous.read_text()).get("labels", {}) if previous.exists() else {}
    labels[args.label] = {"cases": cases, "ray_overhead_s_per_round": overheads(cases)}
    path = write("ray_data", {"setup": SETUP, "labels": labels})
    print(path.read_text())


if __name__ == "__main__":
    main()
