"""Validated experiment configuration (TOML), and turning it into parts.

An experiment file has the sections ``[problem]``, ``[data]``, ``[algorithm]``, ``[sampler]``,
``[run]`` and ``[plot]``, optional metadata in ``[experiment]`` (name, paper, figure, seeds), and
optional ``[[variants]]``: each variant has a ``label`` and partial sections that override the base
(e.g. ``algorithm = {name = "fednova"}``), so one file can describe a paper's comparison figure.
Unknown keys are errors with a "did you mean" hint.
"""

from __future__ import annotations

import copy
import difflib
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedshuffle.data.sources import arrays as data_mod
from fedshuffle import data as partitions_mod
from fedshuffle.methods.algorithm import METHODS, Algorithm, build_algorithm
from fedshuffle.data import FederatedDataset
from fedshuffle.core.errors import ConfigError
from fedshuffle.executors.local import Executor, SequentialExecutor, VectorizedExecutor
from fedshuffle.problems import MLP, LogisticRegression, Problem, Quadratic, SoftmaxRegression
from fedshuffle.samplers import Cyclic, FullParticipation, Independent, Sampler, UniformWithoutReplacement, WithReplacement
from fedshuffle.analysis import theory
from fedshuffle.data.sources import LIBSVM_DATASETS, load_libsvm_dataset, read_svmlight
from fedshuffle.data.sources.leaf import load_leaf
from fedshuffle.data.sources.synthetic import FedProxSynthetic
from fedshuffle.core.streams import Stream, generator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS_DIR = Path(__file__).parent.parent / "presets"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ProblemConfig(_Section):
    name: Literal["quadratic", "logistic", "softmax", "mlp"] = "quadratic"
    targets: str = Field("identity", description="quadratic: 'identity' (e_1..e_N) or a .npy file of shape (N, d)")
    l2: float = Field(0.0, ge=0)
    hidden: list[int] = Field(default_factory=lambda: [32])


class DataConfig(_Section):
    source: Literal["targets", "synthetic", "npz", "libsvm", "fedprox_synthetic", "leaf"] = "targets"
    dataset: str | None = Field(None, description="libsvm: a registered dataset (phishing, mushrooms, a3a, w3a, a9a); or give path")
    data_dirs: list[str] = Field(default_factory=list, description="folders searched before the cache and the download (also $FEDSHUFFLE_DATA)")
    download: bool = True
    verify: bool = Field(True, description="check registered files against their SHA-256")
    seed: int | None = Field(None, ge=0, description="seed of the split; default: the run's seed (set it to keep one split across seeds)")
    client_sizes: list[int] | None = None
    clients: int | None = Field(None, ge=1)
    partition: Literal["sizes", "iid", "equal", "dirichlet"] = "sizes"
    alpha: float = Field(0.5, gt=0, description="Dirichlet partition concentration")
    synthetic_alpha: float = Field(0.0, ge=0, description="fedprox_synthetic: std of u_k (model heterogeneity)")
    synthetic_beta: float = Field(0.0, ge=0, description="fedprox_synthetic: std of B_k (data heterogeneity)")
    iid: bool = Field(False, description="fedprox_synthetic: the IID variant (shared W, b; x ~ N(0, Σ))")
    weights: Literal["size", "uniform"] | list[float] = "size"
    samples: int = Field(1000, ge=1)
    features: int = Field(10, ge=1)
    classes: int = Field(2, ge=2)
    separation: float = Field(1.0, ge=0)
    test_fraction: float = Field(0.0, ge=0, lt=1)
    libsvm_test: bool = Field(False, description="libsvm: evaluate on LIBSVM's own test file (<dataset>.t), where it has one")
    path: str | None = None

    @field_validator("client_sizes")
    @classmethod
    def _positive_sizes(cls, v):
        if v is not None and (not v or any(s < 1 for s in v)):
            raise ValueError("every client needs at least one sample (all sizes >= 1)")
        return v


Theory = Literal["theory"]


class AlgorithmConfig(_Section):
    name: str = "fedshuffle"
    lr: float | Theory | None = Field(None, description="local step size, or 'theory' (see fedshuffle.theory)")
    lr_multiplier: float = Field(1.0, gt=0, description="multiplies the local step size (RR-CLI §4.4 tunes ×1..15 of the theory)")
    server_lr: float | Theory | None = None
    global_lr: float | Theory | None = Field(None, description="RR-CLI's meta-epoch step θ (default ηR: no extrapolation)")
    server_optimizer: Literal["sgd", "heavy_ball", "adam", "adagrad", "yogi", "adgd"] | None = None
    server_beta1: float | None = Field(None, ge=0, lt=1)
    server_beta2: float | None = Field(None, ge=0, lt=1)
    server_eps: float | None = Field(None, gt=0)
    direction: Literal["model_delta", "mean_gradient"] | None = None
    lr_schedule: Literal["constant", "inverse_epochs", "step"] | None = None
    lr_decay_at: list[float] | None = None
    lr_decay_factor: float | None = Field(None, gt=0, le=1)
    scaffold_option: Literal["I", "II"] | None = None
    fedcdr_alpha: float | None = Field(None, description="FedCDR relaxation α ∈ (0, 2)")
    fedcdr_eta: float | None = Field(None, description="FedCDR prox step η > 0")
    fedcdr_form: Literal["y", "x"] | None = None
    exact_prox: bool | None = None
    warm_start: bool | None = Field(None, description="FedCDR: start the inner prox solver from the previous x_i instead of the prox center y_i")
    epochs: int | list[int] | None = None
    steps: int | Literal["min", "mean"] | None = None
    order: Literal["rr", "so", "with_replacement"] | None = None
    batch_size: int | None = Field(None, ge=1)
    step_normalization: Literal["none", "local_work", "max_local_work"] | list[float] | None = None
    weighting: Literal["data", "normalized"] | list[float] | None = None
    normalization: Literal["unbiased", "sum_one"] | None = None
    tau_eff: Literal["planned", "cohort"] | None = None
    weight_decay: float | None = Field(None, ge=0)
    clip_norm: float | None = Field(None, gt=0)
    local_momentum: float | None = Field(None, ge=0, lt=1)
    prox_mu: float | None = Field(None, ge=0)
    server_momentum: float | None = Field(None, ge=0, lt=1)
    global_momentum: float | None = Field(None, ge=0, lt=1)
    momentum_estimator: Literal["exact", "approx"] | None = None
    drop_last_steps: int | None = Field(None, ge=0)
    straggler_probability: float | None = Field(None, ge=0, le=1)

    @field_validator("lr", "server_lr", "global_lr")
    @classmethod
    def _positive_step(cls, v):
        if isinstance(v, float) and not (v > 0 and np.isfinite(v)):
            raise ValueError("must be a positive number or 'theory'")
        return v

    @field_validator("name")
    @classmethod
    def _known_method(cls, v):
        if v not in METHODS:
            hint = difflib.get_close_matches(v, METHODS, n=1)
            raise ValueError(f"unknown method {v!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: {', '.join(METHODS)}")
        return v


class SamplerConfig(_Section):
    name: Literal["full", "uniform", "with_replacement", "importance", "independent", "cyclic"] = "full"
    cohort: float | None = Field(None, gt=0)
    order: Literal["reshuffle", "shuffle_once", "fixed"] = "reshuffle"
    probabilities: Literal["uniform", "weights"] | list[float] = "uniform"


class RunConfig(_Section):
    rounds: int = Field(1000, ge=1)
    seed: int = Field(0, ge=0)
    dtype: Literal["float64", "float32"] = "float64"
    eval_every: int = Field(10, ge=1)
    executor: Literal["sequential", "vectorized", "ray"] = Field("sequential", description="how a cohort's local work runs; every executor gives the same numbers")
    device: Literal["cpu", "cuda"] = "cpu"
    chunk_size: int | None = Field(None, ge=1, description="vectorized: clients per batched chunk (default: as many as fit in memory_budget_mb)")
    memory_budget_mb: int = Field(1024, ge=1, description="vectorized: memory one chunk may use")
    ray_workers: int = Field(2, ge=1, description="ray: shares the cohort is split into (one Ray task each)")
    ray_address: str | None = Field(None, description="ray: a running cluster ('auto' or HEAD:6379); default starts a local Ray")
    sinks: list[Literal["tensorboard", "mlflow"]] = Field(default_factory=list, description="also send metrics to TensorBoard and/or MLflow")
    mlflow_uri: str | None = Field(None, description="mlflow: tracking URI (default: a local file store, mlruns beside the seed folders)")
    state_memory_mb: int = Field(1024, ge=1, description="client state (SCAFFOLD, FedCDR) beyond this size goes to memory-mapped files in <run>/client_state")
    checkpoint_every: int = Field(0, ge=0, description="rounds between checkpoints; 0 = at evaluations only")


Metric = Literal["loss", "f_gap", "dist_sq", "grad_norm_sq", "train_accuracy", "test_accuracy", "test_loss", "prox_residual"]


class PlotConfig(_Section):
    metric: Metric | list[Metric] = Field("f_gap", description="one metric, or a list for one panel each")
    x: Literal["round", "epochs", "sample_gradients", "bytes"] = "round"
    log_y: bool = True
    band: Literal["std", "minmax"] = "std"


class ExperimentMeta(_Section):
    name: str = "experiment"
    title: str = ""
    paper: str = ""
    figure: str = ""
    description: str = ""
    seeds: list[int] | None = None


class RunSpec(_Section):
    """One fully specified run (base merged with a variant and command-line overrides)."""

    problem: ProblemConfig = Field(default_factory=ProblemConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    plot: PlotConfig = Field(default_factory=PlotConfig)


SECTIONS = tuple(RunSpec.model_fields)


class _PartialSections(_Section):
    """Raw (not yet merged) sections; validated as a :class:`RunSpec` once merged."""

    problem: dict[str, Any] = Field(default_factory=dict)
    data: dict[str, Any] = Field(default_factory=dict)
    algorithm: dict[str, Any] = Field(default_factory=dict)
    sampler: dict[str, Any] = Field(default_factory=dict)
    run: dict[str, Any] = Field(default_factory=dict)
    plot: dict[str, Any] = Field(default_factory=dict)


class Variant(_PartialSections):
    label: str


class Experiment(_PartialSections):
    """A validated experiment: metadata, base sections, and variants."""

    experiment: ExperimentMeta = Field(default_factory=ExperimentMeta)
    variants: list[Variant] = Field(default_factory=list)

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


def _deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else copy.deepcopy(value)
    return out


def _format_error(error: Mapping[str, Any], model: type[BaseModel], prefix: str) -> str:
    loc = [str(p) for p in error["loc"] if not str(p).startswith(("function-", "literal", "list[", "int", "float", "str", "bool"))]
    field = prefix + ".".join(loc)
    if error["type"] == "extra_forbidden":
        parent: Any = model
        for part in loc[:-1]:
            annotation = parent.model_fields[part].annotation if isinstance(parent, type) and part in getattr(parent, "model_fields", {}) else None
            parent = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if parent is None:
                break
        known = list(parent.model_fields) if parent is not None else []
        hint = difflib.get_close_matches(loc[-1], known, n=1)
        return f"{field}: unknown setting{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: {', '.join(known)}"
    value = error.get("input")
    return f"{field}: {error['msg'].removeprefix('Value error, ')} (got {value!r})"


def validate(model: type[BaseModel], raw: Mapping[str, Any], prefix: str = "") -> Any:
    """``model.model_validate(raw)`` with one readable line per problem, raised as :class:`ConfigError`."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        lines = sorted({_format_error(e, model, prefix) for e in exc.errors()})
        field = lines[0].split(":", 1)[0]
        raise ConfigError(field, "\n".join(lines)[len(field) + 2 :]) from None


def load_experiment(path_or_preset: str | Path) -> Experiment:
    """An experiment from a TOML file path or a preset name."""
    path = Path(path_or_preset)
    if not path.exists() and path.suffix != ".toml":
        path = PRESETS_DIR / f"{path_or_preset}.toml"
        if not path.exists():
            names = preset_names()
            hint = difflib.get_close_matches(str(path_or_preset), names, n=1)
            raise ConfigError("preset", f"no preset or file {str(path_or_preset)!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; presets: {', '.join(names)}")
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("config", f"file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("config", f"{path} is not valid TOML ({exc})") from None
    experiment = validate(Experiment, raw)
    if not experiment.experiment.name or experiment.experiment.name == "experiment":
        experiment.experiment.name = path.stem
    base_dir = path.parent
    targets = experiment.problem.get("targets")
    if isinstance(targets, str) and targets != "identity" and not Path(targets).is_absolute():
        experiment.problem["targets"] = str(base_dir / targets)
    return experiment


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


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
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        out.setdefault(parts[0], {})[parts[1]] = parsed
    return out


# ----------------------------------------------------------------------------------------------
# Building parts from a spec


def build_problem_and_data(spec: RunSpec) -> tuple[Problem, FederatedDataset]:
    """The problem and federated dataset a spec describes (partition seeded by ``run.seed``)."""
    p, d = spec.problem, spec.data
    rng = generator(spec.run.seed if d.seed is None else d.seed, Stream.PARTITION)
    if p.name == "quadratic":
        if d.source != "targets":
            raise ConfigError("data.source", "the quadratic problem takes its samples from problem.targets; use source = 'targets'")
        if d.client_sizes is None:
            raise ConfigError("data.client_sizes", "the quadratic problem needs client_sizes (contiguous blocks of targets)")
        total = sum(d.client_sizes)
        targets = np.eye(total) if p.targets == "identity" else data_mod.load_targets(p.targets)
        if targets.shape[0] != total:
            raise ConfigError("data.client_sizes", f"sizes sum to {total} but problem.targets has {targets.shape[0]} samples")
        dataset = FederatedDataset(
            torch.as_tensor(targets), torch.zeros(total, dtype=torch.long), partitions_mod.contiguous_partition(d.client_sizes),
            partitions_mod.objective_weights(np.array(d.client_sizes), d.weights), name="quadratic",
        )
        return Quadratic(targets.shape[1]), dataset
    if d.source == "targets":
        raise ConfigError("data.source", f"problem {p.name!r} needs source = 'synthetic', 'npz', 'libsvm', 'fedprox_synthetic' or 'leaf'")
    if d.source in ("fedprox_synthetic", "leaf"):
        return _natural_clients(spec)
    if d.source == "synthetic":
        x, y = data_mod.synthetic_classification(d.samples, d.features, d.classes, rng, d.separation)
    elif d.source == "libsvm":
        if (d.dataset is None) == (d.path is None):
            raise ConfigError("data.dataset", f"source = 'libsvm' needs exactly one of dataset (one of {', '.join(LIBSVM_DATASETS)}) or path (an svmlight file)")
        if d.dataset is not None:
            x, y = load_libsvm_dataset(d.dataset, data_dirs=d.data_dirs, download=d.download, verify=d.verify)
        else:
            x, y = read_svmlight(d.path)
        if d.libsvm_test:
            if d.dataset is None or d.test_fraction:
                raise ConfigError("data.libsvm_test", "needs data.dataset and test_fraction = 0 (the test set is LIBSVM's own file)")
            x_test, y_test = load_libsvm_dataset(d.dataset, "test", data_dirs=d.data_dirs, download=d.download, verify=d.verify)
            official_test = np.arange(len(y), len(y) + len(y_test))
            x, y = np.concatenate([x, x_test]), np.concatenate([y, y_test])
    else:
        if d.path is None:
            raise ConfigError("data.path", "source = 'npz' needs a path to an .npz file with arrays x and y")
        x, y = data_mod.load_npz(d.path)
    num_classes = int(y.max()) + 1 if y.size else 0
    if y.min(initial=0) < 0:
        raise ConfigError("data.path", "labels must be 0..C-1")
    if d.source == "libsvm" and d.libsvm_test:
        test, train = official_test, rng.permutation(official_test[0])
    else:
        order, n_test = rng.permutation(len(y)), int(round(d.test_fraction * len(y)))
        test, train = order[:n_test], order[n_test:]
    n_test = len(test)
    y_train = y[train]
    if d.partition == "sizes":
        if d.client_sizes is None or sum(d.client_sizes) != len(y_train):
            raise ConfigError("data.client_sizes", f"partition = 'sizes' needs client_sizes summing to the {len(y_train)} training samples")
        parts = partitions_mod.contiguous_partition(d.client_sizes)
    elif d.clients is None:
        raise ConfigError("data.clients", f"partition = {d.partition!r} needs the number of clients")
    elif d.partition == "iid":
        parts = partitions_mod.iid_partition(len(y_train), d.clients, rng)
    elif d.partition == "equal":
        parts = partitions_mod.equal_partition(len(y_train), d.clients, rng)
    else:
        parts = partitions_mod.dirichlet_partition(y_train, d.clients, d.alpha, rng)
    sizes = np.array([len(ix) for ix in parts])
    if p.name == "logistic":
        if num_classes > 2:
            raise ConfigError("problem.name", f"logistic regression needs binary labels, data has {num_classes} classes; use 'softmax'")
        problem: Problem = LogisticRegression(x.shape[1], p.l2)
        labels = torch.as_tensor(2.0 * y - 1.0)
    else:
        flat = x.reshape(len(x), -1)
        problem = _classifier(p, flat.shape[1], max(num_classes, 2))
        labels = torch.as_tensor(y)
    features = torch.as_tensor(x.reshape(len(x), -1))
    dataset = FederatedDataset(
        features[train], labels[train], parts, partitions_mod.objective_weights(sizes, d.weights),
        features[test] if n_test else None, labels[test] if n_test else None, name=d.dataset or d.source,
    )
    return problem, dataset


def _classifier(p: ProblemConfig, width: int, num_classes: int) -> Problem:
    """Softmax regression or the MLP a problem section names, for ``width`` features."""
    return SoftmaxRegression(width, num_classes, p.l2) if p.name == "softmax" else MLP(width, p.hidden, num_classes, p.l2)


def _natural_clients(spec: RunSpec) -> tuple[Problem, FederatedDataset]:
    """Datasets whose clients come with the data: FedProx's synthetic devices, LEAF users."""
    p, d = spec.problem, spec.data
    if p.name not in ("softmax", "mlp"):
        raise ConfigError("problem.name", f"source = {d.source!r} is multi-class: use 'softmax' or 'mlp', not {p.name!r}")
    if d.source == "fedprox_synthetic":
        if d.clients is None:
            raise ConfigError("data.clients", "fedprox_synthetic needs the number of devices")
        gen = FedProxSynthetic(d.synthetic_alpha, d.synthetic_beta, d.clients, spec.run.seed if d.seed is None else d.seed, d.iid)
        train = [gen.train(k) for k in range(d.clients)]
        held = [gen.test(k) for k in range(d.clients)]
        test = (np.concatenate([x for x, _ in held]), np.concatenate([y for _, y in held]))
        num_classes = 10
    else:
        if d.path is None:
            raise ConfigError("data.path", "source = 'leaf' needs path: a LEAF folder with train/ and test/")
        _, train, test = load_leaf(d.path, d.clients)
        num_classes = int(max(max(int(y.max()) for _, y in train), int(test[1].max(initial=0)))) + 1
    sizes = np.array([len(y) for _, y in train])
    features = torch.as_tensor(np.concatenate([x for x, _ in train]))
    labels = torch.as_tensor(np.concatenate([y for _, y in train]))
    width = features.shape[1]
    problem = _classifier(p, width, num_classes)
    dataset = FederatedDataset(
        features, labels, partitions_mod.contiguous_partition(sizes), partitions_mod.objective_weights(sizes, d.weights),
        torch.as_tensor(test[0]) if len(test[1]) else None, torch.as_tensor(test[1]) if len(test[1]) else None, name=d.source,
    )
    return problem, dataset


def build_sampler(spec: SamplerConfig, dataset: FederatedDataset) -> Sampler:
    n = dataset.num_clients
    if spec.name == "full":
        return FullParticipation(n)
    if spec.name in ("independent",) and isinstance(spec.probabilities, list):
        return Independent(n, spec.probabilities)
    if spec.cohort is None:
        raise ConfigError("sampler.cohort", f"sampler {spec.name!r} needs a cohort size")
    if spec.name == "importance":
        return Independent.importance(dataset.weights, spec.cohort)
    if spec.name == "independent":
        return Independent(n, np.full(n, spec.cohort / n)) if spec.probabilities == "uniform" else Independent.importance(dataset.weights, spec.cohort)
    if spec.cohort != int(spec.cohort):
        raise ConfigError("sampler.cohort", f"sampler {spec.name!r} needs an integer cohort, got {spec.cohort}")
    b = int(spec.cohort)
    if spec.name == "uniform":
        return UniformWithoutReplacement(n, b)
    if spec.name == "cyclic":
        return Cyclic(n, b, spec.order)
    probs = None if spec.probabilities == "uniform" else (dataset.weights if spec.probabilities == "weights" else spec.probabilities)
    return WithReplacement(n, b, probs)


def resolve_step_sizes(spec: AlgorithmConfig, problem: Problem, data: FederatedDataset, sampler: Sampler) -> tuple[AlgorithmConfig, dict[str, Any]]:
    """Replace ``'theory'`` step sizes by the values of :func:`fedshuffle.theory.theoretical_step_sizes`.

    Returns the resolved config and what was used (constants, N, R, the theory's values), for
    display and for ``config.json``. ``lr_multiplier`` scales the local step size only.
    """
    wanted = [k for k in ("lr", "server_lr", "global_lr") if getattr(spec, k) == "theory"]
    if not wanted:
        return spec, {}
    probe = build_algorithm(spec.name, {**spec.model_dump(exclude={"name", "lr", "server_lr", "global_lr", "lr_multiplier"}), "lr": 1.0})
    local_steps = probe.local.max_planned_steps(data.sizes)
    rounds = getattr(sampler, "rounds_per_meta_epoch", 1)
    constants = theory.smoothness(problem, data)
    values = theory.theoretical_step_sizes(spec.name, constants, local_steps, rounds)
    missing = [k for k in wanted if k not in values]
    if missing:
        raise ConfigError(f"algorithm.{missing[0]}", f"{spec.name} has no theoretical {missing[0]}; give a number")
    resolved = spec.model_copy(update={k: values[k] for k in wanted})
    return resolved, {"constants": constants.to_dict(), "local_steps": local_steps, "rounds_per_meta_epoch": rounds, "theory": values, "used": {k: values[k] for k in wanted}}


def build_executor(run: RunConfig) -> Executor:
    """The executor a run asks for."""
    if run.executor == "vectorized":
        return VectorizedExecutor(run.chunk_size, run.memory_budget_mb << 20)
    if run.executor == "ray":
        from fedshuffle.executors.ray import RayExecutor

        return RayExecutor(run.ray_workers, run.ray_address, run.chunk_size, run.memory_budget_mb << 20)
    return SequentialExecutor()


def build_algorithm_from(spec: AlgorithmConfig, rounds: int = 1) -> Algorithm:
    """The :class:`Algorithm` of a config whose step sizes are numbers (see :func:`resolve_step_sizes`)."""
    settings = spec.model_dump(exclude={"name", "lr_multiplier"})
    if settings["lr"] is None:
        raise ConfigError("algorithm.lr", "a local step size is required (e.g. lr = 0.01, or lr = 'theory')")
    for key in ("lr", "server_lr", "global_lr"):
        if settings[key] == "theory":
            raise ConfigError(f"algorithm.{key}", "'theory' needs the problem and data; resolve it with resolve_step_sizes first")
    settings["lr"] = settings["lr"] * spec.lr_multiplier
    return build_algorithm(spec.name, settings, rounds)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower() or "run"
