"""The method protocol: every method is a server half and a client half.

One round, for every method (stateless or stateful)::

    server: gradient_requests(round)      → points at which the cohort returns full local gradients (optional)
    server: absorb_gradients(round, G)    → server state
    server: configure(round)              → broadcast: tensors every cohort member receives (x, c, m, …)
    client: client_update(broadcast, plans, rows, trainer) → payload (Δ_i, Δc_i, …) and new state rows
    server: aggregate(round, payload)     → direction d (x ← server optimizer(d)), server state

The client half sees only its broadcast, its own plans, its own state rows and a :class:`Trainer`
bound to its own data, so it runs unchanged for one client on a device (C = 1) and for a whole
cohort in simulation (rows stacked ``(C, d)``). The simulation loop (:mod:`fedshuffle.simulation`)
does the state-store I/O, the executor call and the accounting once for every method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fedshuffle.aggregation import Aggregator
from fedshuffle.core.registry import Entry, Example, Registry
from fedshuffle.local.loop import LocalWork
from fedshuffle.local.plan import ClientPlan, CohortPlan, LocalPlanner
from fedshuffle.local.steps import Drift, standard_chain
from fedshuffle.problems import Problem

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RoundInfo:
    """What the server half knows about a round: the cohort, its plans, and the population's constants."""

    index: int
    cohort: np.ndarray
    plans: Sequence[ClientPlan]
    lr_scale: float
    objective_weights: np.ndarray  # w_i of all n clients
    expected_counts: np.ndarray  # E[c_i]: expected times client i is in a cohort (p_i without repeats)
    base_lr: float  # η_l of this round (schedule applied)
    tau_eff: float | None = None  # FedNova's planned τ_eff, when the aggregator needs it
    first_time: np.ndarray = field(
        default_factory=lambda: np.zeros(0, dtype=bool)
    )  # members taking part for the first time

    @property
    def unbiased(self) -> np.ndarray:
        """w_i/E[c_i] of the cohort's members: E[Σ_S (w_i/E[c_i]) v_i] = Σ_i w_i v_i."""
        return self.objective_weights[self.cohort] / self.expected_counts[self.cohort]

    def member_weights(self, like: torch.Tensor) -> torch.Tensor:
        """w_i of the cohort's members, as a tensor on ``like``'s device and dtype."""
        return torch.as_tensor(self.objective_weights[self.cohort], dtype=like.dtype, device=like.device)


@dataclass
class ClientResult:
    """What the client half returns: uploads per member (``(C, …)``), new state rows, work done.

    In the simulation, a method with the default halves returns instead ``delta_sum`` = Σ_S ω_iΔ_i (one
    model): the members' updates are summed as the executor produces them, never stacked."""

    payload: dict[str, torch.Tensor]
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_gradients: int = 0
    extras: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Trainer:
    """The client side's compute on its own data: local work (through an executor) and full gradients.

    ``drift`` is FedShuffle's global momentum in the local steps, set by
    :class:`fedshuffle.methods.momentum.GlobalMomentum` around any method.
    """

    problem: Problem
    data: object
    executor: object
    local: LocalPlanner
    seed: int
    round_index: int = 0
    lr_scale: float = 1.0
    drift: Drift | None = None

    def train(
        self,
        plans: Sequence[ClientPlan],
        start: torch.Tensor,
        *,
        center: torch.Tensor | None = None,
        offset: torch.Tensor | None = None,
        prox_mu: float | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Δ_i = s_i − y_i after each member's planned steps y ← y − η_i·chain(∇f_batch(y)), stacked ``(C, d)``;
        with ``weights`` ω ``(C,)``, their sum Σ_i ω_iΔ_i ``(d,)``, added up as the executor produces them.

        The chain is the local settings' (clip, weight decay, prox μ, local momentum) with this
        trainer's drift, a per-member ``offset`` o_i added to every step, and ``prox_mu`` in place of the
        local settings' μ (the prox center is ``center``, default the start).
        """
        local = self.local
        mu = local.prox_mu if prox_mu is None else prox_mu
        chain = standard_chain(local.weight_decay, local.clip_norm, mu, local.momentum, self.drift, offset is not None)
        return self.executor.run(self.problem, self.data, LocalWork(plans, start, chain, center, offset), weights)

    def gradients(self, points: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        """Full local gradients ∇f_i at ``points`` (one model, or one per client)."""
        return self.executor.client_gradients(self.problem, self.data, points, clients)

    def plan(self, clients: np.ndarray, round_key: int) -> CohortPlan:
        """Plans for extra local work (FedCDR's initial prox solves), keyed apart from the round's."""
        return self.local.plan(self.data.client_indices, clients, round_key, self.seed, self.lr_scale, self.data.sizes)

    def with_drift(self, drift: Drift | None) -> Trainer:
        return replace(self, drift=drift)

    def sizes(self, clients: np.ndarray) -> int:
        return int(self.data.sizes[clients].sum())


def last_occurrence(cohort: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each client (a client sampled twice keeps its last update)."""
    _, first_in_reversed = np.unique(cohort[::-1], return_index=True)
    return np.sort(len(cohort) - 1 - first_in_reversed)


class Method:
    """Base of every method: the server half plans and aggregates, the client half trains one or more clients.

    Subclasses set ``name`` and ``state_fields`` (per-client rows, each a model-sized vector) and
    override the halves they change; the defaults are FedAvg-like (broadcast x, return Δ_i, ω-weighted sum).
    """

    name: str = "method"
    state_fields: tuple[str, ...] = ()
    #: what the client half uploads: one model-sized row per member for each name (without the summed ``delta_sum``)
    payload_fields: tuple[str, ...] = ("delta",)
    #: methods defined over meta-epochs of cyclic cohorts (RR-CLI, FedCDR)
    needs_cycles: bool = False
    #: methods whose local objective holds its own proximal term (FedCDR's prox, FedDyn's α): ``local.prox_mu`` is
    #: refused
    sets_own_prox: bool = False
    #: whether every local step is the local settings' own y ← y − η_i·chain(∇f_batch(y)), with no term of the
    #: method's (a drift, an offset, a proximal term), as :mod:`fedshuffle.analysis.objective`'s closed forms assume
    plain_local_steps: bool = True

    def __init__(self, aggregator: Aggregator) -> None:
        self.aggregator = aggregator

    # -- server half ------------------------------------------------------------------------------

    def init(self, params: torch.Tensor) -> State:
        """The server state at x⁰."""
        return {}

    def gradient_requests(self, rnd: RoundInfo, params: torch.Tensor, state: State) -> list[torch.Tensor]:
        """Points at which every member returns its full local gradient before training (none by default)."""
        return []

    def absorb_gradients(
        self, rnd: RoundInfo, params: torch.Tensor, state: State, gradients: list[torch.Tensor]
    ) -> State:
        return state

    def configure(self, rnd: RoundInfo, params: torch.Tensor, state: State) -> dict[str, torch.Tensor]:
        """The broadcast of this round: the server model."""
        return {"model": params}

    def aggregation_weights(self, rnd: RoundInfo) -> np.ndarray:
        """ω_i of the cohort's members (:class:`fedshuffle.aggregation.Aggregator`)."""
        return self.aggregator.weights(rnd.plans, rnd.objective_weights, rnd.expected_counts, rnd.base_lr, rnd.tau_eff)

    def aggregate(
        self, rnd: RoundInfo, params: torch.Tensor, state: State, payload: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, State, dict[str, float]]:
        """d = Σ_S ω_iΔ_i (or the ``delta_sum`` the client half already summed); the server optimizer then takes x ←
        x − step(d)."""
        if len(rnd.cohort) == 0:
            return torch.zeros_like(params), state, {}
        if "delta_sum" in payload:
            return payload["delta_sum"], state, {}
        deltas = payload["delta"]
        omega = torch.as_tensor(self.aggregation_weights(rnd), dtype=deltas.dtype, device=deltas.device)
        return omega @ deltas, state, {}

    # -- client half ------------------------------------------------------------------------------

    def client_update(
        self,
        broadcast: Mapping[str, torch.Tensor],
        plans: Sequence[ClientPlan],
        rows: Mapping[str, torch.Tensor],
        trainer: Trainer,
        weights: torch.Tensor | None = None,
    ) -> ClientResult:
        """Δ_i = x − y_i after the planned local steps from x; with the aggregation ``weights`` ω (the simulation,
        where client and server halves share a process), only Σ_i ω_iΔ_i as ``delta_sum``."""
        if weights is not None:
            return ClientResult(
                {"delta_sum": trainer.train(plans, broadcast["model"], weights=weights)},
                sample_gradients=sample_gradients(plans),
            )
        deltas = trainer.train(plans, broadcast["model"])
        return ClientResult({"delta": deltas}, sample_gradients=sample_gradients(plans))

    @classmethod
    def keeps_default_halves(cls) -> bool:
        """Whether this method class keeps the default halves (client: Δ_i; server: Σ_S ω_iΔ_i)."""
        return cls.client_update is Method.client_update and cls.aggregate is Method.aggregate

    @property
    def sums_updates(self) -> bool:
        """Whether the round's updates may be summed as they are produced: the method keeps the default halves
        (:meth:`keeps_default_halves`). A wrapper that changes each Δ_i (differential privacy's clipping,
        :class:`fedshuffle.methods.private.PrivateClients`) overrides the client half, so it is never summed unseen."""
        return self.keeps_default_halves()

    @property
    def server_needs_only_sum(self) -> bool:
        """Whether the server half needs only d = Σ_S ν_iΔ_i of the members' ``delta``, with ν_i = :meth:`sum_weights`
        fixed by the
        plans, never a member's own Δ_i, so that a secure sum (Flower's SecAgg+) can stand in for the updates: true for
        the default halves."""
        return self.sums_updates

    def sum_weights(self, rnd: RoundInfo) -> np.ndarray:
        """ν_i of the members in d = Σ_S ν_iΔ_i, for a method whose server half needs only that sum: the aggregation
        weights ω_i."""
        return self.aggregation_weights(rnd)

    def extra_passes(self) -> int:
        """Full passes over a member's data its client half may take beyond the planned steps' minibatch gradients
        (the most work a reply may report, :func:`fedshuffle.integrations.flower.replies.work_bound`): none."""
        return 0

    def describe(self) -> str:
        return self.name


def sample_gradients(plans: Sequence[ClientPlan]) -> int:
    """Per-sample gradient evaluations of the planned local steps (the plans' real rows, counted at once)."""
    return CohortPlan.of(plans).sample_gradients


@dataclass(frozen=True)
class MethodEntry(Entry):
    """A registered method: ``theorems`` are those whose step sizes ``'theory'`` may mean for it, its own first
    (:data:`fedshuffle.analysis.theory.THEOREMS`)."""

    theorems: tuple[str, ...] = ()


class MethodRegistry(Registry):
    """Methods by name: each a :class:`Method` factory, its defaults for the other sections and its theorems."""

    def add(
        self,
        name: str,
        factory: Callable[..., Any],
        summary: str,
        citation: str = "",
        *,
        theorems: Sequence[str] = (),
        example: Example | None = None,
        **defaults: Any,
    ) -> MethodEntry:
        """Register method ``name``; ``defaults`` by section; ``theorems``: the theorems whose step sizes ``'theory'``
        may mean for it, its own first (``server.theory_rule`` defaults to it); ``example``: what its check runs it on
        (:class:`~fedshuffle.core.registry.Example`)."""
        if theorems:
            defaults["server"] = {"theory_rule": theorems[0], **defaults.get("server", {})}
        settings = self._settings(name, factory)
        return self._store(
            MethodEntry(
                name, factory, summary, citation, defaults, settings, self.noun, tuple(theorems), example=example
            )
        )


#: Methods by name. A method's own settings are its constructor's keyword parameters after the aggregator
#: (``[method]`` section); ``defaults`` are its settings of the other sections (``local``, ``aggregation``, ``server``).
METHODS = MethodRegistry("method.name", runtime=("aggregator",), noun="method")
