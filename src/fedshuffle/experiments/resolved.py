"""What ``fedshuffle show`` prints of an experiment: each variant's resolved settings with the seeds that will run,
and what each variant changes from the base.

A variant's resolved settings are the method's defaults ← the base ← the variant ← the overrides
(:meth:`~fedshuffle.experiments.schema.Experiment.runs`). The seeds a run uses are the overrides' ``run.seed``
when given (it then runs alone), else ``[experiment] seeds``, else ``run.seed``: the view shows them as
``run.seeds`` where the settings hold ``run.seed``, so that what is shown is what runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.validation import validate
from fedshuffle.experiments.schema import SECTIONS, Experiment, RunSpec, _merge_parts
from fedshuffle.experiments.sinks import flatten

#: the column of the base's settings in :func:`differences`
BASE = "base"


def seeds_to_run(experiment: Experiment, spec: RunSpec, overrides: Mapping[str, Mapping[str, Any]]) -> list[int]:
    """The seeds ``fedshuffle run`` runs for ``spec``: an overridden ``run.seed`` alone, else the experiment's seeds."""
    if "seed" in overrides.get("run", {}):
        return [int(overrides["run"]["seed"])]
    return list(experiment.seeds(spec))


def with_seeds(settings: Mapping[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    """``settings`` (a dumped :class:`RunSpec`) with ``run.seed`` replaced, in place, by ``run.seeds``."""
    run = {
        ("seeds" if key == "seed" else key): (list(seeds) if key == "seed" else value)
        for key, value in settings["run"].items()
    }
    return {**settings, "run": run}


def resolved(experiment: Experiment, overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """label (``"run"`` without variants) → the variant's resolved settings, ``run.seeds`` included."""
    return {
        label or "run": with_seeds(spec.model_dump(mode="json"), seeds_to_run(experiment, spec, overrides))
        for label, spec in experiment.runs(overrides)
    }


def base_settings(experiment: Experiment, overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The base's resolved settings (no variant applied), or None where the base alone is no valid run
    (a variant completes it)."""
    merged = _merge_parts({s: getattr(experiment, s) for s in SECTIONS}, overrides)
    try:
        spec = validate(RunSpec, merged)
    except ConfigError:
        return None
    return with_seeds(spec.model_dump(mode="json"), seeds_to_run(experiment, spec, overrides))


def differences(experiment: Experiment, overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``section.setting`` → {column → value} for every setting on which the base and the variants do not all agree;
    the columns are :data:`BASE` (when the base alone is a valid run) and each variant's label. A setting a
    column lacks (another method's own setting, say) is missing from that column's values."""
    columns = {label: flatten(settings) for label, settings in resolved(experiment, overrides).items()}
    base = base_settings(experiment, overrides)
    if base is not None:
        columns = {BASE: flatten(base), **columns}
    keys = list(dict.fromkeys(key for flat in columns.values() for key in flat))
    out = {}
    for key in keys:
        values = {label: flat[key] for label, flat in columns.items() if key in flat}
        if len(values) < len(columns) or any(v != next(iter(values.values())) for v in values.values()):
            out[key] = values
    return out
