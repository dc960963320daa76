"""fedshuffle: local-update methods with sampling without replacement for federated optimization.

One round, as data flows (:mod:`fedshuffle.simulation`): a :class:`~fedshuffle.samplers.Sampler`
chooses the cohort, a :class:`~fedshuffle.local.plan.LocalPlanner` plans each client's local work, the
method's server half configures the round, its client half trains through an executor
(:mod:`fedshuffle.executors`, all running :func:`fedshuffle.local.loop.run_local`), the server half
aggregates, and a server optimizer applies the step. :func:`~fedshuffle.analysis.objective.inspect_objective`
says which objective a configuration minimizes.

From a notebook, :func:`fedshuffle.experiment` builds an experiment from a preset, a TOML file or a
dict, and :meth:`fedshuffle.api.Experiment.run` runs it and returns every curve as a DataFrame
(:mod:`fedshuffle.api`).

The names below are loaded on first use, so ``import fedshuffle`` (and the command line's ``--help``)
does not import PyTorch.
"""

TYPE_CHECKING = False  # not typing's: ``python -m fedshuffle`` installs its Ctrl-C handler before any import
if TYPE_CHECKING:
    from typing import Any

#: public name → the module that defines it (imported on first access)
_EXPORTS = {
    "Aggregator": "fedshuffle.aggregation",
    "inspect_objective": "fedshuffle.analysis.objective",
    "unit_quadratic_fixed_point": "fedshuffle.analysis.objective",
    "ObjectiveReport": "fedshuffle.analysis.objective",
    "ConfigError": "fedshuffle.core.errors",
    "FederatedDataset": "fedshuffle.data",
    "SequentialExecutor": "fedshuffle.executors",
    "VectorizedExecutor": "fedshuffle.executors",
    "LocalPlanner": "fedshuffle.local.plan",
    "METHODS": "fedshuffle.methods",
    "GlobalMomentum": "fedshuffle.methods",
    "Method": "fedshuffle.methods",
    "Algorithm": "fedshuffle.methods.algorithm",
    "build_algorithm": "fedshuffle.methods.algorithm",
    "PROBLEMS": "fedshuffle.problems",
    "MLP": "fedshuffle.problems",
    "ModuleProblem": "fedshuffle.problems",
    "LogisticRegression": "fedshuffle.problems",
    "Problem": "fedshuffle.problems",
    "Quadratic": "fedshuffle.problems",
    "SoftmaxRegression": "fedshuffle.problems",
    "SAMPLERS": "fedshuffle.samplers",
    "Cyclic": "fedshuffle.samplers",
    "FullParticipation": "fedshuffle.samplers",
    "Independent": "fedshuffle.samplers",
    "Sampler": "fedshuffle.samplers",
    "UniformWithoutReplacement": "fedshuffle.samplers",
    "WithReplacement": "fedshuffle.samplers",
    "water_filling": "fedshuffle.samplers",
    "SERVER_OPTIMIZERS": "fedshuffle.server",
    "Simulation": "fedshuffle.simulation",
    "Experiment": "fedshuffle.api",
    "Results": "fedshuffle.api",
    "experiment": "fedshuffle.api",
    "load_results": "fedshuffle.api",
    "list_presets": "fedshuffle.api",
}

__all__ = sorted(_EXPORTS)


#: subpackages and modules reachable as attributes (``fedshuffle.metrics.METRICS``) without importing them first
_SUBMODULES = frozenset(
    {
        "aggregation",
        "analysis",
        "api",
        "core",
        "data",
        "executors",
        "experiments",
        "local",
        "methods",
        "metrics",
        "plugins",
        "problems",
        "samplers",
        "schedules",
        "server",
        "simulation",
        "state",
    }
)


def __getattr__(name: str) -> "Any":
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"fedshuffle.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedshuffle' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
