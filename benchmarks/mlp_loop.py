"""The MLP's local loop: the compiled backend (fedshuffle.local.fused) against the torch loop, for the MLP shapes of the
presets — where each is faster decides ``fused.MLP_STEP_LIMIT``.

    python -m benchmarks.mlp_loop [--repeats 3] [--smoke]

One round's local work of a cohort (plain SGD and SGD with FedCDR's prox term), run by
``fedshuffle.local.loop.run_local`` with ``compiled`` off and forced on, the two interleaved, one operator thread:

* ``fedcdr-synthetic``: FedCDR's 60-32-10 MLP, batch 10, 20 epochs, a cohort of 25 of FedProx's Synthetic sizes
  (⌊LogNormal(4, 2)⌋ + 50, at most 3,000);
* ``fedcdr-femnist``: the 784-128-26 MLP, batch 10, 20 epochs, 21 clients of 50 to 400 samples;
* ``2nn``: Yang et al.'s 784-200-200-10, batch 50, 5 epochs of 600 samples, cohort 10.

Each case records the largest difference between the two loops' updates, relative to the largest update (float32
rounding over the round's steps). Prints and writes ``benchmarks/results/mlp_loop.json``; ``--smoke``: every case cut to
a few steps, once, printed, nothing
written (the test of this benchmark).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import write
from fedshuffle.local import fused
from fedshuffle.local.loop import LocalWork, run_local
from fedshuffle.local.plan import ClientPlan
from fedshuffle.local.steps import Prox, StepChain
from fedshuffle.problems.networks import MLP

#: name: (features, hidden, classes, batch, epochs, client sizes)
CASES = {
    "fedcdr-synthetic": (60, [32], 10, 10, 20, lambda rng: np.minimum(np.floor(rng.lognormal(4, 2, 25)) + 50, 3000)),
    "fedcdr-femnist": (784, [128], 26, 10, 20, lambda rng: rng.integers(50, 400, 21)),
    "2nn": (784, [200, 200], 10, 50, 5, lambda rng: np.full(10, 600)),
}


def cohort(name: str, smoke: bool) -> tuple[MLP, torch.Tensor, torch.Tensor, list[ClientPlan]]:
    """The case's problem, data and one round's plans (each client's epochs of shuffled minibatches)."""
    features, hidden, classes, batch, epochs, sizes = CASES[name]
    rng = np.random.default_rng(0)
    sizes = sizes(rng).astype(int)
    if smoke:
        sizes, epochs = np.minimum(sizes[:4], 2 * batch), 1
    total = int(sizes.sum())
    x = torch.from_numpy(rng.standard_normal((total, features)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, classes, total))
    plans, first = [], 0
    for client, size in enumerate(sizes):
        steps = -(-size // batch)
        rows = np.full((epochs * steps, batch), -1, dtype=np.int64)
        for e in range(epochs):
            order = first + rng.permutation(size)
            for s in range(steps):
                chunk = order[s * batch : (s + 1) * batch]
                rows[e * steps + s, : len(chunk)] = chunk
        plans.append(ClientPlan(client, rows, 0.01, epochs * steps, float(epochs * steps)))
        first += size
    return MLP(features, hidden, classes), x, y, plans


def measure(name: str, repeats: int, smoke: bool) -> dict[str, Any]:
    problem, x, y, plans = cohort(name, smoke)
    start = problem.init_params(torch.Generator().manual_seed(0), torch.float32)
    out: dict[str, Any] = {
        "parameters": problem.dim,
        "member_steps": int(sum(p.steps for p in plans)),
        "longest": max(p.steps for p in plans),
    }
    for chain_name, chain in (("sgd", StepChain()), ("prox", StepChain([Prox(0.01)]))):
        work = LocalWork(plans, start, chain)
        kinds = {"torch": lambda: run_local(problem, x, y, work), "compiled": lambda: fused.run(problem, x, y, work)}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        reference, compiled = (
            kinds["torch"](),
            kinds["compiled"](),
        )  # the first call also loads (or compiles) the kernel
        difference = float((compiled - reference).abs().max() / reference.abs().max())
        for _ in range(repeats):
            for kind, call in kinds.items():
                begin = time.perf_counter()
                call()
                times[kind].append(time.perf_counter() - begin)
        medians = {kind: statistics.median(t) for kind, t in times.items()}
        out[chain_name] = {
            **{f"{k}_s": round(v, 4) for k, v in medians.items()},
            "compiled_over_torch": round(medians["compiled"] / medians["torch"], 3),
            "max_relative_difference": difference,
        }
    out["chosen"] = "compiled" if fused.usable(problem, x, LocalWork(plans, start)) else "torch"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if fused.numba is None:
        raise SystemExit("numba is not installed: pip install 'fedshuffle[fast]'")
    torch.set_num_threads(1)
    repeats = 1 if args.smoke else args.repeats
    result = {
        "setup": {"repeats": repeats, "threads": 1, "dtype": "float32", "step_limit": fused.MLP_STEP_LIMIT},
        "cases": {name: measure(name, repeats, args.smoke) for name in CASES},
    }
    if args.smoke:
        print(json.dumps(result))
        return
    path = write("mlp_loop", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
