"""The configuration schema: one validated section per part of a round, TOML loading, variants, overrides.

An experiment file has the sections ``[method]``, ``[local]``, ``[aggregation]``, ``[server]``,
``[schedule]``, ``[privacy]``, ``[sampler]``, ``[problem]``, ``[data]``, ``[run]`` and ``[plot]``, metadata in
``[experiment]`` (name, paper, figure, seeds), and optional ``[[variants]]``: each has a ``label`` and
partial sections that override the base (e.g. ``method = {name = "fednova"}``). A run's sections are
the method's registered defaults (:data:`fedshuffle.methods.METHODS`), then the base, then the
variant, then command-line overrides. Unknown keys are errors with a "did you mean" hint.
"""

from __future__ import annotations

import copy
import difflib
import re
import sys
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from fedshuffle import metrics, plugins
from fedshuffle.aggregation import DIRECTIONS, NORMALIZATIONS, TAU_EFF, WEIGHTINGS
from fedshuffle.analysis.theory import THEOREMS, THEORY_FOLLOWS
from fedshuffle.core.errors import ConfigError, did_you_mean
from fedshuffle.core.inputs import Summable, read_regular_file, usable_path_name
from fedshuffle.core.registry import Entry, Registry, Role, StepScale, StepSize, roles
from fedshuffle.core.validation import validate
from fedshuffle.data.catalog import PARTITIONS, SOURCES
from fedshuffle.executors.choice import EXECUTORS
from fedshuffle.experiments.claims import parse_claims
from fedshuffle.experiments.readings import valid_at, valid_metric
from fedshuffle.experiments.sinks import SINKS
from fedshuffle.local.plan import local_settings
from fedshuffle.methods.momentum import ESTIMATORS
from fedshuffle.samplers import SAMPLERS
from fedshuffle.schedules import SCHEDULES
from fedshuffle.server import SERVER_OPTIMIZERS, GlobalStep, chosen_optimizer
from fedshuffle.methods import METHODS
from fedshuffle.methods.algorithm import method_defaults
from fedshuffle.privacy import PrivacySettings
from fedshuffle.problems import PROBLEMS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS_DIR = Path(__file__).parent.parent / "presets"
#: bytes of a config file (the largest preset is 9 KB)
MAX_CONFIG_BYTES = 1 << 20


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def roles(self) -> dict[str, Role]:
        """The declared role of each of the section's settings that has one (:func:`fedshuffle.core.registry.roles`)."""
        return roles(type(self).model_fields)


Theory = Literal["theory"]


def _theory_or(info: FieldInfo) -> tuple[Any, FieldInfo]:
    """A declared setting as a field of its section: a step size (the role :class:`StepSize`) also takes ``'theory'``
    (resolved from the problem and data before building) and, where its part has no default, defaults to None (the
    part asks for it when it is built); its constraints bind the number."""
    role = [m for m in info.metadata if isinstance(m, (StepSize, StepScale))]
    if not any(isinstance(m, StepSize) for m in role):
        return info.annotation, info
    constraints = [m for m in info.metadata if m not in role]
    number = Annotated[(info.annotation, *constraints)] if constraints else info.annotation
    default = None if info.is_required() else info.default
    described = f"{info.description}, or 'theory' (fedshuffle.analysis.theory)"
    return Annotated[(number | Theory | None, *role)], Field(default, description=described)


def _registered(registry: Registry, value: Any, noun: str) -> str:
    """``value`` if it names an entry of ``registry`` now (parts registered after import included)."""
    if not isinstance(value, str) or value not in registry:
        hint = difflib.get_close_matches(str(value), registry.names(), n=1)
        raise ValueError(
            f"not a registered {noun}{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: {', '.join(registry)}"
        )
    return value


def _fits_file_system(v: str) -> bool:
    """Whether :func:`~fedshuffle.core.inputs.usable_path_name` takes ``v`` (a path it refuses is never looked up:
    the lookup would raise)."""
    try:
        return usable_path_name(v) is not None
    except ValueError:
        return False


def _chosen_names(value: Any) -> list[Any]:
    """The parts a chooser names: one, or a list (``run.sinks``)."""
    return list(value) if isinstance(value, list) else [value]


class _PartSection(_Section):
    """A section whose chooser (``name``, ``source``, ...) names a registered part: its other keys are that
    part's own settings, validated by the part's declared model (:mod:`fedshuffle.core.registry`) with
    its defaults filled in. A key the chosen part does not take is an error naming the part and what it
    takes. ``_choosers`` maps each chooser field (a name, or a list of names) to its registry; the section's other
    fields belong to the section."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)
    _choosers: ClassVar[dict[str, Registry]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_parts(cls, raw: Any) -> Any:
        """Each chooser names a part registered now (parts registered after import included)."""
        if isinstance(raw, Mapping):
            for chooser, registry in cls._choosers.items():
                for name in _chosen_names(raw.get(chooser)) if chooser in raw else ():
                    try:
                        _registered(registry, name, registry.noun)
                    except ValueError as exc:
                        raise ConfigError(chooser, str(exc)) from None
        return raw

    @model_validator(mode="after")
    def _chosen_parts_settings(self) -> Any:
        given = {k: v for k, v in (self.__pydantic_extra__ or {}).items() if v is not None}  # None: the part's default
        entries = self._chosen_entries()
        steps = {k for e in entries for k, role in e.roles().items() if isinstance(role, StepSize)}
        theory = {k: given.pop(k) for k in steps if given.get(k) == "theory"}  # a step size: resolved before building
        settings: dict[str, Any] = {}
        for entry in entries:
            settings.update(entry.check({k: v for k, v in given.items() if k in entry.setting_names()}, theory))
        unknown = [k for k in given if k not in settings]
        refusal = self._another_parts_setting(unknown[0], entries) if unknown else None
        if refusal is not None:
            raise refusal
        if unknown:
            if len(entries) == 1 and len(self._choosers) == 1:
                entries[0].check(given)  # raises, naming the part and what it takes
            takes = "; ".join(f"{e.noun} {e.name!r} takes {', '.join(e.setting_names()) or 'none'}" for e in entries)
            common = [k for k in type(self).model_fields if k not in self._choosers]
            parts = " or ".join(f"{e.noun} {e.name!r}" for e in entries)
            raise ConfigError(
                unknown[0],
                f"not a setting of {parts}{did_you_mean(unknown[0], [*settings, *common])}; {takes}; "
                f"the [{self._section_name()}] section also takes {', '.join(common)}",
            )
        object.__setattr__(self, "__pydantic_extra__", {**settings, **theory})
        return self

    def _another_parts_setting(self, key: str, entries: list[Entry]) -> ConfigError | None:
        """``key`` refused as a setting of parts that are not chosen, naming them and what the chosen ``entries`` take
        (None where no registered part takes it)."""
        owners = [
            (chooser, e)
            for chooser, registry in self._choosers.items()
            for e in registry.entries()
            if key in e.setting_names()
        ]
        if not owners:
            return None
        chosen = "; ".join(
            f"{e.noun} {e.name!r} takes {', '.join(e.setting_names()) or 'no settings'}" for e in entries
        )
        chooser = owners[0][0]
        unchosen = (
            f"which {self._section_name()}.{chooser} does not list"
            if isinstance(getattr(self, chooser), list)
            else "not of the chosen one"
        )
        named = ", ".join(f"{e.noun} {e.name!r}" for _, e in owners[:3])
        return ConfigError(key, f"a setting of {named}{' ...' if len(owners) > 3 else ''}, {unchosen}; {chosen}")

    @classmethod
    def _section_name(cls) -> str:
        return next(iter(cls._choosers.values())).kind.split(".")[0]

    def own_settings(self) -> dict[str, Any]:
        """The chosen parts' own settings (defaults filled in)."""
        return dict(self.__pydantic_extra__ or {})

    def roles(self) -> dict[str, Role]:
        """The declared roles of the section's own settings and of the chosen parts' settings."""
        chosen = [entry.roles() for entry in self._chosen_entries()]
        return {k: v for part in (super().roles(), *chosen) for k, v in part.items()}

    def _chosen_entries(self) -> list[Entry]:
        """The registered parts the choosers name (one per chooser, or a list of them: ``run.sinks``)."""
        return [
            registry[name]
            for chooser, registry in self._choosers.items()
            for name in _chosen_names(getattr(self, chooser))
        ]


class MethodConfig(_PartSection):
    """The method (:data:`fedshuffle.methods.METHODS`) and its own settings (its constructor's keyword parameters)."""

    _choosers: ClassVar[dict[str, Registry]] = {"name": METHODS}
    name: str = "fedshuffle"


#: What a client does: the settings of :class:`fedshuffle.local.plan.LocalPlanner`, declared once on its fields
#: (constraints, help, the step size's role), plus ``lr_multiplier``, which scales the planner's ``lr`` when built.
LocalConfig = create_model(
    "LocalConfig",
    __base__=_Section,
    __doc__="What a client does: :class:`fedshuffle.local.plan.LocalPlanner`'s settings (declared on its fields).",
    **{name: _theory_or(info) for name, info in local_settings().settings.model_fields.items()},
    lr_multiplier=(
        Annotated[float, StepScale()],
        Field(1.0, gt=0, description="multiplies the local step size (RR-CLI §4.4 tunes ×1..15 of the theory)"),
    ),
)


class AggregationConfig(_Section):
    """ω_i = w̃_i/q_i^S (:class:`fedshuffle.aggregation.Aggregator`)."""

    weighting: Annotated[Literal[WEIGHTINGS] | list[float], Summable] = "data"
    normalization: Literal[NORMALIZATIONS] = "unbiased"
    tau_eff: Literal[TAU_EFF] = "planned"
    direction: Literal[DIRECTIONS] = "model_delta"


#: RR-CLI's meta-epoch step θ, declared with the meta-epoch step (:data:`fedshuffle.server.GlobalStep`)
_GLOBAL_LR = _theory_or(FieldInfo.from_annotation(GlobalStep))


class ServerConfig(_PartSection):
    """x ← x − step(d): the server optimizer (:data:`fedshuffle.server.SERVER_OPTIMIZERS`) and its own settings
    (its step size ``lr``, which may be ``'theory'``, and constants), RR-CLI's meta-epoch step, global momentum."""

    _choosers: ClassVar[dict[str, Registry]] = {"optimizer": SERVER_OPTIMIZERS}
    optimizer: str = Field("sgd", description="the server optimizer; default sgd, or heavy_ball when momentum is given")
    meta_epoch_step: bool = Field(False, description="RR-CLI's extrapolation after each meta-epoch")
    global_lr: _GLOBAL_LR[0] = _GLOBAL_LR[1]
    theory_rule: str | None = Field(
        None,
        description="the theorem 'theory' step sizes come from (default: the method's own; rr_cli_c1 puts nastya "
        "on RR-CLI's Theorem C.1)",
    )
    theory_follows: Literal[THEORY_FOLLOWS] = Field(
        "local",
        description="'theory' server steps tied to γ (η = γN, θ = ηR) follow the multiplied local step ('local') or "
        "stay at ×1 ('fixed')",
    )
    global_momentum: float = Field(
        0.0, ge=0, lt=1, description="FedShuffle's global momentum β (eqs. (13)–(14)); 0 = off"
    )
    momentum_estimator: Literal[ESTIMATORS] = "exact"

    @model_validator(mode="before")
    @classmethod
    def _default_optimizer(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping) and raw.get("optimizer") is None:
            return {**raw, "optimizer": chosen_optimizer(raw)}
        return raw

    @field_validator("theory_rule")
    @classmethod
    def _theorem(cls, v: str | None) -> str | None:
        return None if v is None else _registered(THEOREMS, v, "theorem")


class ScheduleConfig(_PartSection):
    """One factor per round scaling every step size (:data:`fedshuffle.schedules.SCHEDULES`) and the schedule's own
    settings."""

    _choosers: ClassVar[dict[str, Registry]] = {"name": SCHEDULES}
    name: str = "constant"


class ProblemConfig(_PartSection):
    """The problem or model (:data:`fedshuffle.problems.PROBLEMS`) and its own settings."""

    _choosers: ClassVar[dict[str, Registry]] = {"name": PROBLEMS}
    name: str = "quadratic"


class DataConfig(_PartSection):
    """Where the samples come from (:data:`fedshuffle.data.catalog.SOURCES`) and how they are split
    (:data:`fedshuffle.data.catalog.PARTITIONS`): the chosen source's and partition's own settings,
    beside the settings every source shares (where files come from, the split's seed, the weights)."""

    _choosers: ClassVar[dict[str, Registry]] = {"source": SOURCES, "partition": PARTITIONS}
    source: str = "targets"
    partition: str = "sizes"
    data_dirs: list[str] = Field(
        default_factory=list, description="folders searched before the cache and the download (also $FEDSHUFFLE_DATA)"
    )
    download: bool = True
    verify: bool = Field(True, description="check registered files against their SHA-256")
    mirror: str | None = Field(
        None,
        description="base URL of a mirror holding <dataset>/<file>, used instead of the official downloads (also "
        "$FEDSHUFFLE_MIRROR)",
    )
    seed: int | None = Field(
        None, ge=0, description="seed of the split; default: the run's seed (set it to keep one split across seeds)"
    )
    weights: Annotated[Literal["size", "uniform"] | list[float], Summable] = Field(
        "size", description="objective weights w_i: ∝ client size, uniform, or one per client"
    )
    test_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of pooled samples held out for testing (sources without a test split)"
    )


class PrivacyConfig(PrivacySettings):
    """Differential privacy of the clients' updates (:mod:`fedshuffle.privacy`): clipping, Gaussian noise (local or
    central, fixed or adaptive clipping) and the δ of the ε reported per round."""


class SamplerConfig(_PartSection):
    """Which clients take part in a round (:data:`fedshuffle.samplers.SAMPLERS`) and the sampler's own settings."""

    _choosers: ClassVar[dict[str, Registry]] = {"name": SAMPLERS}
    name: str = "full"


class RunConfig(_PartSection):
    """How a run is carried out: rounds, seed, evaluation, checkpoints; the executor
    (:data:`fedshuffle.executors.EXECUTORS`) and the metric sinks (:data:`fedshuffle.experiments.sinks.SINKS`) with
    their own settings, each declared by its entry (``chunk_size``, ``threads``, ``mlflow_uri``, ...): a setting of
    an executor or sink that is not chosen is refused naming the one that takes it."""

    _choosers: ClassVar[dict[str, Registry]] = {"executor": EXECUTORS, "sinks": SINKS}
    rounds: int = Field(1000, ge=1)
    seed: int = Field(0, ge=0)
    dtype: Literal["float64", "float32"] = "float64"
    eval_every: int = Field(10, ge=1)
    grad_norm: bool = Field(
        True,
        description="score ‖∇f(x)‖² over the whole training set at each evaluation (a backward pass; about twice the "
        "forward's work); false leaves grad_norm_sq empty",
    )
    executor: str = Field(
        "sequential",
        description="how a cohort's local work runs; every executor gives the same numbers; 'auto' picks the fastest "
        "for the problem and device",
    )
    device: Literal["cpu", "cuda"] = "cpu"
    sinks: list[str] = Field(
        default_factory=list, description="also send metrics to TensorBoard, MLflow and/or Weights & Biases"
    )
    state_memory_mb: int = Field(
        1024,
        ge=1,
        description="client state (SCAFFOLD, FedCDR) beyond this size goes to memory-mapped files in "
        "<run>/client_state",
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="rounds between checkpoints; 0 = at evaluations, at most one per checkpoint_seconds (and always "
        "the first and the last)",
    )
    checkpoint_seconds: float = Field(
        30.0,
        ge=0,
        description="with checkpoint_every = 0: seconds between checkpoints at evaluations (0 = at every evaluation)",
    )
    bandwidth_mib_s: float = Field(
        20.0,
        gt=0,
        description="up- and downlink bandwidth of the simulated wall-clock (Yang, Fang & Liu, ICLR 2021: 20 MB/s)",
    )
    score_client_models: bool = Field(
        False,
        description=(
            "keep each client's model after its last local training (y_i = x − Δ_i) and score the clients' own "
            "models on "
            "their own data (local_loss, local_accuracy, local_test_accuracy), as FedCDR's and FedDyn's always are"
        ),
    )

    @field_validator("sinks")
    @classmethod
    def _each_sink_once(cls, v: list[str]) -> list[str]:
        twice = sorted({name for name in v if v.count(name) > 1})
        if twice:
            raise ValueError(f"{twice[0]!r} is listed twice; list each sink once")
        return v


Metric = Literal[metrics.of_kind("model", "method")]
Axis = Literal[(*metrics.of_kind("cost"), "bytes")]


class PlotConfig(_Section):
    metric: Metric | list[Metric] = Field("f_gap", description="one metric, or a list for one panel each")
    x: Axis = Field("round", description="the x axis: a cost metric, or 'bytes' (up + down)")
    log_y: bool = True
    band: Literal["std", "minmax"] = "std"


class ExperimentMeta(_Section):
    name: str = Field(
        "experiment",
        description="also the results folder's name (results/<name>): no '/', '\\', control characters, '.' or '..'",
    )
    title: str = ""
    paper: str = ""
    figure: str = ""
    description: str = ""
    seeds: list[int] | None = None
    budget: Literal["cpu", "gpu"] | None = Field(
        None,
        description="hardware the preset is sized for: 'cpu' (a 2-core CPU) or 'gpu' (the paper's scale, needs a GPU)",
    )
    expected_minutes: float | None = Field(
        None,
        gt=0,
        description="expected wall time of the whole preset (every variant and seed) on its budget's hardware",
    )
    deviations: list[str] = Field(
        default_factory=list,
        description="where the experiment departs from the paper (a setting the paper does not give, a substitute "
        "dataset, a reduced scale); printed beside its verdicts",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description=(
            "modules to import first: they register the parts this experiment names; each is code, imported only "
            "with the consent of whoever runs the config (--plugins or FEDSHUFFLE_PLUGINS, fedshuffle.plugins)"
        ),
    )
    not_reproducible: str = Field(
        "",
        description=(
            "why the paper's experiment cannot be run with the data at hand (e.g. its dataset cannot be built); when "
            "given, every claim reads "
            "'not reproducible', with what the substitute measured, never 'holds' or 'does not hold'"
        ),
    )

    @field_validator("seeds")
    @classmethod
    def _some_seeds(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not v:
            raise ValueError(
                "an empty list runs no seed of its own (run.seed would run instead); accepted: a list of "
                "one or more seeds, e.g. [0, 1, 2], or no seeds (run.seed runs)"
            )
        return v

    @field_validator("name")
    @classmethod
    def _folder_name(cls, v: str) -> str:
        problem = name_problem(v)
        if problem:
            raise ValueError(f"{problem}: the name is the results folder's (results/<name>)")
        return v


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a folder name inside another folder (None when it can)."""
    if not name.strip() or name.strip() in (".", ".."):
        return "empty, '.' or '..'"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in name):
        return "holds a control character"
    if len(name.encode()) > 200:
        return "longer than 200 bytes"
    return None


class RunSpec(_Section):
    """One fully specified run (method defaults, base, variant and command-line overrides merged)."""

    method: MethodConfig = Field(default_factory=MethodConfig)
    local: LocalConfig = Field(default_factory=LocalConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    problem: ProblemConfig = Field(default_factory=ProblemConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    plot: PlotConfig = Field(default_factory=PlotConfig)

    @model_validator(mode="before")
    @classmethod
    def _method_defaults(cls, raw: Any) -> Any:
        """Every section starts from the method's registered defaults."""
        return _with_method_defaults(raw) if isinstance(raw, Mapping) else raw

    def roles(self) -> dict[str, Role]:
        """The declared role of every setting of the run that has one, as ``"section.setting"``: the sections' own and
        the chosen parts' (the method's, the server optimizer's, ...), found in their declarations."""
        out: dict[str, Role] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            found = section.roles() if isinstance(section, _Section) else roles(type(section).model_fields)
            out.update({f"{name}.{k}": role for k, role in found.items()})
        return out

    def step_sizes(self) -> dict[str, str]:
        """The run's step sizes (settings with the role :class:`StepSize`), ``"section.setting"`` → the quantity a
        theorem gives for it: the settings that may be ``'theory'``."""
        return {k: role.quantity for k, role in self.roles().items() if isinstance(role, StepSize)}

    def value(self, setting: str) -> Any:
        """The value of ``"section.setting"``."""
        section, _, name = setting.partition(".")
        return getattr(getattr(self, section), name)

    def with_values(self, values: Mapping[str, Any]) -> RunSpec:
        """A copy with ``"section.setting"`` → value set (not validated: the values come from a theorem)."""
        updates: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            section, _, name = key.partition(".")
            updates.setdefault(section, {})[name] = value
        return self.model_copy(update={k: getattr(self, k).model_copy(update=u) for k, u in updates.items()})

    def algorithm_settings(self) -> dict[str, dict[str, Any]]:
        """The settings of the algorithm's parts, as :func:`fedshuffle.methods.algorithm.build_algorithm` takes them."""
        parts = {"method": self.method.model_dump(exclude={"name"})}
        for name in ("local", "aggregation", "server", "schedule", "privacy"):
            parts[name] = getattr(self, name).model_dump()
        return parts


#: the sections of a run, in the order of the experiment file
SECTIONS = tuple(RunSpec.model_fields)
#: the sections whose chooser names a registered part, and their choosers (``{"data": {"source": SOURCES, ...}}``)
_CHOOSERS = {
    name: info.annotation._choosers
    for name, info in RunSpec.model_fields.items()
    if issubclass(info.annotation, _PartSection)
}

#: Raw (not yet merged) sections; validated as a :class:`RunSpec` once merged.
_PartialSections = create_model(
    "_PartialSections",
    __base__=_Section,
    __doc__="Raw (not yet merged) sections; validated as a :class:`RunSpec` once merged.",
    **{name: (dict[str, Any], Field(default_factory=dict)) for name in SECTIONS},
)


#: grid points one variant's tuning may have at most
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


class Variant(_PartialSections):
    label: str
    tune: TuneConfig | None = Field(
        None, description="the paper's tuning protocol for this variant: grid, metric, at, tuning seeds"
    )


class Experiment(_PartialSections):
    """A validated experiment: metadata, base sections, and variants."""

    experiment: ExperimentMeta = Field(default_factory=ExperimentMeta)
    variants: list[Variant] = Field(default_factory=list)
    claims: list[dict[str, Any]] = Field(
        default_factory=list, description="the paper's claims about this experiment (fedshuffle.experiments.claims)"
    )

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, raw: Any) -> Any:
        """The plugins' parts are registered before the sections naming them are validated (each plugin consented
        to, :mod:`fedshuffle.plugins`)."""
        plugins.load_entry_points()
        meta = raw.get("experiment") if isinstance(raw, Mapping) else None
        names = meta.get("plugins") if isinstance(meta, Mapping) else None
        if names is not None:
            if not isinstance(names, list):
                raise ConfigError("experiment.plugins", f"expected a list of module names, got {names!r}")
            plugins.load(names)
        return raw

    def check_tuning(self) -> None:
        """Every tuning grid point gives a valid run of its variant, and tuning seeds are never judged seeds
        (a point chosen on the seeds it is judged on would be judged on its luck)."""
        for k, variant in enumerate(self.variants):
            if variant.tune is None:
                continue
            alone = self.model_copy(update={"variants": [variant]})
            for point in variant.tune.points():
                try:
                    alone.runs(point)
                except ConfigError as exc:
                    raise ConfigError(
                        f"variants[{k}].tune.grid", f"the point {point} gives no valid run ({exc.field}: {exc.message})"
                    ) from None
            judged = set(self.experiment.seeds or [alone.runs()[0][1].run.seed])
            shared = sorted(judged & set(variant.tune.seeds))
            if shared:
                raise ConfigError(
                    f"variants[{k}].tune.seeds",
                    f"seed {shared[0]} is also a judged seed (experiment.seeds); tuning seeds must differ from the "
                    "judged ones",
                )

    def runs(self, overrides: Mapping[str, Any] | None = None, given_as: str = "--set") -> list[tuple[str, RunSpec]]:
        """(label, spec) for each variant (one unlabeled run when there are none), validated.

        Sections merge base ← variant ← ``overrides``. A variant or override that chooses another part
        than the one it replaces (another method, sampler, source, ...) starts from that part's defaults:
        the replaced part's own settings are not carried over. An override of a setting that a variant
        sets to another value is refused (it would turn every variant into the same run under its old
        label); give the variants' values in the file, or run one variant. A bad overridden setting is
        reported against the override (``given_as``: ``--set local.lrr``), not against the first variant."""
        base = {s: getattr(self, s) for s in SECTIONS}
        variants = self.variants or [Variant(label="")]
        self._check_overrides(overrides or {})
        out = []
        for k, variant in enumerate(variants):
            merged = _merge_parts(base, {s: getattr(variant, s) for s in SECTIONS})
            merged = _merge_parts(merged, overrides or {})
            prefix = f"variants[{k}] ({variant.label})." if self.variants else ""
            try:
                out.append((variant.label, validate(RunSpec, merged, prefix)))
            except ConfigError as exc:
                raise _blamed_on_override(exc, prefix, overrides or {}, given_as) from None
        return out

    def _check_overrides(self, overrides: Mapping[str, Any]) -> None:
        for section, settings in overrides.items():
            if not isinstance(settings, Mapping):
                continue
            for key, value in settings.items():
                differing = [
                    v.label
                    for v in self.variants
                    if key in (getattr(v, section, None) or {}) and getattr(v, section)[key] != value
                ]
                if len(differing) > 0 and len(self.variants) > 1:
                    raise ConfigError(
                        f"{section}.{key}",
                        "the variants set it themselves "
                        f"({', '.join(repr(d) for d in differing[:4])}{' ...' if len(differing) > 4 else ''}); "
                        "an override would give every variant the same value under its own label: edit the variants, "
                        "or run one (--variant LABEL)",
                    )

    def seeds(self, spec: RunSpec) -> list[int]:
        return self.experiment.seeds or [spec.run.seed]


def _blamed_on_override(exc: ConfigError, prefix: str, overrides: Mapping[str, Any], given_as: str) -> ConfigError:
    """``exc`` about a setting that ``overrides`` gives, as an error of that override (``--set local.lr: ...``); a
    ``--set`` value holding commas, such as ``local.lr=0.01,0.02``, is pointed to ``fedshuffle sweep --grid``."""
    section, _, rest = exc.field.removeprefix(prefix).partition(".")
    setting = rest.split(".")[0]
    given = overrides.get(section)
    if not isinstance(given, Mapping) or setting not in given:
        return exc
    message = exc.message
    value = given[setting]
    if given_as == "--set" and isinstance(value, str) and "," in value:
        sweep = f"fedshuffle sweep CONFIG --grid {section}.{setting}={value}"
        message += f"; to run each of several values, sweep them: {sweep}"
    return ConfigError(f"{given_as} {section}.{setting}" + rest.removeprefix(setting), message)


def _with_method_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The method's registered defaults under the given sections (an unknown method is left to the schema)."""
    method = raw.get("method", {})
    name = method.get("name", MethodConfig.model_fields["name"].default) if isinstance(method, Mapping) else None
    if not isinstance(name, str) or name not in METHODS:
        return dict(raw)
    return _deep_merge(method_defaults(name), raw)


def _merge_parts(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` ← ``update`` by section, where an update that chooses another part drops the base's settings of
    the part it replaces (those the new part does not take); everything else is merged as it is and validated."""
    base = dict(base)
    for section, choosers in _CHOOSERS.items():
        old, new = base.get(section), update.get(section)
        if not isinstance(old, Mapping) or not isinstance(new, Mapping):
            continue
        kept = dict(old)
        for chooser, registry in choosers.items():
            default = RunSpec.model_fields[section].annotation.model_fields[chooser].default
            if section == "server":
                default = chosen_optimizer(old)
            before, after = old.get(chooser, default), new.get(chooser)
            if not isinstance(before, str) or not isinstance(after, str):
                continue  # no part replaced (unchanged, or a list of parts such as run.sinks: merged as a value)
            if before == after or before not in registry or after not in registry:
                continue
            replaced = set(registry[before].setting_names()) - set(registry[after].setting_names())
            for key in replaced - set(new):
                kept.pop(key, None)
        base[section] = kept
    return _deep_merge(base, update)


def _deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        out[key] = (
            _deep_merge(out[key], value)
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
            else copy.deepcopy(value)
        )
    return out


def load_experiment(path_or_preset: str | Path) -> Experiment:
    """An experiment from a TOML file path or a preset name."""
    path = Path(path_or_preset)
    try:
        found = path.exists() or path.suffix == ".toml"
        if not found:
            path = PRESETS_DIR / f"{path_or_preset}.toml"
            found = path.exists()
    except OSError as exc:  # a name longer than the file system allows
        raise ConfigError(
            "config", f"cannot use {str(path_or_preset)[:60]!r}... as a file name ({exc.strerror or exc})"
        ) from None
    if not found:
        names = preset_names()
        hint = difflib.get_close_matches(str(path_or_preset), names, n=1)
        raise ConfigError(
            "preset",
            f"no preset or file {str(path_or_preset)!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; presets: "
            f"{', '.join(names)}",
        )
    if path.is_dir():
        raise ConfigError(
            "config", f"{path} is a folder; give a TOML file or a preset name (presets: {', '.join(preset_names())})"
        )
    try:
        raw = tomllib.loads(read_regular_file(path, "config", MAX_CONFIG_BYTES, "TOML config file").decode("utf-8"))
    except ConfigError:
        raise
    except (
        tomllib.TOMLDecodeError,
        UnicodeDecodeError,
        ValueError,
    ) as exc:  # ValueError: a number of more than 4,300 digits
        raise ConfigError("config", f"{path} is not valid TOML ({' '.join(str(exc).split())[:200]})") from None
    except RecursionError:
        raise ConfigError("config", f"{path} nests arrays or tables too deeply") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path} ({exc.strerror or exc})") from None
    with plugins.config_folder(path.parent):
        experiment = validate(Experiment, raw)
    parse_claims(experiment.claims, [v.label for v in experiment.variants])
    experiment.check_tuning()
    if not experiment.experiment.name or experiment.experiment.name == "experiment":
        experiment.experiment.name = path.stem if name_problem(path.stem) is None else slug(path.stem)
    for data in (
        experiment.data,
        *(v.data for v in experiment.variants),
    ):  # relative to the file first, whatever the working directory
        data_path = data.get("path")
        if (
            isinstance(data_path, str)
            and _fits_file_system(data_path)
            and not Path(data_path).expanduser().is_absolute()
            and (path.parent / data_path).exists()
        ):
            data["path"] = str(path.parent / data_path)
        dirs = data.get("data_dirs")
        if isinstance(dirs, list):
            data["data_dirs"] = [
                str((path.parent / d).resolve()) if isinstance(d, str) and not Path(d).expanduser().is_absolute() else d
                for d in dirs
            ]
    return experiment


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


#: characters of one ``--set`` value (a list of a thousand client sizes fits)
MAX_VALUE_CHARS = 100_000


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """``["algorithm.lr=0.1", "run.rounds=50"]`` → nested dict; values parsed as TOML where possible."""
    out: dict[str, Any] = {}
    for item in assignments:
        if "=" not in item:
            raise ConfigError("--set", f"expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or parts[0] not in SECTIONS:
            raise ConfigError(
                "--set", f"key must be section.setting with section one of {', '.join(SECTIONS)}; got {key!r}"
            )
        if len(value) > MAX_VALUE_CHARS:
            raise ConfigError(
                "--set", f"{key.strip()}: the value has {len(value)} characters; at most {MAX_VALUE_CHARS}"
            )
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        except (ValueError, RecursionError) as exc:  # a number of more than 4,300 digits, lists nested hundreds deep
            why = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc).split(":")[0]
            raise ConfigError("--set", f"{key.strip()}: cannot read the value ({why})") from None
        out.setdefault(parts[0], {})[parts[1]] = parsed
    return out


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.").lower() or "run"
