"""Where a claim or a tuning reads a run's curve: which metric, and at which point of the run.

A reading is a metric (a ``model`` or ``method`` metric of :data:`fedshuffle.metrics.METRICS`) and a
place: ``final`` (the last evaluation), ``best``, ``last:F`` (the mean over the last fraction F of the
run), ``auc`` (the mean over the run), ``progress:F`` (a speed: the rounds the curve takes to make the fraction F of
its own improvement, whatever level it settles at), or a budget ``round=N``, ``epochs=X``, ``mib=X`` (MiB per worker,
up + down). The claims (:mod:`fedshuffle.experiments.claims`) and the ``[[tune]]`` tables of an
experiment file (:mod:`fedshuffle.experiments.schema`) both check theirs here.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator

from fedshuffle import metrics
from fedshuffle.core.errors import did_you_mean

#: budgets a value can be read at: ``round=N``, ``epochs=X``, ``mib=X`` (MiB per worker, up + down)
BUDGET_AXES = ("round", "epochs", "mib")


def valid_metric(name: str) -> str:
    """``name`` if it is a metric a claim or a tuning can read (a model or method metric), else ValueError naming
    the accepted ones."""
    accepted = metrics.of_kind("model", "method")
    if name not in accepted:
        raise ValueError(f"unknown metric {name!r}{did_you_mean(str(name), accepted)}; accepted: {', '.join(accepted)}")
    return name


def valid_at(at: str) -> str:
    """``at`` if it is a place to read a curve at (see the module docstring), else ValueError naming the accepted
    forms."""
    if at in ("final", "best", "auc"):
        return at
    for prefix, example in (("last:", "last:0.25"), ("progress:", "progress:0.9")):
        if at.startswith(prefix):
            try:
                fraction = float(at.removeprefix(prefix))
            except ValueError:
                fraction = math.nan
            if not 0 < fraction <= 1:
                raise ValueError(f"{prefix}F takes a fraction 0 < F <= 1, e.g. {example}")
            return at
    axis, sep, number = at.partition("=")
    try:
        ok = bool(sep) and axis in BUDGET_AXES and math.isfinite(float(number)) and float(number) >= 0
    except ValueError:
        ok = False
    if not ok:
        budgets = ", ".join(a + "=N" for a in BUDGET_AXES)
        raise ValueError(
            "expected final, best, last:F (mean over the last fraction F of the run), auc, "
            f"progress:F (rounds to the fraction F of the curve's own improvement), or a budget {budgets}"
        )
    return at


#: a pydantic field type: a metric checked by :func:`valid_metric`
Metric = Annotated[str, AfterValidator(valid_metric)]
#: a pydantic field type: a place checked by :func:`valid_at`
At = Annotated[str, AfterValidator(valid_at)]
