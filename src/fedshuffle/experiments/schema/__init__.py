"""The configuration schema: one validated section per part of a round, TOML loading, variants, overrides.

An experiment file has the sections ``[method]``, ``[local]``, ``[aggregation]``, ``[server]``,
``[schedule]``, ``[privacy]``, ``[sampler]``, ``[problem]``, ``[data]``, ``[run]`` and ``[plot]``, metadata in
``[experiment]`` (name, paper, figure, seeds), and optional ``[[variants]]``: each has a ``label`` and
partial sections that override the base (e.g. ``method = {name = "fednova"}``). A run's sections are
the method's registered defaults (:data:`fedshuffle.methods.METHODS`), then the base, then the
variant, then command-line overrides. Unknown keys are errors with a "did you mean" hint.

The modules: :mod:`~fedshuffle.experiments.schema.base` (a section, and a section that chooses a registered part),
:mod:`~fedshuffle.experiments.schema.sections` (the sections of a run and :class:`RunSpec`),
:mod:`~fedshuffle.experiments.schema.tuning` (a variant's tuning protocol),
:mod:`~fedshuffle.experiments.schema.experiment` (the experiment, its variants and runs),
:mod:`~fedshuffle.experiments.schema.overrides` (``--set`` and merging sections),
:mod:`~fedshuffle.experiments.schema.loading` (TOML files and presets) and
:mod:`~fedshuffle.experiments.schema.names` (names that become folder names).
"""

from fedshuffle.core.validation import validate
from fedshuffle.experiments.schema.base import Theory
from fedshuffle.experiments.schema.experiment import Experiment, ExperimentMeta, Variant
from fedshuffle.experiments.schema.loading import MAX_CONFIG_BYTES, PRESETS_DIR, load_experiment, preset_names
from fedshuffle.experiments.schema.names import name_problem, slug
from fedshuffle.experiments.schema.overrides import MAX_VALUE_CHARS, _merge_parts, parse_overrides
from fedshuffle.experiments.schema.sections import (
    SECTIONS,
    AggregationConfig,
    Axis,
    DataConfig,
    LocalConfig,
    MethodConfig,
    Metric,
    PlotConfig,
    PrivacyConfig,
    ProblemConfig,
    RunConfig,
    RunSpec,
    SamplerConfig,
    ScheduleConfig,
    ServerConfig,
    _deep_merge,
)
from fedshuffle.experiments.schema.tuning import MAX_TUNING_POINTS, TuneConfig

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_TUNING_POINTS",
    "MAX_VALUE_CHARS",
    "PRESETS_DIR",
    "SECTIONS",
    "AggregationConfig",
    "Axis",
    "DataConfig",
    "Experiment",
    "ExperimentMeta",
    "LocalConfig",
    "MethodConfig",
    "Metric",
    "PlotConfig",
    "PrivacyConfig",
    "ProblemConfig",
    "RunConfig",
    "RunSpec",
    "SamplerConfig",
    "ScheduleConfig",
    "ServerConfig",
    "Theory",
    "TuneConfig",
    "Variant",
    "_deep_merge",
    "_merge_parts",
    "load_experiment",
    "name_problem",
    "parse_overrides",
    "preset_names",
    "slug",
    "validate",
]
