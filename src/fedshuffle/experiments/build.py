"""Building a run's parts from a validated spec: problem and federated data, sampler, algorithm, executor."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from fedshuffle.analysis import theory
from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError, section
from fedshuffle.core.registry import ModelSize
from fedshuffle.data import FederatedDataset
from fedshuffle.data.catalog import Samples, federate, load_samples
from fedshuffle.executors import EXECUTORS, Executor, make_executor
from fedshuffle.experiments.schema import RunConfig, RunSpec, SamplerConfig
from fedshuffle.methods import METHODS
from fedshuffle.methods.algorithm import Algorithm, build_algorithm, build_planner
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
    # a model whose copies cannot fit: named by the setting that sizes it (an MLP's widths, a synthetic class count),
    # else by the file whose labels gave the class count
    setting = next((k for k, role in spec.roles().items() if isinstance(role, ModelSize)), "data.path")
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
    """Replace the ``'theory'`` step sizes (the settings with the role
    :class:`~fedshuffle.core.registry.StepSize`: ``local.lr``, ``server.lr``, ``server.global_lr``, a method's own)
    by the values of the theorem ``server.theory_rule`` names (default: the method's own,
    :func:`fedshuffle.analysis.theory.theoretical_step_sizes`), each setting taking the theorem's value of its
    ``quantity``.

    ``local.lr_multiplier`` scales the local step γ. With ``server.theory_follows = "local"`` (the
    default) the server steps a theorem ties to γ by an equality (RR-CLI Theorem C.1: η = γN, θ = ηR) are
    computed from the step clients really take, γ × multiplier (or the number ``local.lr`` gives); with
    ``"fixed"`` they stay at the ×1 theory values, so that the multiplier scales γ alone.

    Returns the resolved spec and what was used (rule, constants, N, R, the theory's values), for display
    and for ``config.json``.
    """
    wanted = {k: quantity for k, quantity in spec.step_sizes().items() if spec.value(k) == "theory"}
    if not wanted:
        return spec, {}
    first = next(iter(wanted))
    rule = theory.theory_rule(spec.method.name, METHODS[spec.method.name].theorems, spec.server.theory_rule, first)
    local_steps = build_planner({**spec.local.model_dump(), "lr": 1.0, "lr_multiplier": 1.0}).max_planned_steps(
        data.sizes
    )
    rounds = getattr(sampler, "rounds_per_meta_epoch", 1)
    try:
        constants = _smoothness(problem, data)
    except ConfigError as exc:  # named by the setting that asked for 'theory'
        raise ConfigError(first, f"{exc.message}; give a number") from None
    meta_epoch = spec.server.meta_epoch_step
    at_one = theory.theoretical_step_sizes(rule, constants, local_steps, rounds, meta_epoch=meta_epoch)
    missing = [k for k, quantity in wanted.items() if quantity not in at_one]
    if missing:
        raise ConfigError(missing[0], f"{rule} gives no {wanted[missing[0]]} for {spec.method.name}; give a number")
    local_lr = None
    if spec.server.theory_follows == "local" and spec.local.lr is not None:
        local_lr = (at_one["lr"] if spec.local.lr == "theory" else spec.local.lr) * spec.local.lr_multiplier
    values = theory.theoretical_step_sizes(rule, constants, local_steps, rounds, local_lr, meta_epoch=meta_epoch)
    info = {
        "rule": rule,
        "follows": spec.server.theory_follows,
        "constants": constants.to_dict(),
        "local_steps": local_steps,
        "rounds_per_meta_epoch": rounds,
        "theory": at_one,
        "used": {quantity: values[quantity] for quantity in wanted.values()},
    }
    return spec.with_values({k: values[quantity] for k, quantity in wanted.items()}), info


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
