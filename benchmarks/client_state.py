"""Client state at cross-device scale: SCAFFOLD and FedCDR with 1,000 vs 1,000,000 clients.

L2 logistic regression with d = 1,000 (clients generated when sampled), cohorts of 100, fp32, the
vectorized executor, one local epoch of batch 10 (FedCDR: the prox by one such epoch), a checkpoint of
the client state every 10 rounds. The state — SCAFFOLD's c_i, FedCDR's (y_i, x_i, x̂_i) — is 4 GB and
12 GB at 1,000,000 clients, so it lives in sparse memory-mapped files; at 1,000 clients in memory.
Reports seconds per round and peak resident memory.

    python -m benchmarks.client_state      # writes benchmarks/results/client_state.json
    # 200 and 20,000 clients, 3 rounds (a checkpoint at the second): prints the JSON, writes nothing
    python -m benchmarks.client_state --smoke
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
import torch

from benchmarks.common import emit, run_case, time_rounds, write
from benchmarks.convex import lognormal_sizes
from fedshuffle import Cyclic, LogisticRegression, Simulation, build_algorithm
from fedshuffle.data import LazyFederatedDataset, objective_weights
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.core.streams import Stream, generator

DIM, COHORT = 1000, 100
METHODS = ("scaffold", "fedcdr")
POPULATIONS, SMOKE_POPULATIONS = (1_000, 1_000_000), (200, 20_000)
CASES = [f"{method}-{n}" for method in METHODS for n in (*POPULATIONS, *SMOKE_POPULATIONS)]
#: rounds between checkpoints of the client state (the smoke case's few rounds include one)
CHECKPOINT_EVERY, SMOKE_CHECKPOINT_EVERY = 10, 2
#: the smoke case's in-memory limit of the client state: its larger population's state is memory-mapped, as the full
#: benchmark's 1,000,000 clients' is beyond the default 1 GiB
SMOKE_STATE_MEMORY_LIMIT = 16 << 20


class SparseClients:
    def __init__(self, sizes: np.ndarray) -> None:
        self.sizes = sizes
        self.plane = np.random.default_rng(0).normal(size=DIM)

    def __call__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rng = generator(0, Stream.PARTITION, i)
        x = (rng.random((int(self.sizes[i]), DIM)) < 0.05).astype(np.float32)
        return x, np.where(x @ self.plane > 0, 1.0, -1.0).astype(np.float32)


def case(
    name: str, warmup: int, repeats: int, checkpoint_every: int = CHECKPOINT_EVERY, memory_limit: int | None = None
) -> None:
    torch.set_num_threads(1)
    method, n = name.split("-")
    clients = int(n)
    sizes = lognormal_sizes(clients, np.random.default_rng(0))
    data = LazyFederatedDataset(
        sizes, objective_weights(sizes, "uniform"), SparseClients(sizes), (DIM,), dtype=torch.float32
    )
    settings = {"local": {"lr": 0.05, "epochs": 1, "batch_size": 10}} | (
        {"method": {"exact_prox": False, "eta": 10.0}} if method == "fedcdr" else {}
    )
    with tempfile.TemporaryDirectory() as folder:
        sim = Simulation(
            LogisticRegression(DIM, 1e-4),
            data,
            build_algorithm(method, settings),
            Cyclic(clients, COHORT),
            seed=0,
            dtype=torch.float32,
            executor=VectorizedExecutor(),
            state_dir=folder,
            **({"state_memory_limit": memory_limit} if memory_limit else {}),
        )

        checkpoints = 0

        def round_with_checkpoints():
            nonlocal checkpoints
            sim.step()
            if sim.counters.rounds % checkpoint_every == 0:
                sim.state_dict()
                sim.commit_checkpoint()
                checkpoints += 1

        timing = time_rounds(round_with_checkpoints, warmup, repeats)
        emit(
            {
                "case": name,
                "clients": clients,
                "method": method,
                **timing,
                "memory_mapped": sim.store.mapped,
                "state_bytes_full": int(clients * sum(sim.store.fields.values()) * 4),
                "clients_with_state": int(sim.store.created.sum()),
                "checkpoints": checkpoints,
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="small populations, 3 rounds with a checkpoint; prints the JSON, writes nothing",
    )
    args = parser.parse_args()
    warmup, repeats = (1, 2) if args.smoke else (5, 40)
    every = SMOKE_CHECKPOINT_EVERY if args.smoke else CHECKPOINT_EVERY
    if args.case:
        case(args.case, warmup, repeats, every, SMOKE_STATE_MEMORY_LIMIT if args.smoke else None)
        return
    small, large = SMOKE_POPULATIONS if args.smoke else POPULATIONS
    results = {
        f"{m}-{n}": run_case("benchmarks.client_state", f"{m}-{n}", *(["--smoke"] if args.smoke else []))
        for m in METHODS
        for n in (small, large)
    }
    ratios = {
        m: {
            stat: round(results[f"{m}-{large}"][stat] / results[f"{m}-{small}"][stat], 2)
            for stat in ("median_s", "mean_s", "cpu_median_s")
        }
        for m in METHODS
        if all("median_s" in results[f"{m}-{n}"] for n in (small, large))
    }
    payload = {
        "setup": {
            "dim": DIM,
            "cohort": COHORT,
            "dtype": "float32",
            "local": "1 epoch, batch 10",
            "checkpoint": f"client state every {every} rounds",
            "state_memory_limit_mib": (SMOKE_STATE_MEMORY_LIMIT if args.smoke else Simulation.state_memory_limit) >> 20,
            "threads": 1,
            "warmup": warmup,
            "rounds": repeats,
        },
        "cases": results,
        f"round_time_{large}_over_{small}": ratios,
        "peak_rss_mib": {name: r.get("peak_rss_mib") for name, r in results.items()},
        "goal": "peak RSS < 2 GiB at 1,000,000 clients; round time within 1.5x of 1,000 clients",
    }
    if args.smoke:
        print(json.dumps(payload))
        return
    print(write("client_state", payload).read_text())


if __name__ == "__main__":
    main()
