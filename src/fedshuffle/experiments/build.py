"""Building a run's parts from a validated spec: problem and federated data, sampler, algorithm, executor."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from fedshuffle.analysis import theory
from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError, section
from fedshuffle.data import FederatedDataset
from fedshuffle.data.catalog import Samples, federate, load_samples
from fedshuffle.executors import EXECUTORS, Executor, make_executor
from fedshuffle.experiments.schema import RunConfig, RunSpec, SamplerConfig
from fedshuffle.methods.algorithm import Algorithm, build_algorithm
from fedshuffle.problems import PROBLEMS, Problem
from fedshuffle.samplers import SAMPLERS, Sampler


Loader = Callable[[dict[str, Any], int], tuple[Samples, np.random.Generator]]


def build_problem_and_data(spec: RunSpec, load: Loader = load_samples) -> tuple[Problem, FederatedDataset]:
    """The problem and federated dataset a spec describes: the data source's samples (``load``:
    :func:`~fedshuffle.data.catalog.load_samples`, or a loader that shares them), the registered problem for their
    shape and classes, then the split (seeded by ``data.seed`` or ``run.seed``)."""
    data_settings = spec.data.model_dump()
    with section("data"):
        samples, rng = load(data_settings, spec.run.seed)
    with section("problem"):
        problem = PROBLEMS[spec.problem.name].build(spec.problem.own_settings(), samples=samples)
    # a model whose copies cannot fit: an MLP's widths, or a class count from huge labels
    setting = (
        "problem.hidden"
        if spec.problem.name == "mlp"
        else "data.classes"
        if spec.data.source == "synthetic"
        else "data.path"
    )
    limits.check_model(problem.dim, setting, f"the {spec.problem.name} model")
    with section("data"):
        return problem, federate(samples, data_settings, rng, problem.encode_labels)


def build_sampler(spec: SamplerConfig, dataset: FederatedDataset) -> Sampler:
    """The sampler a section names, for ``dataset``'s clients (errors name ``sampler.<setting>``)."""
    with section("sampler"):
        return SAMPLERS[spec.name].build(spec.own_settings(), weights=dataset.weights)


def resolve_step_sizes(
    spec: RunSpec, problem: Problem, data: FederatedDataset, sampler: Sampler
) -> tuple[RunSpec, dict[str, Any]]:
    """Replace ``'theory'`` step sizes (``local.lr``, ``server.lr``, ``server.global_lr``) by the values of
    :func:`fedshuffle.analysis.theory.theoretical_step_sizes` under ``server.theory_rule`` (a method with a
    theorem declares its own among its registered defaults).

    ``local.lr_multiplier`` scales the local step γ. With ``server.theory_follows = "local"`` (the
    default) the server steps a theorem ties to γ by an equality (RR-CLI Theorem C.1: η = γN, θ = ηR) are
    computed from the step clients really take, γ × multiplier (or the number ``local.lr`` gives); with
    ``"fixed"`` they stay at the ×1 theory values, so that the multiplier scales γ alone.

    Returns the resolved spec and what was used (rule, constants, N, R, the theory's values), for display
    and for ``config.json``.
    """
    places = {"lr": ("local", "lr"), "server_lr": ("server", "lr"), "global_lr": ("server", "global_lr")}
    wanted = [k for k, (part, key) in places.items() if getattr(getattr(spec, part), key) == "theory"]
    if not wanted:
        return spec, {}
    rule = theory.theory_rule(spec.method.name, spec.server.theory_rule)
    probe_settings = spec.algorithm_settings()
    probe_settings["local"] = {**probe_settings["local"], "lr": 1.0, "lr_multiplier": 1.0}
    probe_settings["server"] = {**probe_settings["server"], "lr": 1.0, "global_lr": None}
    probe = build_algorithm(spec.method.name, probe_settings)
    local_steps = probe.local.max_planned_steps(data.sizes)
    rounds = getattr(sampler, "rounds_per_meta_epoch", 1)
    try:
        constants = _smoothness(problem, data)
    except ConfigError as exc:  # named by the setting that asked for 'theory'
        raise ConfigError(".".join(places[wanted[0]]), f"{exc.message}; give a number") from None
    at_one = theory.theoretical_step_sizes(rule, constants, local_steps, rounds, meta_epoch=spec.server.meta_epoch_step)
    local_lr = None
    if spec.server.theory_follows == "local":
        local_lr = (at_one["lr"] if spec.local.lr == "theory" else spec.local.lr) * spec.local.lr_multiplier
    values = theory.theoretical_step_sizes(
        rule, constants, local_steps, rounds, local_lr, meta_epoch=spec.server.meta_epoch_step
    )
    missing = [k for k in wanted if k not in values]
    if missing:
        part, key = places[missing[0]]
        raise ConfigError(f"{part}.{key}", f"{spec.method.name} has no theoretical {key}; give a number")
    updates: dict[str, dict[str, float]] = {}
    for k in wanted:
        part, key = places[k]
        updates.setdefault(part, {})[key] = values[k]
    resolved = spec.model_copy(update={part: getattr(spec, part).model_copy(update=u) for part, u in updates.items()})
    info = {
        "rule": rule,
        "follows": spec.server.theory_follows,
        "constants": constants.to_dict(),
        "local_steps": local_steps,
        "rounds_per_meta_epoch": rounds,
        "theory": at_one,
        "used": {k: values[k] for k in wanted},
    }
    return resolved, info


_SMOOTHNESS: tuple[weakref.ref, weakref.ref, theory.Smoothness] | None = None


def _smoothness(problem: Problem, data: FederatedDataset) -> theory.Smoothness:
    """:func:`~fedshuffle.analysis.theory.smoothness`, kept for the last problem and dataset: the runs of a sweep
    that share one build (its grid points and seeds) ask for the same constants."""
    global _SMOOTHNESS
    if _SMOOTHNESS is not None and _SMOOTHNESS[0]() is problem and _SMOOTHNESS[1]() is data:
        return _SMOOTHNESS[2]
    constants = theory.smoothness(problem, data)
    _SMOOTHNESS = (weakref.ref(problem), weakref.ref(data), constants)
    return constants


def build_executor(run: RunConfig, problem: Problem | None = None) -> Executor:
    """The executor a run asks for; ``auto`` picks by the problem and ``run.device``
    (:mod:`fedshuffle.executors.choice`)."""
    own = run.own_settings()
    taken = {k: own[k] for k in EXECUTORS[run.executor].setting_names() if k in own}
    return make_executor(run.executor, problem, run.device, **taken)


def build_algorithm_from(spec: RunSpec) -> Algorithm:
    """The :class:`Algorithm` of a spec whose step sizes are numbers (see :func:`resolve_step_sizes`)."""
    return build_algorithm(spec.method.name, spec.algorithm_settings(), spec.run.rounds)
