"""fedshuffle: local-update methods with sampling without replacement for federated optimization.

One round, as data flows (:mod:`fedshuffle.simulation`): a :class:`~fedshuffle.samplers.Sampler`
chooses the cohort, a :class:`~fedshuffle.local.plan.LocalSolver` plans each client's local work, the
method's server half configures the round, its client half trains through an executor
(:mod:`fedshuffle.executors`, all running :func:`fedshuffle.local.loop.run_local`), the server half
aggregates, and a server optimizer applies the step. :func:`~fedshuffle.analysis.objective.inspect_objective`
says which objective a configuration minimizes.
"""

from fedshuffle.aggregation import Aggregator
from fedshuffle.analysis.objective import inspect_objective, unit_quadratic_fixed_point
from fedshuffle.core.errors import ConfigError
from fedshuffle.data import FederatedDataset
from fedshuffle.executors import SequentialExecutor, VectorizedExecutor
from fedshuffle.local.plan import LocalSolver
from fedshuffle.methods import METHODS, GlobalMomentum, Method
from fedshuffle.methods.algorithm import Algorithm, build_algorithm
from fedshuffle.problems import MLP, LogisticRegression, Problem, Quadratic, SoftmaxRegression
from fedshuffle.samplers import Cyclic, FullParticipation, Independent, Sampler, UniformWithoutReplacement, WithReplacement, water_filling
from fedshuffle.server import ServerHeavyBall, ServerSGD
from fedshuffle.simulation import Simulation

__all__ = [
    "Aggregator", "Algorithm", "ConfigError", "Cyclic", "FederatedDataset", "FullParticipation", "GlobalMomentum",
    "Independent", "LocalSolver", "LogisticRegression", "METHODS", "MLP", "Method", "Problem", "Quadratic", "Sampler",
    "SequentialExecutor", "ServerHeavyBall", "ServerSGD", "Simulation", "SoftmaxRegression", "UniformWithoutReplacement",
    "VectorizedExecutor", "WithReplacement", "build_algorithm", "inspect_objective", "unit_quadratic_fixed_point", "water_filling",
]
