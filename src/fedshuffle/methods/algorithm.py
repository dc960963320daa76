"""Algorithms as compositions, and the round loop they share.

One round (FedShuffleGen, FedShuffle paper Algorithm 4):

    S ~ sampler                         cohort and its probabilities
    m  = global momentum (optional)     eqs. (13)–(14)
    plans = local.plan(S)               epochs, data order, η_i = η_l/c_i, unfinished work
    Δ_i = executor.run(plans)           x − y_i for every i ∈ S
    ω   = aggregator.weights(plans)     w̃_i / q_i^S
    x  ← x − server.update(Σ ω_iΔ_i)    η_g, server momentum or an adaptive server optimizer

A schedule scales every step size of a round; RR-CLI adds a global step at the end of each
meta-epoch around the server optimizer. Every named method of :data:`METHODS` is one setting of these parts; none has its own loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fedshuffle.aggregation import Aggregator
from fedshuffle.data import FederatedDataset, LazyFederatedDataset
from fedshuffle.core.errors import ConfigError
from fedshuffle.executors.local import Executor, SequentialExecutor
from fedshuffle.local.plan import LocalSolver
from fedshuffle.problems import Problem
from fedshuffle.samplers import Sampler
from fedshuffle.schedules import Schedule
from fedshuffle.state import ClientStateStore
from fedshuffle.methods.stateful import FedCDR, RoundContext, Scaffold
from fedshuffle.server import ADAPTIVE, GlobalMomentum, MetaEpochExtrapolation, ServerAdaptive, ServerAdGD, ServerHeavyBall, ServerOptimizer, ServerSGD
from fedshuffle.core.streams import Stream, generator

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
    # Nastya (002, Algorithm 1): one RR (or SO) pass with client step γ, g_i = (x − y_i)/(γN), x ← x − η·(1/C)Σ g_i.
    "nastya": {"order": "rr", "step_normalization": "none", "weighting": "data", "normalization": "unbiased", "direction": "mean_gradient"},
    # RR-CLI (003, Algorithm 1): Nastya's rounds over cyclic cohorts, then x_{t+1} = x_t − θ(x_t − x_t^R)/(ηR).
    "rr_cli": {"order": "so", "step_normalization": "none", "weighting": "data", "normalization": "unbiased", "direction": "mean_gradient", "meta_epoch_step": True},
    # FedProx (Li et al. 2020): local epochs with the proximal term μ/2‖y − x‖², sample-weighted model average; μ = 1 as in its synthetic experiments.
    "fedprox": {"order": "rr", "step_normalization": "none", "weighting": "data", "normalization": "sum_one", "prox_mu": 1.0},
    # SCAFFOLD (Karimireddy et al. 2020): control variates c, c_i corrected into every local step; option II by default.
    "scaffold": {"order": "with_replacement", "step_normalization": "none", "weighting": "data", "normalization": "unbiased", "client_state": "scaffold", "scaffold_option": "II"},
    # FedCDR (001, Algorithm 1): Douglas–Rachford with client reshuffling; the prox by 20 local SGD epochs of batch 10 unless exact.
    "fedcdr": {"order": "rr", "epochs": 20, "batch_size": 10, "step_normalization": "none", "client_state": "fedcdr", "fedcdr_alpha": 1.0, "fedcdr_eta": 1.0},
    # Generalized FedAvg with two-sided learning rates (004, Algorithm 1): K unbiased local steps with η_L,
    # x ← x + η·Δ; with sampling strategy 1 (with replacement) or 2 (without), aggregation w_i/E[c_i].
    "generalized_fedavg": {"order": "with_replacement", "step_normalization": "none", "weighting": "data", "normalization": "unbiased"},
}

DEVICES = ("cpu", "cuda")
SERVER_OPTIMIZERS = ("sgd", "heavy_ball", "adam", "adagrad", "yogi", "adgd")
LOCAL_KEYS = ("lr", "epochs", "steps", "order", "batch_size", "step_normalization", "weight_decay", "clip_norm", "prox_mu", "drop_last_steps", "straggler_probability")


@dataclass(frozen=True)
class Algorithm:
    """A named composition of the parts of one round."""

    name: str
    local: LocalSolver
    aggregator: Aggregator
    server: ServerOptimizer
    momentum: GlobalMomentum | None = None
    schedule: Schedule = field(default_factory=Schedule)
    meta_epoch_step: bool = False
    global_lr: float | None = None
    client_state: Scaffold | FedCDR | None = None

    @property
    def needs_cycles(self) -> bool:
        """RR-CLI and FedCDR are defined over meta-epochs of cyclic cohorts."""
        return self.meta_epoch_step or isinstance(self.client_state, FedCDR)

    def server_for(self, sampler: Sampler) -> ServerOptimizer:
        """The server optimizer, wrapped in RR-CLI's meta-epoch step when the method has one (θ = ηR by default)."""
        rounds = getattr(sampler, "rounds_per_meta_epoch", None)
        if self.needs_cycles and rounds is None:
            raise ConfigError("sampler.name", f"{self.name} needs meta-epochs: use sampler.name = 'cyclic' (got {sampler.describe()})")
        if not self.meta_epoch_step:
            return self.server
        theta = self.global_lr if self.global_lr is not None else self.server.lr * rounds
        return MetaEpochExtrapolation(self.server, theta, rounds)

    def planned_tau_eff(self, weights: np.ndarray, sizes: np.ndarray) -> float | None:
        """τ_eff = Σ_i w_i E[η_i‖a_i‖₁/η_l] when the aggregator needs it (see :mod:`fedshuffle.aggregation`)."""
        if not self.aggregator.needs_planned_tau_eff:
            return None
        return float(weights @ self.local.expected_progress(sizes))

    def aggregation_weights(self, plans: list, weights: np.ndarray, expected_counts: np.ndarray, tau_eff: float | None, lr_scale: float = 1.0) -> np.ndarray:
        """ω_i for the cohort's plans (``lr_scale``: this round's schedule factor)."""
        return self.aggregator.weights(plans, weights, expected_counts, self.local.lr * lr_scale, tau_eff)


def build_server(s: Mapping[str, Any]) -> ServerOptimizer:
    """The server optimizer named by ``server_optimizer`` (default: SGD, or heavy-ball when ``server_momentum`` > 0)."""
    kind = s.get("server_optimizer") or ("heavy_ball" if s.get("server_momentum") else "sgd")
    if kind not in SERVER_OPTIMIZERS:
        raise ConfigError("algorithm.server_optimizer", f"unknown {kind!r}; accepted: {', '.join(SERVER_OPTIMIZERS)}")
    if kind == "adgd":
        return ServerAdGD(s.get("server_lr", 1e-6))
    if kind in ADAPTIVE:
        extra = {k: s[f"server_{k}"] for k in ("beta1", "beta2", "eps") if f"server_{k}" in s}
        return ServerAdaptive(kind, s.get("server_lr", 0.01), **extra)
    lr = s.get("server_lr", 1.0)
    return ServerHeavyBall(lr, s.get("server_momentum") or 0.9) if kind == "heavy_ball" else ServerSGD(lr)


def build_algorithm(name: str, settings: Mapping[str, Any], rounds: int = 1) -> Algorithm:
    """The method ``name`` with its defaults from :data:`METHODS` overridden by ``settings``.

    Keys: the :class:`LocalSolver` fields (``lr``, ``epochs``, ``steps``, ``order``, ...), plus
    ``local_momentum``, ``weighting``, ``normalization``, ``tau_eff``, ``direction``, ``server_lr``,
    ``server_optimizer`` (sgd, heavy_ball, adam, adagrad, yogi, adgd) with ``server_momentum``,
    ``server_beta1``, ``server_beta2``, ``server_eps``; ``global_lr`` (RR-CLI's θ),
    ``global_momentum`` (β of eqs. (13)–(14)), ``momentum_estimator`` (``"exact"`` or ``"approx"``),
    and ``lr_schedule``, ``lr_decay_at``, ``lr_decay_factor`` (``rounds`` is the run length the step
    schedule's milestones refer to). ``None`` values mean "method default".
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
    aggregator = Aggregator(
        tuple(weighting) if isinstance(weighting, list) else weighting, s.get("normalization", "unbiased"), s.get("tau_eff", "planned"), s.get("direction", "model_delta")
    )
    beta = s.get("global_momentum", 0.0)
    momentum = GlobalMomentum(beta, s.get("momentum_estimator", "exact")) if beta else None
    schedule = Schedule(s.get("lr_schedule", "constant"), tuple(s.get("lr_decay_at", ())), s.get("lr_decay_factor", 0.1), rounds)
    meta = bool(s.get("meta_epoch_step", False))
    if s.get("global_lr") is not None and not meta:
        raise ConfigError("algorithm.global_lr", f"a global (meta-epoch) step size applies to rr_cli only, not to {name}")
    client_state = _client_state(name, s)
    if client_state is not None and momentum is not None:
        raise ConfigError("algorithm.global_momentum", f"{name} keeps client state; global momentum is not defined for it")
    if isinstance(client_state, FedCDR):
        if s.get("server_lr", 1.0) != 1.0 or s.get("server_optimizer") not in (None, "sgd"):
            raise ConfigError("algorithm.server_lr", "FedCDR's server step is x ← x + Σ w_i g_i (it keeps x = Σ w_i x̂_i); server_lr and server_optimizer are not settings of it")
        local = replace(local, prox_mu=1.0 / client_state.eta)
    return Algorithm(name, local, aggregator, build_server(s), momentum, schedule, meta, s.get("global_lr"), client_state)


def _client_state(name: str, s: Mapping[str, Any]) -> Scaffold | FedCDR | None:
    kind = s.get("client_state")
    if kind == "scaffold":
        return Scaffold(s.get("scaffold_option", "II"))
    if kind == "fedcdr":
        if s.get("prox_mu"):
            raise ConfigError("algorithm.prox_mu", "FedCDR's local solver minimizes f_i(z) + ‖z − y_i‖²/(2η): set fedcdr_eta, not prox_mu")
        return FedCDR(s.get("fedcdr_alpha", 1.0), s.get("fedcdr_eta", 1.0), s.get("fedcdr_form", "y"), s.get("exact_prox", True), s.get("warm_start", False))
    for key in ("scaffold_option", "fedcdr_alpha", "fedcdr_eta", "fedcdr_form"):
        if s.get(key) is not None and key not in METHODS[name]:
            raise ConfigError(f"algorithm.{key}", f"applies to {'scaffold' if key.startswith('scaffold') else 'fedcdr'} only, not to {name}")
    return None


@dataclass
class RoundRecord:
    """What one round cost, and any per-round diagnostics of the method (FedCDR's prox residual)."""

    round: int
    cohort: np.ndarray
    sample_gradients: int
    bytes_up: int
    bytes_down: int
    extras: dict[str, float] = field(default_factory=dict)


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
    data: FederatedDataset | LazyFederatedDataset
    algorithm: Algorithm
    sampler: Sampler
    seed: int = 0
    dtype: torch.dtype = torch.float64
    executor: Executor = field(default_factory=SequentialExecutor)
    device: str = "cpu"
    state_memory_limit: int = 1 << 30
    state_dir: str | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError("run.device", f"unknown device {self.device!r}; accepted: {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("run.device", "CUDA is not available on this machine (torch.cuda.is_available() is False); use device = 'cpu'")
        if self.sampler.num_clients != self.data.num_clients:
            raise ConfigError("sampler", f"sampler is for {self.sampler.num_clients} clients, data has {self.data.num_clients}")
        self.data = self.data.to(self.dtype, self.device)
        torch_gen = torch.Generator().manual_seed(int(generator(self.seed, Stream.INIT).integers(2**62)))
        self.params = self.problem.init_params(torch_gen, self.dtype).to(self.device)
        self.server = self.algorithm.server_for(self.sampler)
        self.server_state = self.server.init(self.params)
        self.momentum_state = self.algorithm.momentum.init(self.params) if self.algorithm.momentum else {}
        self.counters = Counters()
        self._expected_counts = self.sampler.expected_counts()
        self._planned_tau_eff = self.algorithm.planned_tau_eff(self.data.weights, self.data.sizes)
        self.last_extras: dict[str, float] = {}
        kind = self.algorithm.client_state
        self.store = ClientStateStore(self.data.num_clients, kind.fields(self.params.numel()), self.dtype, self.state_memory_limit, self.state_dir) if kind else None
        self.client_server = kind.init(self.params) if kind else {}

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
        scale = alg.schedule(r, self.counters.sample_gradients / self.data.num_samples)
        plans = alg.local.plan(self.data.client_indices, cohort, r, self.seed, scale, self.data.sizes)
        weights_of = lambda ps: alg.aggregation_weights(ps, self.data.weights, self._expected_counts, self._planned_tau_eff, scale)  # noqa: E731
        extras: dict[str, float] = {}
        if alg.client_state is not None and len(cohort):
            context = RoundContext(self.problem, self.data, self.executor, self.params, cohort, plans, alg.local.rule(), alg.local, r, self.seed, scale, self.store, self.client_server, weights_of)
            work = alg.client_state.run(context)
            direction, grads_used, extras = work.direction, work.sample_gradients, work.extras
            up_models, down_models = work.models_up, work.models_down
        else:
            deltas = self.executor.run(self.problem, self.data, self.params, plans, alg.local.rule(drift))
            direction = torch.as_tensor(weights_of(plans), dtype=self.dtype, device=self.device) @ deltas if plans else torch.zeros_like(self.params)
            if alg.momentum is not None:
                self.momentum_state = alg.momentum.collect(self.momentum_state, plans, deltas, unbiased)
            per_step = 2 if drift is not None and drift.correction else 1
            grads_used = per_step * sum(p.sample_gradients for p in plans) + extra_gradients
            up_models = 1 + (alg.momentum is not None and alg.momentum.estimator == "exact") * 2
        step, self.server_state = self.server.update(direction, self.server_state, self.params, scale)
        self.params = self.params - step
        self.last_extras = extras
        record = RoundRecord(r, cohort, grads_used, len(cohort) * up_models * self.bytes_per_model, len(cohort) * down_models * self.bytes_per_model, extras)
        c = self.counters
        c.rounds, c.sample_gradients = r + 1, c.sample_gradients + grads_used
        c.bytes_up, c.bytes_down = c.bytes_up + record.bytes_up, c.bytes_down + record.bytes_down
        return record

    def state_dict(self) -> dict[str, Any]:
        return {
            "params": self.params.clone(),
            "server": _clone(self.server_state),
            "momentum": _clone(self.momentum_state),
            "counters": vars(self.counters).copy(),
            "client_server": _clone(self.client_server),
            "client_store": self.store.state_dict() if self.store is not None else None,
            "last_extras": dict(self.last_extras),
        }

    def commit_checkpoint(self) -> None:
        """Called once the checkpoint holding :meth:`state_dict` is on disk (see :mod:`fedshuffle.state`)."""
        if self.store is not None:
            self.store.commit()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.params = state["params"].to(self.device, self.dtype)
        self.server_state = _clone(state["server"])
        self.momentum_state = dict(state["momentum"])
        self.counters = Counters(**state["counters"])
        self.client_server = _clone(state.get("client_server", {}))
        self.last_extras = dict(state.get("last_extras", {}))
        if self.store is not None:
            self.store.load_state_dict(state["client_store"])


def _clone(tree: Any) -> Any:
    """A deep copy of nested dicts of tensors (server and momentum states)."""
    return {k: _clone(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree.clone()
