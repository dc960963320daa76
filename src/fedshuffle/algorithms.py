"""Algorithms as compositions, and the round loop they share.

One round (FedShuffleGen, FedShuffle paper Algorithm 4):

    S ~ sampler                         cohort and its probabilities
    m  = global momentum (optional)     eqs. (13)–(14)
    plans = local.plan(S)               epochs, data order, η_i = η_l/c_i, unfinished work
    Δ_i = executor.run(plans)           x − y_i for every i ∈ S
    ω   = aggregator.weights(plans)     w̃_i / q_i^S
    x  ← x − server.update(Σ ω_iΔ_i)    η_g, server momentum

Every named method of :data:`METHODS` is one setting of these parts; none has its own loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .aggregation import Aggregator
from .data import FederatedDataset
from .errors import ConfigError
from .executors import Executor, SequentialExecutor
from .local import LocalSolver
from .problems import Problem
from .samplers import Sampler
from .server import GlobalMomentum, ServerHeavyBall, ServerOptimizer, ServerSGD
from .streams import Stream, generator

#: Each method's defaults (FedShuffle paper, Table 4 and Appendix F; Wang et al. 2020 for FedNova).
#: Any key can be overridden; ``fedshuffle_gen`` exposes FedShuffleGen's free parameters c, w̃, q.
METHODS: dict[str, dict[str, Any]] = {
    # Algorithm 2 / Reddi et al.: local SGD with replacement, sum-one aggregation.
    "fedavg": {"order": "with_replacement", "step_normalization": "none", "weighting": "data", "normalization": "sum_one"},
    # Algorithm 2 exactly: local epochs with random reshuffling.
    "fedavg_rr": {"order": "rr", "step_normalization": "none", "weighting": "data", "normalization": "sum_one"},
    # §4.1 heuristics: the same K for every client, min or mean of the epoch-based step counts.
    "fedavg_min": {"order": "with_replacement", "steps": "min", "step_normalization": "none", "weighting": "data", "normalization": "sum_one"},
    "fedavg_mean": {"order": "with_replacement", "steps": "mean", "step_normalization": "none", "weighting": "data", "normalization": "sum_one"},
    # Wang et al. 2020: normalized averaging, with replacement as analysed there; RR variant of Appendix E.
    "fednova": {"order": "with_replacement", "step_normalization": "none", "weighting": "normalized", "normalization": "sum_one"},
    "fednova_rr": {"order": "rr", "step_normalization": "none", "weighting": "normalized", "normalization": "sum_one"},
    # Algorithm 1: RR, step size ∝ 1/(local work), unbiased w_i/p_i aggregation.
    "fedshuffle": {"order": "rr", "step_normalization": "max_local_work", "weighting": "data", "normalization": "unbiased"},
    # Algorithm 4; default is the hybrid of Appendix F.1 (FedShuffle steps + FedNova-like weights).
    "fedshuffle_gen": {"order": "rr", "step_normalization": "max_local_work", "weighting": "normalized", "normalization": "unbiased"},
    # §5.1: FedShuffle with the MVR global momentum of eqs. (12)–(14).
    "fedshuffle_mvr": {"order": "rr", "step_normalization": "max_local_work", "weighting": "data", "normalization": "unbiased", "global_momentum": 0.9, "momentum_estimator": "exact"},
}

LOCAL_KEYS = ("lr", "epochs", "steps", "order", "batch_size", "step_normalization", "weight_decay", "clip_norm", "prox_mu", "drop_last_steps", "straggler_probability")


@dataclass(frozen=True)
class Algorithm:
    """A named composition of the parts of one round."""

    name: str
    local: LocalSolver
    aggregator: Aggregator
    server: ServerOptimizer
    momentum: GlobalMomentum | None = None

    def planned_tau_eff(self, weights: np.ndarray, sizes: np.ndarray) -> float | None:
        """τ_eff = Σ_i w_i E[η_i‖a_i‖₁/η_l] when the aggregator needs it (see :mod:`fedshuffle.aggregation`)."""
        if not self.aggregator.needs_planned_tau_eff:
            return None
        return float(weights @ self.local.expected_progress(sizes))

    def aggregation_weights(self, plans: list, weights: np.ndarray, expected_counts: np.ndarray, tau_eff: float | None) -> np.ndarray:
        """ω_i for the cohort's plans."""
        return self.aggregator.weights(plans, weights, expected_counts, self.local.lr, tau_eff)


def build_algorithm(name: str, settings: Mapping[str, Any]) -> Algorithm:
    """The method ``name`` with its defaults from :data:`METHODS` overridden by ``settings``.

    Keys: the :class:`LocalSolver` fields (``lr``, ``epochs``, ``steps``, ``order``, ...), plus
    ``local_momentum``, ``weighting``, ``normalization``, ``tau_eff``, ``server_lr``,
    ``server_momentum`` (heavy-ball on the server), ``global_momentum`` (β of eqs. (13)–(14)) and
    ``momentum_estimator`` (``"exact"`` or ``"approx"``). ``None`` values mean "method default".
    """
    if name not in METHODS:
        raise ConfigError("algorithm.name", f"unknown method {name!r}; accepted: {', '.join(METHODS)}")
    s = {**METHODS[name], **{k: v for k, v in settings.items() if v is not None}}
    if "lr" not in s:
        raise ConfigError("algorithm.lr", "a local step size is required")
    local = LocalSolver(
        **{k: (tuple(s[k]) if isinstance(s.get(k), list) else s[k]) for k in LOCAL_KEYS if k in s},
        momentum=s.get("local_momentum", 0.0),
    )
    weighting = s.get("weighting", "data")
    aggregator = Aggregator(tuple(weighting) if isinstance(weighting, list) else weighting, s.get("normalization", "unbiased"), s.get("tau_eff", "planned"))
    server_lr, server_momentum = s.get("server_lr", 1.0), s.get("server_momentum", 0.0)
    server: ServerOptimizer = ServerHeavyBall(server_lr, server_momentum) if server_momentum else ServerSGD(server_lr)
    beta = s.get("global_momentum", 0.0)
    momentum = GlobalMomentum(beta, s.get("momentum_estimator", "exact")) if beta else None
    return Algorithm(name, local, aggregator, server, momentum)


@dataclass
class RoundRecord:
    """What one round cost."""

    round: int
    cohort: np.ndarray
    sample_gradients: int
    bytes_up: int
    bytes_down: int


@dataclass
class Counters:
    rounds: int = 0
    sample_gradients: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass
class Simulation:
    """Runs an :class:`Algorithm` round by round on one problem and dataset.

    All state (model, server and momentum state, round counter and cost counters) is in
    :meth:`state_dict`, so a run can be checkpointed and resumed to the same numbers.
    """

    problem: Problem
    data: FederatedDataset
    algorithm: Algorithm
    sampler: Sampler
    seed: int = 0
    dtype: torch.dtype = torch.float64
    executor: Executor = field(default_factory=SequentialExecutor)

    def __post_init__(self) -> None:
        if self.sampler.num_clients != self.data.num_clients:
            raise ConfigError("sampler", f"sampler is for {self.sampler.num_clients} clients, data has {self.data.num_clients}")
        self.data = self.data.to(self.dtype)
        torch_gen = torch.Generator().manual_seed(int(generator(self.seed, Stream.INIT).integers(2**62)))
        self.params = self.problem.init_params(torch_gen, self.dtype)
        self.server_state = self.algorithm.server.init(self.params)
        self.momentum_state = self.algorithm.momentum.init(self.params) if self.algorithm.momentum else {}
        self.counters = Counters()
        self._expected_counts = self.sampler.expected_counts()
        self._planned_tau_eff = self.algorithm.planned_tau_eff(self.data.weights, self.data.sizes)

    @property
    def bytes_per_model(self) -> int:
        return self.params.numel() * self.params.element_size()

    def step(self) -> RoundRecord:
        """Run one round and return its cost."""
        alg, r = self.algorithm, self.counters.rounds
        cohort = self.sampler.sample(r, self.seed)
        unbiased = self.data.weights[cohort] / self._expected_counts[cohort]
        drift, extra_gradients, down_models = None, 0, 1
        if alg.momentum is not None:
            grads = lambda x, clients: self.executor.client_gradients(self.problem, self.data, x, clients)  # noqa: E731
            drift, self.momentum_state = alg.momentum.broadcast(self.momentum_state, self.params, cohort, unbiased, grads)
            extra_gradients = alg.momentum.gradient_evaluations(self.data.sizes, cohort)
            down_models += drift is not None
        plans = alg.local.plan(self.data.client_indices, cohort, r, self.seed)
        deltas = self.executor.run(self.problem, self.data, self.params, plans, alg.local.rule(drift))
        omega = alg.aggregation_weights(plans, self.data.weights, self._expected_counts, self._planned_tau_eff)
        direction = torch.as_tensor(omega, dtype=self.dtype) @ deltas if plans else torch.zeros_like(self.params)
        step, self.server_state = alg.server.update(direction, self.server_state, self.params)
        self.params = self.params - step
        if alg.momentum is not None:
            self.momentum_state = alg.momentum.collect(self.momentum_state, plans, deltas, unbiased)
        per_step = 2 if drift is not None and drift.correction else 1
        grads_used = per_step * sum(p.sample_gradients for p in plans) + extra_gradients
        up_models = 1 + (alg.momentum is not None and alg.momentum.estimator == "exact") * 2
        record = RoundRecord(r, cohort, grads_used, len(cohort) * up_models * self.bytes_per_model, len(cohort) * down_models * self.bytes_per_model)
        c = self.counters
        c.rounds, c.sample_gradients = r + 1, c.sample_gradients + grads_used
        c.bytes_up, c.bytes_down = c.bytes_up + record.bytes_up, c.bytes_down + record.bytes_down
        return record

    def state_dict(self) -> dict[str, Any]:
        return {
            "params": self.params.clone(),
            "server": {k: v.clone() for k, v in self.server_state.items()},
            "momentum": {k: v.clone() for k, v in self.momentum_state.items()},
            "counters": vars(self.counters).copy(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.params = state["params"].to(self.dtype)
        self.server_state = dict(state["server"])
        self.momentum_state = dict(state["momentum"])
        self.counters = Counters(**state["counters"])
