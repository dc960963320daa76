"""The compiled local loop (fedshuffle.local.fused) knows every step transform or says which one keeps a run on
the torch loop."""

import inspect
import logging
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fedshuffle import LogisticRegression
from fedshuffle.local import fused, steps
from fedshuffle.local.loop import LocalWork, run_local
from fedshuffle.local.plan import ClientPlan
from fedshuffle.local.steps import Clip, StepChain


def test_every_step_transform_has_a_compiled_formula_or_is_listed_as_torch_only():
    transforms = [
        cls
        for name, cls in inspect.getmembers(steps, inspect.isclass)
        if cls.__module__ == steps.__name__
        and not name.startswith("_")
        and hasattr(cls, "update")
        and cls is not steps.StepChain
        and not getattr(cls, "_is_protocol", False)
    ]
    assert len(transforms) >= 6
    missing = [
        cls.__name__ for cls in transforms if cls not in fused.COMPILED_TRANSFORMS and cls not in fused.TORCH_ONLY
    ]
    assert missing == [], f"transforms without a compiled formula, not listed in fused.TORCH_ONLY: {missing}"
    assert not set(fused.COMPILED_TRANSFORMS) & set(fused.TORCH_ONLY)


@dataclass(frozen=True)
class Halve:
    """A user's transform the compiled loop does not know: g ← g/2."""

    needs_center_gradient = False

    def init(self, start):
        return {}

    def a_l1(self, steps, lr, inner):
        return inner / 2

    def update(self, d, d_x, state, step):
        return d / 2, d_x


def test_a_transform_without_a_compiled_formula_runs_on_torch_and_says_so_once(caplog):
    """Logistic regression in float64 runs compiled; a chain with an unknown transform runs the torch loop — the
    same Δ as the torch loop asked for directly — and the run is told once which transform kept it there."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(0)
    problem = LogisticRegression(3, 0.0)
    x = torch.from_numpy(rng.standard_normal((40, 3)))
    y = torch.from_numpy(rng.integers(0, 2, 40).astype(np.float64))
    plans = [ClientPlan(c, rng.integers(0, 40, (steps, 2)), 0.1, steps, float(steps)) for c, steps in enumerate((5, 3))]
    start = torch.zeros(2, 3, dtype=torch.float64)
    assert fused.torch_reason(problem, x, LocalWork(plans, start, StepChain([Clip(1.0)]))) is None
    work = LocalWork(plans, start, StepChain([Clip(1.0), Halve()]))
    fallback = fused.torch_reason(problem, x, work)
    assert fallback is not None and fallback.part == "transform" and "Halve" in fallback.why
    with caplog.at_level(logging.WARNING, logger="fedshuffle"):
        compiled = run_local(problem, x, y, work, compiled=True)
        run_local(problem, x, y, work, compiled=True)
    assert torch.equal(compiled, run_local(problem, x, y, work))
    said = [r.getMessage() for r in caplog.records if "not compiled" in r.getMessage()]
    assert said == [
        "the local loop runs on PyTorch operators, not compiled: the local step transform Halve has no compiled formula"
    ]


def test_a_problem_without_a_compiled_gradient_is_not_reported():
    """A network the compiled loop never runs (its steps are the torch loop's job) is no fallback to report."""
    pytest.importorskip("numba")
    from fedshuffle import MLP

    wide = MLP(784, [200, 200], 10)
    work = LocalWork([ClientPlan(0, np.zeros((2, 50), dtype=np.int64), 0.1, 2, 2.0)], torch.zeros(wide.dim))
    fallback = fused.torch_reason(wide, torch.zeros(1, 784), work)
    assert fallback is not None and fallback.part == "problem"
