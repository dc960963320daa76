"""Robust aggregation on the Flower server, for methods whose server half is a weighted average of the members' Δ_i.

The FedAvg family (every method that keeps :class:`~fedshuffle.methods.base.Method`'s client and server halves:
the client returns Δ_i, the server takes d = Σ_S ω_iΔ_i with the aggregator's weights ω_i) takes d as the total
weight W = Σ_S ω_i times the ω-weighted mean of the Δ_i. A robust aggregator replaces that mean, coordinate by
coordinate j, by an estimate a few outlying members cannot drag away:

* ``"median"``: d_j = W · median_i Δ_ij (Yin et al., ICML 2018), the mean of the two middle values for an even count;
* ``"trimmed-mean"``: with k = ⌊β·m⌋ of the m members cut at each end of coordinate j (the k smallest and the k
  largest Δ_ij), d_j = W · Σ_kept ω_iΔ_ij / Σ_kept ω_i; with k = 0 it is d = Σ_S ω_iΔ_i, the method's own step.

The server optimizer then takes its step from d as from the method's own aggregate. Any other method (its own
aggregation: SCAFFOLD, FedDyn, FedCDR; or a wrapper that changes each Δ_i: differential privacy) is refused, and so
is secure aggregation, where the server sees only Σ_S ν_iΔ_i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.integrations.flower.common import AppSettings
from fedshuffle.methods import METHODS
from fedshuffle.methods.base import Method

SETTING = "run-config.robust-aggregation"


def averaging_methods() -> list[str]:
    """The registered methods whose server half is Σ_S ω_iΔ_i of the members' Δ_i (Method's own halves:
    :meth:`~fedshuffle.methods.base.Method.keeps_default_halves`)."""
    return [
        entry.name
        for entry in METHODS.entries()
        if isinstance(entry.factory, type)
        and issubclass(entry.factory, Method)
        and entry.factory.keeps_default_halves()
    ]


@dataclass(frozen=True)
class RobustAggregation:
    """``how`` (``"median"`` or ``"trimmed-mean"``) and the fraction β of members cut at each end (trimmed mean)."""

    how: str
    trim: float = 0.1

    @classmethod
    def from_settings(cls, settings: AppSettings) -> RobustAggregation | None:
        """Run-config ``robust-aggregation`` and ``trim-fraction`` (None: the method's own aggregation)."""
        if settings.robust_aggregation == "none":
            return None
        return cls(settings.robust_aggregation, settings.trim_fraction)

    def check(self, method: Method, label: str, secure: bool) -> None:
        """Refuse, in one line, a method whose server half is not Σ_S ω_iΔ_i, and secure aggregation."""
        if secure:
            raise ConfigError(
                SETTING,
                f"{self.how!r} needs each member's Δ_i, and with secure-aggregation = true the server sees only their "
                'sum: set robust-aggregation = "none" or secure-aggregation = false',
            )
        if not method.sums_updates:
            raise ConfigError(
                SETTING,
                f"{label!r} runs {method.describe()}, whose server half is not a weighted average Σ ω_iΔ_i of the "
                f"members' updates; accepted methods: {', '.join(averaging_methods())} (without privacy)",
            )

    def aggregate(self, deltas: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
        """d from the members' rows ``deltas`` (m, d) and their weights ω (m,) (see the module docstring)."""
        m = deltas.shape[0]
        total = omega.sum()
        ordered, order = deltas.sort(dim=0)
        if self.how == "median":
            middle = (ordered[(m - 1) // 2] + ordered[m // 2]) / 2
            return total * middle
        k = math.floor(self.trim * m)
        if k == 0:
            return omega @ deltas
        weights = omega[order][k : m - k]
        return total * (weights * ordered[k : m - k]).sum(dim=0) / weights.sum(dim=0)
