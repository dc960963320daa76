"""The configuration schema: one validated section per part of a round, TOML loading, variants, overrides.

An experiment file has the sections ``[method]``, ``[local]``, ``[aggregation]``, ``[server]``,
``[schedule]``, ``[sampler]``, ``[problem]``, ``[data]``, ``[run]`` and ``[plot]``, metadata in
``[experiment]`` (name, paper, figure, seeds), and optional ``[[variants]]``: each has a ``label`` and
partial sections that override the base (e.g. ``method = {name = "fednova"}``). A run's sections are
the method's registered defaults (:data:`fedshuffle.methods.METHODS`), then the base, then the
variant, then command-line overrides. Unknown keys are errors with a "did you mean" hint.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
import sys
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedshuffle import metrics
from fedshuffle.aggregation import DIRECTIONS, NORMALIZATIONS, TAU_EFF, WEIGHTINGS
from fedshuffle.analysis.theory import THEORY_FOLLOWS, THEORY_RULES
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.inputs import read_regular_file
from fedshuffle.core.registry import Registry
from fedshuffle.core.validation import validate
from fedshuffle.data.catalog import PARTITIONS, SOURCES
from fedshuffle.experiments.claims import parse_claims
from fedshuffle.experiments.readings import valid_at, valid_metric
from fedshuffle.local.plan import ORDERS, STEP_MODES, STEP_NORMALIZATIONS
from fedshuffle.local.prox import SOLVERS as PROX_SOLVERS
from fedshuffle.methods.fedcdr import FORMS as FEDCDR_FORMS
from fedshuffle.methods.fedcdr import INITS as FEDCDR_INITS
from fedshuffle.methods.momentum import ESTIMATORS
from fedshuffle.methods.scaffold import OPTIONS as SCAFFOLD_OPTIONS
from fedshuffle.samplers import SAMPLERS
from fedshuffle.schedules import KINDS as SCHEDULES
from fedshuffle.server import SERVER_OPTIMIZERS
from fedshuffle.methods import METHODS
from fedshuffle.methods.algorithm import method_defaults
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


Theory = Literal["theory"]


def _registered(registry: Registry, value: Any, noun: str) -> str:
    """``value`` if it names an entry of ``registry`` now (parts registered after import included)."""
    if not isinstance(value, str) or value not in registry:
        hint = difflib.get_close_matches(str(value), registry.names(), n=1)
        raise ValueError(f"not a registered {noun}{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: {', '.join(registry)}")
    return value


def _usable_path_name(v: str | None) -> str | None:
    """A path the file system can take: no NUL byte, no name over 255 bytes, at most 4096 bytes in all."""
    if v is None:
        return v
    if "\0" in v:
        raise ValueError("a path cannot hold a NUL byte")
    if len(v.encode("utf-8", "surrogateescape")) > 4096 or any(len(part.encode("utf-8", "surrogateescape")) > 255 for part in Path(v).parts):
        raise ValueError("too long for a path (each name at most 255 bytes, the whole path 4096)")
    return v


def _fits_file_system(v: str) -> bool:
    """Whether :func:`_usable_path_name` takes ``v`` (a path it refuses is never looked up: the lookup would raise)."""
    try:
        return _usable_path_name(v) is not None
    except ValueError:
        return False


def _summable(v: Any) -> Any:
    """Per-client values whose sum is a finite float (1e308 twice overflows to inf, and ω = w̃/Σw̃ to 0)."""
    if isinstance(v, list) and not math.isfinite(sum(v)):
        raise ValueError("the values sum to more than the largest float (about 1.8e308); scale them down")
    return v


def _positive_or_theory(v: Any) -> Any:
    if isinstance(v, float) and not (v > 0 and np.isfinite(v)):
        raise ValueError("must be a positive number or 'theory'")
    return v


class MethodConfig(_Section):
    """The method (:data:`fedshuffle.methods.METHODS`) and its own settings."""

    name: str = "fedshuffle"
    scaffold_option: Literal[SCAFFOLD_OPTIONS] | None = Field(None, description="scaffold: control variate update, option I or II")
    fedcdr_alpha: float | None = Field(None, description="fedcdr: relaxation α ∈ (0, 2)")
    fedcdr_eta: float | None = Field(None, description="fedcdr: prox step η > 0")
    fedcdr_form: Literal[FEDCDR_FORMS] | None = Field(None, description="fedcdr: y update of Algorithm 1 ('y') or eq. (14) ('x')")
    exact_prox: bool | None = Field(None, description="fedcdr: closed-form prox where the problem has one")
    warm_start: bool | None = Field(None, description="fedcdr: start the inner prox solver from the previous x_i (default) or, false, from y_i")
    fedcdr_init: Literal[FEDCDR_INITS] | None = Field(None, description="fedcdr: x̂_i⁰ = 2prox(x⁰) − x⁰ (Algorithm 1, 'prox') or x⁰ until first seen ('lazy')")
    prox_solver: Literal[PROX_SOLVERS] | None = Field(None, description="fedcdr: the local SGD epochs (default, the paper's §6.1), or L-BFGS on the full client data to prox_tol")
    prox_tol: float | None = Field(None, gt=0, description="fedcdr: L-BFGS stops at ‖∇f_i(z) + (z − y_i)/η‖ ≤ prox_tol")
    prox_max_iter: int | None = Field(None, ge=1, description="fedcdr: L-BFGS iteration cap per prox")
    feddyn_alpha: float | None = Field(None, description="feddyn: regularization α > 0")

    @field_validator("name")
    @classmethod
    def _known_method(cls, v: str) -> str:
        if v not in METHODS:
            hint = difflib.get_close_matches(v, METHODS.names(), n=1)
            raise ValueError(f"unknown method {v!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: {', '.join(METHODS)}")
        return v


class LocalConfig(_Section):
    """What a client does (:class:`fedshuffle.local.plan.LocalSolver`, :mod:`fedshuffle.local.steps`)."""

    lr: float | Theory | None = Field(None, description="local step size η_l, or 'theory' (fedshuffle.analysis.theory)")
    lr_multiplier: float = Field(1.0, gt=0, description="multiplies the local step size (RR-CLI §4.4 tunes ×1..15 of the theory)")
    epochs: int | list[int] = Field(1, description="E local epochs, or [a, b] drawn uniformly per client and round")
    steps: int | Literal[STEP_MODES] | None = Field(None, description="K local steps instead of epochs; 'min'/'mean' over the cohort")
    order: Literal[ORDERS] = "rr"
    batch_size: int = Field(1, ge=1)
    epoch_batches: int | None = Field(None, ge=1, description="instead of batch_size: exactly K nearly equal minibatches per epoch")
    step_normalization: Literal[STEP_NORMALIZATIONS] | list[float] = Field("none", description="c_i in η_i = η_l/c_i")
    weight_decay: float = Field(0.0, ge=0)
    clip_norm: float | None = Field(None, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1, description="local heavy-ball ρ")
    prox_mu: float = Field(0.0, ge=0, description="FedProx's μ")
    drop_last_steps: int = Field(0, ge=0, description="every client leaves its last k steps undone")
    straggler_probability: float = Field(0.0, ge=0, le=1, description="a client completes only U{1..τ_i} steps with this probability")

    @field_validator("lr")
    @classmethod
    def _positive_step(cls, v: Any) -> Any:
        return _positive_or_theory(v)


class AggregationConfig(_Section):
    """ω_i = w̃_i/q_i^S (:class:`fedshuffle.aggregation.Aggregator`)."""

    weighting: Literal[WEIGHTINGS] | list[float] = "data"
    _finite_weighting = field_validator("weighting")(_summable)
    normalization: Literal[NORMALIZATIONS] = "unbiased"
    tau_eff: Literal[TAU_EFF] = "planned"
    direction: Literal[DIRECTIONS] = "model_delta"


class ServerConfig(_Section):
    """x ← x − step(d) (:data:`fedshuffle.server.SERVER_OPTIMIZERS`), RR-CLI's meta-epoch step, global momentum."""

    optimizer: Literal[SERVER_OPTIMIZERS.names()] | None = Field(None, description="default: sgd, or heavy_ball when momentum > 0")
    lr: float | Theory | None = Field(None, description="server step size η_g (default 1; 0.01 for adaptive; 1e-6 for adgd), or 'theory'")
    momentum: float | None = Field(None, ge=0, lt=1, description="server heavy-ball momentum")
    beta1: float | None = Field(None, ge=0, lt=1)
    beta2: float | None = Field(None, ge=0, lt=1)
    eps: float | None = Field(None, gt=0)
    meta_epoch_step: bool = Field(False, description="RR-CLI's extrapolation after each meta-epoch")
    global_lr: float | Theory | None = Field(None, description="RR-CLI's meta-epoch step θ (default ηR: no extrapolation)")
    theory_rule: Literal[tuple(THEORY_RULES)] | None = Field(None, description="the theorem 'theory' step sizes come from (default: the method's own; rr_cli_c1 puts nastya on RR-CLI's Theorem C.1)")
    theory_follows: Literal[THEORY_FOLLOWS] = Field("local", description="'theory' server steps tied to γ (η = γN, θ = ηR) follow the multiplied local step ('local') or stay at ×1 ('fixed')")
    global_momentum: float = Field(0.0, ge=0, lt=1, description="FedShuffle's global momentum β (eqs. (13)–(14)); 0 = off")
    momentum_estimator: Literal[ESTIMATORS] = "exact"

    @field_validator("lr", "global_lr")
    @classmethod
    def _positive_step(cls, v: Any) -> Any:
        return _positive_or_theory(v)


class ScheduleConfig(_Section):
    """One factor per round scaling every step size (:class:`fedshuffle.schedules.Schedule`)."""

    name: Literal[SCHEDULES] = "constant"
    decay_at: list[float] = Field(default_factory=list, description="step: milestones as fractions of the run")
    decay_factor: float = Field(0.1, gt=0, le=1)


class ProblemConfig(_Section):
    """The problem or model (:data:`fedshuffle.problems.PROBLEMS`) and its settings."""

    name: Literal[PROBLEMS.names()] = "quadratic"
    l2: float = Field(0.0, ge=0, description="L2 regularization λ: (λ/2)‖x‖² in every sample's loss (all but quadratic)")
    hidden: list[int] = Field(default_factory=lambda: [32], description="mlp: hidden layer widths")
    dropout: bool = Field(True, description="cnn: pfl-research's dropout layers (0.25 after pooling, 0.5 after the dense layer), seeded per client and step")
    embedding: int = Field(8, ge=1, description="char_lstm: embedding dimension")
    lstm_hidden: int = Field(512, ge=1, description="char_lstm: hidden state size of each LSTM layer")
    lstm_layers: int = Field(2, ge=1, description="char_lstm: stacked LSTM layers")
    norm_groups: int = Field(2, ge=1, description="resnet18: groups of every GroupNorm layer")
    resnet_width: int = Field(64, ge=1, description="resnet18: channels of the first stage (64; the stages have 1, 2, 4, 8 times as many)")
    resnet_stem: Literal["cifar", "imagenet"] = Field("cifar", description="resnet18: 3×3 first convolution without pooling (cifar) or 7×7 stride 2 and max-pool (imagenet)")

    @field_validator("name", mode="plain")
    @classmethod
    def _known_problem(cls, v: Any) -> str:
        return _registered(PROBLEMS, v, "problem")


class DataConfig(_Section):
    """Where the samples come from (:data:`fedshuffle.data.catalog.SOURCES`) and how they are split
    (:data:`fedshuffle.data.catalog.PARTITIONS`); each source and partition reads the settings it names."""

    source: Literal[SOURCES.names()] = "targets"
    dataset: str | None = Field(None, description="libsvm: a registered dataset (phishing, mushrooms, a3a, w3a, a9a); or give path")
    data_dirs: list[str] = Field(default_factory=list, description="folders searched before the cache and the download (also $FEDSHUFFLE_DATA)")
    download: bool = True
    verify: bool = Field(True, description="check registered files against their SHA-256")
    mirror: str | None = Field(None, description="base URL of a mirror holding <dataset>/<file>, used instead of the official downloads (also $FEDSHUFFLE_MIRROR)")
    seed: int | None = Field(None, ge=0, description="seed of the split; default: the run's seed (set it to keep one split across seeds)")
    client_sizes: list[int] | None = None
    clients: int | None = Field(None, ge=1, description="number of clients of a partition; for sources with their own clients (leaf, shakespeare, tff_cifar100), keep the first this many")
    partition: Literal[PARTITIONS.names()] = "sizes"
    alpha: float = Field(0.5, gt=0, description="Dirichlet partition concentration")
    labels_per_client: int = Field(2, ge=1, description="labels partition: the p distinct labels each client holds (Yang et al.: 1, 2, 5, 10)")
    shards_per_client: int = Field(2, ge=1, description="shards partition: label-sorted shards per client (McMahan et al.: 2)")
    pachinko_alpha: float = Field(0.1, gt=0, description="pachinko partition: concentration of each client's coarse-label distribution (TFF: 0.1)")
    pachinko_beta: float = Field(10.0, gt=0, description="pachinko partition: concentration of each coarse label's fine-label distribution (TFF: 10)")
    standardize: bool = Field(False, description="images: subtract the training set's per-channel mean, divide by its std (default: pixels in [0, 1])")
    ignore_padding: bool = Field(False, description="shakespeare: padding targets −1, skipped by the loss and accuracy (TFF); default token 0, scored (FedShuffle's code)")
    synthetic_alpha: float = Field(0.0, ge=0, description="fedprox_synthetic: std of u_k (model heterogeneity)")
    synthetic_beta: float = Field(0.0, ge=0, description="fedprox_synthetic: std of B_k (data heterogeneity)")
    iid: bool = Field(False, description="fedprox_synthetic: the IID variant (shared W, b; x ~ N(0, Σ))")
    weights: Literal["size", "uniform"] | list[float] = "size"
    _finite_weights = field_validator("weights")(_summable)
    samples: int = Field(1000, ge=1)
    features: int = Field(10, ge=1)
    classes: int = Field(2, ge=2)
    separation: float = Field(1.0, ge=0)
    test_fraction: float = Field(0.0, ge=0, lt=1)
    libsvm_test: bool = Field(False, description="libsvm: evaluate on LIBSVM's own test file (<dataset>.t), where it has one")
    path: str | None = Field(None, description="a data file or folder (targets: .npy of shape (N, d); npz; libsvm; leaf); relative to the config file")
    _usable_path = field_validator("path")(_usable_path_name)

    @field_validator("client_sizes")
    @classmethod
    def _positive_sizes(cls, v):
        if v is not None and (not v or any(s < 1 for s in v)):
            raise ValueError("every client needs at least one sample (all sizes >= 1)")
        return v

    @field_validator("source", mode="plain")
    @classmethod
    def _known_source(cls, v: Any) -> str:
        return _registered(SOURCES, v, "data source")

    @field_validator("partition", mode="plain")
    @classmethod
    def _known_partition(cls, v: Any) -> str:
        return _registered(PARTITIONS, v, "partition")


class SamplerConfig(_Section):
    name: Literal[SAMPLERS.names()] = "full"
    cohort: float | None = Field(None, gt=0)
    order: Literal["reshuffle", "shuffle_once", "fixed"] = "reshuffle"
    probabilities: Literal["uniform", "weights"] | list[float] = "uniform"
    _finite_probabilities = field_validator("probabilities")(_summable)


class RunConfig(_Section):
    rounds: int = Field(1000, ge=1)
    seed: int = Field(0, ge=0)
    dtype: Literal["float64", "float32"] = "float64"
    eval_every: int = Field(10, ge=1)
    executor: Literal["sequential", "vectorized", "threaded", "ray", "auto"] = Field("sequential", description="how a cohort's local work runs; every executor gives the same numbers; 'auto' picks the fastest for the problem and device")
    device: Literal["cpu", "cuda"] = "cpu"
    chunk_size: int | None = Field(None, ge=1, description="vectorized: clients per batched chunk (default: as many as fit in memory_budget_mb)")
    memory_budget_mb: int = Field(1024, ge=1, description="vectorized: memory one chunk may use")
    threads: int | None = Field(None, ge=1, description="threaded (and auto): clients run in parallel, one CPU thread each (default: PyTorch's thread count, one per core)")
    ray_workers: int = Field(2, ge=1, description="ray: shares the cohort is split into (one Ray task each)")
    ray_address: str | None = Field(None, description="ray: a running cluster ('auto' or HEAD:6379); default starts a local Ray")
    sinks: list[Literal["tensorboard", "mlflow"]] = Field(default_factory=list, description="also send metrics to TensorBoard and/or MLflow")
    mlflow_uri: str | None = Field(None, description="mlflow: tracking URI (default: a local file store, mlruns beside the seed folders)")
    state_memory_mb: int = Field(1024, ge=1, description="client state (SCAFFOLD, FedCDR) beyond this size goes to memory-mapped files in <run>/client_state")
    checkpoint_every: int = Field(0, ge=0, description="rounds between checkpoints; 0 = at evaluations, at most one per checkpoint_seconds (and always the first and the last)")
    checkpoint_seconds: float = Field(30.0, ge=0, description="with checkpoint_every = 0: seconds between checkpoints at evaluations (0 = at every evaluation)")
    bandwidth_mib_s: float = Field(20.0, gt=0, description="up- and downlink bandwidth of the simulated wall-clock (Yang, Fang & Liu, ICLR 2021: 20 MB/s)")


Metric = Literal[metrics.of_kind("model", "method")]
Axis = Literal[(*metrics.of_kind("cost"), "bytes")]


class PlotConfig(_Section):
    metric: Metric | list[Metric] = Field("f_gap", description="one metric, or a list for one panel each")
    x: Axis = Field("round", description="the x axis: a cost metric, or 'bytes' (up + down)")
    log_y: bool = True
    band: Literal["std", "minmax"] = "std"


class ExperimentMeta(_Section):
    name: str = Field("experiment", description="also the results folder's name (results/<name>): no '/', '\\', control characters, '.' or '..'")
    title: str = ""
    paper: str = ""
    figure: str = ""
    description: str = ""
    seeds: list[int] | None = None
    budget: Literal["cpu", "gpu"] | None = Field(None, description="hardware the preset is sized for: 'cpu' (a 2-core CPU) or 'gpu' (the paper's scale, needs a GPU)")
    expected_minutes: float | None = Field(None, gt=0, description="expected wall time of the whole preset (every variant and seed) on its budget's hardware")
    deviations: list[str] = Field(default_factory=list, description="where the experiment departs from the paper (a setting the paper does not give, a substitute dataset, a reduced scale); printed beside its verdicts")
    not_reproducible: str = Field("", description=(
        "why the paper's experiment cannot be run with the data at hand (e.g. its dataset cannot be built); when given, every claim reads "
        "'not reproducible', with what the substitute measured, never 'holds' or 'does not hold'"))

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

    def algorithm_settings(self) -> dict[str, dict[str, Any]]:
        """The settings of the algorithm's parts, as :func:`fedshuffle.methods.algorithm.build_algorithm` takes them."""
        parts = {"method": self.method.model_dump(exclude={"name"})}
        for name in ("local", "aggregation", "server", "schedule"):
            parts[name] = getattr(self, name).model_dump()
        for key in ("theory_rule", "theory_follows"):  # read by resolve_step_sizes, not by the algorithm
            parts["server"].pop(key)
        return parts


SECTIONS = tuple(RunSpec.model_fields)


class _PartialSections(_Section):
    """Raw (not yet merged) sections; validated as a :class:`RunSpec` once merged."""

    method: dict[str, Any] = Field(default_factory=dict)
    local: dict[str, Any] = Field(default_factory=dict)
    aggregation: dict[str, Any] = Field(default_factory=dict)
    server: dict[str, Any] = Field(default_factory=dict)
    schedule: dict[str, Any] = Field(default_factory=dict)
    sampler: dict[str, Any] = Field(default_factory=dict)
    problem: dict[str, Any] = Field(default_factory=dict)
    data: dict[str, Any] = Field(default_factory=dict)
    run: dict[str, Any] = Field(default_factory=dict)
    plot: dict[str, Any] = Field(default_factory=dict)


#: grid points one variant's tuning may have at most
MAX_TUNING_POINTS = 1000


class TuneConfig(_Section):
    """A variant's tuning protocol, as the paper states it: the grid it tuned over (``"section.setting"``
    → values; every combination is a point) and the selection rule: the point with the best mean over
    the tuning ``seeds`` of ``metric`` read ``at`` a point of the run (as a claim reads it:
    final, best, last:F, auc or a budget). The judged runs then use fresh seeds."""

    grid: dict[str, list[Any]] = Field(min_length=1, description='"section.setting" → the values tuned over, e.g. {"local.lr_multiplier" = [1, 2, 5]}')
    metric: str = Field(description="the metric the best point is chosen by")
    at: str = Field("final", description="where the metric is read: final, best, last:F, auc, round=N, epochs=X or mib=X")
    seeds: list[int] = Field(min_length=1, description="tuning seeds, distinct from the judged ones")

    @field_validator("grid")
    @classmethod
    def _settings(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        points = 1
        for key, values in v.items():
            section, _, setting = key.partition(".")
            if section not in SECTIONS or setting not in RunSpec.model_fields[section].annotation.model_fields:
                raise ValueError(f"{key!r} is not a setting; expected section.setting with section one of {', '.join(SECTIONS)}")
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
    tune: TuneConfig | None = Field(None, description="the paper's tuning protocol for this variant: grid, metric, at, tuning seeds")


class Experiment(_PartialSections):
    """A validated experiment: metadata, base sections, and variants."""

    experiment: ExperimentMeta = Field(default_factory=ExperimentMeta)
    variants: list[Variant] = Field(default_factory=list)
    claims: list[dict[str, Any]] = Field(default_factory=list, description="the paper's claims about this experiment (fedshuffle.experiments.claims)")

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
                    raise ConfigError(f"variants[{k}].tune.grid", f"the point {point} gives no valid run ({exc.field}: {exc.message})") from None
            judged = set(self.experiment.seeds or [alone.runs()[0][1].run.seed])
            shared = sorted(judged & set(variant.tune.seeds))
            if shared:
                raise ConfigError(f"variants[{k}].tune.seeds", f"seed {shared[0]} is also a judged seed (experiment.seeds); tuning seeds must differ from the judged ones")

    def runs(self, overrides: Mapping[str, Any] | None = None) -> list[tuple[str, RunSpec]]:
        """(label, spec) for each variant (one unlabeled run when there are none), validated."""
        base = {s: getattr(self, s) for s in SECTIONS}
        variants = self.variants or [Variant(label="")]
        out = []
        for k, variant in enumerate(variants):
            merged = _deep_merge(base, {s: getattr(variant, s) for s in SECTIONS})
            merged = _deep_merge(merged, overrides or {})
            prefix = f"variants[{k}] ({variant.label})." if self.variants else ""
            out.append((variant.label, validate(RunSpec, merged, prefix)))
        return out

    def seeds(self, spec: RunSpec) -> list[int]:
        return self.experiment.seeds or [spec.run.seed]


def _with_method_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The method's registered defaults under the given sections (an unknown method is left to the schema)."""
    method = raw.get("method", {})
    name = method.get("name", MethodConfig.model_fields["name"].default) if isinstance(method, Mapping) else None
    if not isinstance(name, str) or name not in METHODS:
        return dict(raw)
    return _deep_merge(method_defaults(name), raw)


def _deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else copy.deepcopy(value)
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
        raise ConfigError("config", f"cannot use {str(path_or_preset)[:60]!r}... as a file name ({exc.strerror or exc})") from None
    if not found:
        names = preset_names()
        hint = difflib.get_close_matches(str(path_or_preset), names, n=1)
        raise ConfigError("preset", f"no preset or file {str(path_or_preset)!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; presets: {', '.join(names)}")
    if path.is_dir():
        raise ConfigError("config", f"{path} is a folder; give a TOML file or a preset name (presets: {', '.join(preset_names())})")
    try:
        raw = tomllib.loads(read_regular_file(path, "config", MAX_CONFIG_BYTES, "TOML config file").decode("utf-8"))
    except ConfigError:
        raise
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a number of more than 4,300 digits
        raise ConfigError("config", f"{path} is not valid TOML ({' '.join(str(exc).split())[:200]})") from None
    except RecursionError:
        raise ConfigError("config", f"{path} nests arrays or tables too deeply") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path} ({exc.strerror or exc})") from None
    experiment = validate(Experiment, raw)
    parse_claims(experiment.claims, [v.label for v in experiment.variants])
    experiment.check_tuning()
    if not experiment.experiment.name or experiment.experiment.name == "experiment":
        experiment.experiment.name = path.stem if name_problem(path.stem) is None else slug(path.stem)
    for data in (experiment.data, *(v.data for v in experiment.variants)):  # relative to the file first, whatever the working directory
        data_path = data.get("path")
        if isinstance(data_path, str) and _fits_file_system(data_path) and not Path(data_path).expanduser().is_absolute() and (path.parent / data_path).exists():
            data["path"] = str(path.parent / data_path)
        dirs = data.get("data_dirs")
        if isinstance(dirs, list):
            data["data_dirs"] = [str((path.parent / d).resolve()) if isinstance(d, str) and not Path(d).expanduser().is_absolute() else d for d in dirs]
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
            raise ConfigError("--set", f"key must be section.setting with section one of {', '.join(SECTIONS)}; got {key!r}")
        if len(value) > MAX_VALUE_CHARS:
            raise ConfigError("--set", f"{key.strip()}: the value has {len(value)} characters; at most {MAX_VALUE_CHARS}")
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
