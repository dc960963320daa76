"""The sections of a run, one per part of a round (``[method]``, ``[local]``, ``[aggregation]``, ``[server]``,
``[schedule]``, ``[privacy]``, ``[sampler]``, ``[problem]``, ``[data]``, ``[run]``, ``[plot]``), and :class:`RunSpec`,
one fully specified run, whose sections start from the method's registered defaults. :data:`SECTIONS` and the
choosers of each section (``_CHOOSERS``) are derived here, once, from :class:`RunSpec`."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from fedshuffle import metrics
from fedshuffle.aggregation import DIRECTIONS, NORMALIZATIONS, TAU_EFF, WEIGHTINGS
from fedshuffle.analysis.theory import THEOREMS, THEORY_FOLLOWS
from fedshuffle.core.inputs import Summable
from fedshuffle.core.registry import Registry, Role, StepScale, StepSize, roles
from fedshuffle.data.catalog import PARTITIONS, SOURCES
from fedshuffle.executors.choice import EXECUTORS
from fedshuffle.experiments.schema.base import _PartSection, _registered, _Section, _theory_or
from fedshuffle.experiments.sinks import SINKS
from fedshuffle.local.plan import local_settings
from fedshuffle.methods import METHODS
from fedshuffle.methods.algorithm import method_defaults
from fedshuffle.methods.momentum import ESTIMATORS
from fedshuffle.privacy import PrivacySettings
from fedshuffle.problems import PROBLEMS
from fedshuffle.samplers import SAMPLERS
from fedshuffle.schedules import SCHEDULES
from fedshuffle.server import SERVER_OPTIMIZERS, GlobalStep, chosen_optimizer


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


def _with_method_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The method's registered defaults under the given sections (an unknown method is left to the schema)."""
    method = raw.get("method", {})
    name = method.get("name", MethodConfig.model_fields["name"].default) if isinstance(method, Mapping) else None
    if not isinstance(name, str) or name not in METHODS:
        return dict(raw)
    return _deep_merge(method_defaults(name), raw)


def _deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` ← ``update``, nested mappings merged key by key, sharing nothing with either (the method's defaults
    under a run's sections here; base, variant and overrides in :mod:`fedshuffle.experiments.schema.overrides`)."""
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        out[key] = (
            _deep_merge(out[key], value)
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
            else copy.deepcopy(value)
        )
    return out
