"""Building a run's parts from a validated spec: problem and federated data, sampler, algorithm, executor."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedshuffle import data as partitions_mod
from fedshuffle.analysis import theory
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.streams import Stream, generator
from fedshuffle.data import FederatedDataset
from fedshuffle.data.sources import LIBSVM_DATASETS, load_libsvm_dataset, read_svmlight
from fedshuffle.data.sources import arrays as data_mod
from fedshuffle.data.sources.leaf import load_leaf
from fedshuffle.data.sources.synthetic import FedProxSynthetic
from fedshuffle.executors import Executor, SequentialExecutor, VectorizedExecutor
from fedshuffle.experiments.schema import ProblemConfig, RunConfig, RunSpec, SamplerConfig
from fedshuffle.methods.algorithm import Algorithm, build_algorithm, section
from fedshuffle.problems import MLP, LogisticRegression, Problem, Quadratic, SoftmaxRegression
from fedshuffle.samplers import SAMPLERS, Sampler


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
    """The sampler a section names, for ``dataset``'s clients (errors name ``sampler.<setting>``)."""
    with section("sampler"):
        return SAMPLERS[spec.name].factory(dataset.weights, **spec.model_dump(exclude={"name"}))


def resolve_step_sizes(spec: RunSpec, problem: Problem, data: FederatedDataset, sampler: Sampler) -> tuple[RunSpec, dict[str, Any]]:
    """Replace ``'theory'`` step sizes (``local.lr``, ``server.lr``, ``server.global_lr``) by the values of
    :func:`fedshuffle.analysis.theory.theoretical_step_sizes`.

    Returns the resolved spec and what was used (constants, N, R, the theory's values), for display
    and for ``config.json``. ``local.lr_multiplier`` scales the local step size only.
    """
    places = {"lr": ("local", "lr"), "server_lr": ("server", "lr"), "global_lr": ("server", "global_lr")}
    wanted = [k for k, (part, key) in places.items() if getattr(getattr(spec, part), key) == "theory"]
    if not wanted:
        return spec, {}
    probe_settings = spec.algorithm_settings()
    probe_settings["local"] = {**probe_settings["local"], "lr": 1.0, "lr_multiplier": 1.0}
    probe_settings["server"] = {**probe_settings["server"], "lr": None, "global_lr": None}
    probe = build_algorithm(spec.method.name, probe_settings)
    local_steps = probe.local.max_planned_steps(data.sizes)
    rounds = getattr(sampler, "rounds_per_meta_epoch", 1)
    constants = theory.smoothness(problem, data)
    values = theory.theoretical_step_sizes(spec.method.name, constants, local_steps, rounds)
    missing = [k for k in wanted if k not in values]
    if missing:
        part, key = places[missing[0]]
        raise ConfigError(f"{part}.{key}", f"{spec.method.name} has no theoretical {key}; give a number")
    updates: dict[str, dict[str, float]] = {}
    for k in wanted:
        part, key = places[k]
        updates.setdefault(part, {})[key] = values[k]
    resolved = spec.model_copy(update={part: getattr(spec, part).model_copy(update=u) for part, u in updates.items()})
    return resolved, {"constants": constants.to_dict(), "local_steps": local_steps, "rounds_per_meta_epoch": rounds, "theory": values, "used": {k: values[k] for k in wanted}}


def build_executor(run: RunConfig) -> Executor:
    """The executor a run asks for."""
    if run.executor == "vectorized":
        return VectorizedExecutor(run.chunk_size, run.memory_budget_mb << 20)
    if run.executor == "ray":
        from fedshuffle.executors.ray import RayExecutor

        return RayExecutor(run.ray_workers, run.ray_address, run.chunk_size, run.memory_budget_mb << 20)
    return SequentialExecutor()


def build_algorithm_from(spec: RunSpec) -> Algorithm:
    """The :class:`Algorithm` of a spec whose step sizes are numbers (see :func:`resolve_step_sizes`)."""
    return build_algorithm(spec.method.name, spec.algorithm_settings(), spec.run.rounds)
