"""fedshuffle: local-update methods with sampling without replacement for federated optimization.

The parts of one round (see :mod:`fedshuffle.algorithms`): a :class:`~fedshuffle.samplers.Sampler`
chooses the cohort, a :class:`~fedshuffle.local.LocalSolver` plans each client's local work, an
executor runs it, an :class:`~fedshuffle.aggregation.Aggregator` weights the updates, and a server
optimizer applies them. :func:`~fedshuffle.analysis.inspect_objective` says which objective a
configuration minimizes.
"""

from fedshuffle.aggregation import Aggregator
from fedshuffle.methods.algorithm import METHODS, Algorithm, Simulation, build_algorithm
from fedshuffle.analysis.objective import inspect_objective, unit_quadratic_fixed_point
from fedshuffle.data import FederatedDataset
from fedshuffle.core.errors import ConfigError
from fedshuffle.executors.local import SequentialExecutor
from fedshuffle.local.plan import LocalSolver
from fedshuffle.problems import MLP, LogisticRegression, Problem, Quadratic, SoftmaxRegression
from fedshuffle.samplers import Cyclic, FullParticipation, Independent, Sampler, UniformWithoutReplacement, WithReplacement, water_filling
from fedshuffle.server import GlobalMomentum, ServerHeavyBall, ServerSGD

__all__ = [
    "Aggregator", "Algorithm", "ConfigError", "Cyclic", "FederatedDataset", "FullParticipation", "GlobalMomentum",
    "Independent", "LocalSolver", "LogisticRegression", "METHODS", "MLP", "Problem", "Quadratic", "Sampler", "SequentialExecutor",
    "ServerHeavyBall", "ServerSGD", "Simulation", "SoftmaxRegression", "UniformWithoutReplacement", "WithReplacement",
    "build_algorithm", "inspect_objective", "unit_quadratic_fixed_point", "water_filling",
]
