"""fedshuffle: local-update methods with sampling without replacement for federated optimization.

The parts of one round (see :mod:`fedshuffle.algorithms`): a :class:`~fedshuffle.samplers.Sampler`
chooses the cohort, a :class:`~fedshuffle.local.LocalSolver` plans each client's local work, an
executor runs it, an :class:`~fedshuffle.aggregation.Aggregator` weights the updates, and a server
optimizer applies them. :func:`~fedshuffle.analysis.inspect_objective` says which objective a
configuration minimizes.
"""

from .aggregation import Aggregator
from .algorithms import METHODS, Algorithm, Simulation, build_algorithm
from .analysis import inspect_objective, unit_quadratic_fixed_point
from .data import FederatedDataset
from .errors import ConfigError
from .executors import SequentialExecutor
from .local import LocalSolver
from .problems import MLP, LogisticRegression, Problem, Quadratic, SoftmaxRegression
from .samplers import Cyclic, FullParticipation, Independent, Sampler, UniformWithoutReplacement, WithReplacement, water_filling
from .server import GlobalMomentum, ServerHeavyBall, ServerSGD

__all__ = [
    "Aggregator", "Algorithm", "ConfigError", "Cyclic", "FederatedDataset", "FullParticipation", "GlobalMomentum",
    "Independent", "LocalSolver", "LogisticRegression", "METHODS", "MLP", "Problem", "Quadratic", "Sampler", "SequentialExecutor",
    "ServerHeavyBall", "ServerSGD", "Simulation", "SoftmaxRegression", "UniformWithoutReplacement", "WithReplacement",
    "build_algorithm", "inspect_objective", "unit_quadratic_fixed_point", "water_filling",
]
