"""A variant's tuning protocol (``[variants.tune]``): the grid of settings tuned over and the rule that picks the
best point."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from fedshuffle.experiments.readings import valid_at, valid_metric
from fedshuffle.experiments.schema.base import _PartSection, _Section
from fedshuffle.experiments.schema.sections import SECTIONS, RunSpec


MAX_TUNING_POINTS = 1000


def _settings_of(section: type[_Section]) -> set[str]:
    """The settings a section takes: its own fields and, where it chooses parts, every registered part's settings (the
    chosen part's are checked when each grid point's run is built)."""
    names = set(section.model_fields)
    if issubclass(section, _PartSection):
        names |= {
            n for registry in section._choosers.values() for entry in registry.entries() for n in entry.setting_names()
        }
    return names


class TuneConfig(_Section):
    """A variant's tuning protocol, as the paper states it: the grid it tuned over (``"section.setting"``
    → values; every combination is a point) and the selection rule: the point with the best mean over
    the tuning ``seeds`` of ``metric`` read ``at`` a point of the run (as a claim reads it:
    final, best, last:F, auc or a budget), over the first ``rounds`` rounds where the protocol tunes on a shorter
    horizon than it judges. The judged runs then use fresh seeds."""

    grid: dict[str, list[Any]] = Field(
        min_length=1, description='"section.setting" → the values tuned over, e.g. {"local.lr_multiplier" = [1, 2, 5]}'
    )
    metric: str = Field(description="the metric the best point is chosen by")
    at: str = Field(
        "final", description="where the metric is read: final, best, last:F, auc, round=N, epochs=X or mib=X"
    )
    seeds: list[int] = Field(min_length=1, description="tuning seeds, distinct from the judged ones")
    rounds: int | None = Field(
        None, ge=1, description="the tuning runs' horizon in rounds (default: the variant's own)"
    )

    @field_validator("grid")
    @classmethod
    def _settings(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        points = 1
        for key, values in v.items():
            section, _, setting = key.partition(".")
            if section not in SECTIONS or setting not in _settings_of(RunSpec.model_fields[section].annotation):
                raise ValueError(
                    f"{key!r} is not a setting; expected section.setting with section one of {', '.join(SECTIONS)}"
                )
            if not values:
                raise ValueError(f"{key}: give at least one value")
            points *= len(values)
        if points > MAX_TUNING_POINTS:
            raise ValueError(f"{points} grid points; at most {MAX_TUNING_POINTS}")
        return v

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        return valid_metric(v)

    @field_validator("at")
    @classmethod
    def _at(cls, v: str) -> str:
        return valid_at(v)

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if any(s < 0 for s in v) or len(set(v)) < len(v):
            raise ValueError("distinct integers >= 0")
        return v

    def points(self) -> list[dict[str, dict[str, Any]]]:
        """Every combination of the grid, as override sections: ``[{"local": {"lr_multiplier": 1}}, ...]``."""
        import itertools

        keys = list(self.grid)
        out = []
        for combo in itertools.product(*(self.grid[k] for k in keys)):
            point: dict[str, dict[str, Any]] = {}
            for key, value in zip(keys, combo):
                section, _, setting = key.partition(".")
                point.setdefault(section, {})[setting] = value
            out.append(point)
        return out
