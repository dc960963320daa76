"""Time to a target: the first evaluation at which a metric reaches a value, and what it cost.

The columns of Yang, Fang & Liu (ICLR 2021), Table 2: rounds, communication per participating
worker (MB of fp32, up + down) and wall-clock (measured local computation plus communication at
``run.bandwidth_mib_s``) until the test accuracy first reaches ε. A metric is only known at
evaluations, so the round is the first *evaluated* round at or past the target (``run.eval_every = 1``
gives it exactly).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedshuffle import metrics
from fedshuffle.core.errors import ConfigError, did_you_mean
from fedshuffle.experiments.results import read_metrics


@dataclass(frozen=True)
class Target:
    """``metric`` reaching ``value`` (from above for metrics where lower is better, else from below)."""

    metric: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        name, sep, value = text.partition("=")
        if not sep:
            raise ConfigError("--target", f"expected METRIC=VALUE (e.g. test_accuracy=0.95), got {text!r}")
        if name not in metrics.METRICS or metrics.METRICS[name].defaults["kind"] == "cost":
            accepted = metrics.of_kind("model", "method")
            raise ConfigError(
                "--target", f"unknown metric {name!r}{did_you_mean(name, accepted)}; accepted: {', '.join(accepted)}"
            )
        try:
            number = float(value)
        except ValueError:
            raise ConfigError("--target", f"the value of {name} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError("--target", f"the value of {name} must be finite, got {value!r}")
        return cls(name, number)

    def first_row(self, column: np.ndarray) -> int | None:
        """Index of the first row whose value reaches the target, or ``None``."""
        better_high = metrics.METRICS[self.metric].defaults["better"] == "max"
        with np.errstate(invalid="ignore"):
            reached = column >= self.value if better_high else column <= self.value
        hits = np.flatnonzero(reached & np.isfinite(column))
        return int(hits[0]) if hits.size else None


COLUMNS = ("round", "mib", "wallclock_seconds", "compute_seconds")


def time_to_target(metric_files: Sequence, target: Target) -> list[dict[str, float] | None]:
    """Per run: round, MiB (up + down per worker), wall-clock and computation seconds at the first hit."""
    out: list[dict[str, float] | None] = []
    for path in metric_files:
        table = read_metrics(path)
        row = target.first_row(table[target.metric])
        if row is None:
            out.append(None)
            continue
        out.append(
            {
                "round": float(table["round"][row]),
                "mib": float(table["mib_up"][row] + table["mib_down"][row]),
                "wallclock_seconds": float(table["wallclock_seconds"][row]),
                "compute_seconds": float(table["compute_seconds"][row]),
            }
        )
    return out


def target_table(groups: Mapping[str, Sequence], target: Target) -> tuple[list[str], list[list[str]]]:
    """Columns and one row per group: mean (± std) over the seeds that reached the target of each cost, and how many
    did."""
    rows = []
    for name, files in groups.items():
        hits = time_to_target(files, target)
        reached = [h for h in hits if h is not None]
        cells = []
        for column in COLUMNS:
            values = [h[column] for h in reached if math.isfinite(h[column])]
            spread = f" ± {np.std(values):.2g}" if len(values) > 1 else ""
            cells.append(f"{np.mean(values):.4g}{spread}" if values else "—")
        rows.append([name, *cells, f"{len(reached)} of {len(hits)}"])
    return [
        "variant",
        f"rounds to {target.metric} = {target.value:g}",
        "MiB per worker (up + down)",
        "wall-clock (s)",
        "computation (s)",
        "reached",
    ], rows
