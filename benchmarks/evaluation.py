"""Evaluation at the rate of its arithmetic: one evaluation of a preset's model (the train metrics on the rows that
clients hold, the test metrics on the test set: :class:`fedshuffle.metrics.ModelScores`) against the bare forward pass
of the same rows at the same shapes, in 1,024-row chunks of contiguous samples (the reference: nothing but the layers;
for presets of the MLP, whose layers :meth:`~fedshuffle.problems.MLP.logits` runs).

    FEDSHUFFLE_DATA=../shared/data python -m benchmarks.evaluation [--preset yang-fig1-2nn-cpu] [--repeats 7]

Cases, interleaved within each repeat (one operator thread, as a run of a closed-form problem takes):

* ``evaluation`` — ``ModelScores(problem, data, gradient=run.grad_norm)(x)``, chunks sized by the problem;
* ``one_chunk`` — the same with every sample in one chunk (how evaluation ran before it was chunked);
* ``forward_1024`` — the forward pass alone over the same rows, gathered once beforehand, in chunks of 1,024.

Writes ``benchmarks/results/evaluation.json`` with the medians and ``evaluation_over_forward`` (goal ≤ 1.15), also as
the median of the ratios within each repeat (``_paired``: on a shared machine, the steadier figure).
``--smoke``: a small synthetic MLP, prints the JSON, writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.common import write

SMOKE = {
    "problem": {"name": "mlp", "hidden": [16]},
    "data": {"source": "synthetic", "samples": 600, "features": 20, "classes": 4, "partition": "equal", "clients": 7},
    "local": {"lr": 0.1},
    "run": {"rounds": 1, "dtype": "float32"},
}


def build(preset: str | None) -> tuple[Any, Any, Any, bool, torch.dtype]:
    """(problem, data cast to the run's dtype, initial model, gradient asked for, dtype) of the preset's first
    variant at seed 0."""
    from fedshuffle.experiments.build import build_problem_and_data
    from fedshuffle.experiments.runner import DTYPES, seeded
    from fedshuffle.experiments.schema import RunSpec, load_experiment

    spec = seeded(next(iter(load_experiment(preset).runs({})))[1], 0) if preset else RunSpec.model_validate(SMOKE)
    problem, data = build_problem_and_data(spec)
    dtype = DTYPES[spec.run.dtype]
    data = data.to(dtype)
    params = problem.init_params(torch.Generator().manual_seed(0), dtype)
    return problem, data, params, spec.run.grad_norm, dtype


def forward(problem: Any, pieces: list[torch.Tensor], features: torch.Tensor, chunk: int) -> None:
    for k in range(0, features.shape[0], chunk):
        problem.logits(pieces, features[k : k + chunk])


def measure(preset: str | None, repeats: int) -> dict[str, Any]:
    from fedshuffle import metrics

    torch.set_num_threads(1)
    problem, data, params, gradient, dtype = build(preset)
    evaluator = metrics.ModelScores(problem, data, gradient=gradient)
    held = data.features if evaluator.rows is None else data.features[evaluator.rows]
    scored = [held.contiguous()] + ([data.test_features.contiguous()] if data.test_features is not None else [])
    pieces = problem.split(params)
    cases = {
        "evaluation": lambda: evaluator(params),
        "one_chunk": lambda: _in_one_chunk(problem, lambda: evaluator(params)),
        "forward_1024": lambda: [forward(problem, pieces, x, 1024) for x in scored],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.no_grad():
        for name, case in cases.items():
            case()  # warm-up
        for r in range(repeats):
            for name in list(cases) if r % 2 == 0 else list(cases)[::-1]:
                start = time.perf_counter()
                cases[name]()
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "setup": {
            "preset": preset or "smoke",
            "problem": problem.name,
            "dtype": str(dtype).removeprefix("torch."),
            "gradient": gradient,
            "train_rows": int(data.features.shape[0]),
            "held_rows": int(held.shape[0]),
            "test_rows": 0 if data.test_features is None else int(data.test_features.shape[0]),
            "chunk_rows": problem.chunk_rows(data.features),
            "threads": 1,
            "repeats": repeats,
        },
        "cases": {
            # four significant digits: the smoke case's passes last tens of microseconds, which round(…, 4) made 0
            name: {
                "median_s": float(f"{m:.4g}"),
                "min_s": float(f"{min(times[name]):.4g}"),
                "max_s": float(f"{max(times[name]):.4g}"),
            }
            for name, m in medians.items()
        },
        "ratios": {
            "evaluation_over_forward": round(medians["evaluation"] / medians["forward_1024"], 3),
            "one_chunk_over_forward": round(medians["one_chunk"] / medians["forward_1024"], 3),
            "evaluation_over_forward_paired": _paired(times["evaluation"], times["forward_1024"]),
            "one_chunk_over_forward_paired": _paired(times["one_chunk"], times["forward_1024"]),
        },
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }


def _paired(case: list[float], reference: list[float]) -> float:
    """The median over repeats of the ratio of the two cases' times within each repeat (each pair ran back to back,
    so a change of the machine's load between repeats cancels)."""
    return round(statistics.median(a / b for a, b in zip(case, reference)), 3)


def _in_one_chunk(problem: Any, evaluate: Any) -> Any:
    """``evaluate()`` with the problem scoring every sample in one chunk (its own method hidden for the call)."""
    problem.chunk_rows = lambda features: max(1, features.shape[0])
    try:
        return evaluate()
    finally:
        del problem.chunk_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="yang-fig1-2nn-cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="a small synthetic MLP; prints the result, writes nothing")
    args = parser.parse_args()
    if args.smoke:
        print(json.dumps(measure(None, 3)))
        return
    result = measure(args.preset, args.repeats)
    result["goal"] = {"evaluation_over_forward": "<= 1.15"}
    print(write("evaluation", result))


if __name__ == "__main__":
    main()
