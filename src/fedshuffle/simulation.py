"""The round loop, the same for every method.

One round (FedShuffleGen, Horváth et al., TMLR 2022, Algorithm 4, with the method's halves)::

    S ~ sampler                                   cohort and its probabilities
    plans = local.plan(S)                         epochs, data order, η_i = η_l/c_i, unfinished work
    G = cohort's gradients at method.gradient_requests(...)      (FedShuffleMVR only)
    b = method.configure(...)                     the broadcast
    rows = store.get(S)                           the members' own state (stateful methods)
    payload, rows' = method.client_update(b, plans, rows, trainer)   local work through the executor
    store.set(S, rows')
    d = method.aggregate(payload)                 e.g. Σ ω_iΔ_i with ω_i = w̃_i/q_i^S
    d ← d + central DP noise; C ← adaptive clip   [privacy] (fedshuffle.privacy; members clipped their Δ_i)
    x ← x − server.update(d)                      η_g, momentum, Adam, AdGD, RR-CLI's meta-epoch step

A method that keeps the default halves (client: Δ_i; server: Σ ω_iΔ_i) gets ``delta_sum`` = Σ ω_iΔ_i from
the executor directly, added up as the members finish: the cohort's updates are never stacked.

Costs are counted here from what was exchanged: bytes down are the distinct tensors sent to each
member, bytes up the member's payload (one Δ_i per member for a summed ``delta_sum``); sample gradients are what the
client half reports. Per
participating worker, the elements each member received and sent are counted too (Yang, Fang & Liu,
ICLR 2021, Table 2 reports these in MB of fp32), and the seconds of local computation it took,
measured, the cohort's time divided by its size (workers train in parallel).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.streams import Stream, generator
from fedshuffle.data import FederatedDataset, LazyFederatedDataset
from fedshuffle.executors import Executor, SequentialExecutor
from fedshuffle.local.plan import SharedDraws
from fedshuffle.methods.algorithm import Algorithm
from fedshuffle.methods.base import ClientResult, RoundInfo, Trainer
from fedshuffle.privacy import PrivateAggregation
from fedshuffle.problems import Problem
from fedshuffle.samplers import Sampler
from fedshuffle.state import ClientStateStore

DEVICES = ("cpu", "cuda")


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
    worker_elements_up: int = 0
    worker_elements_down: int = 0
    worker_compute_seconds: float = 0.0
    epsilon: float | None = None  # the privacy spent so far, ε(δ) of [privacy] (None without DP)


def _elements(tensors: Any) -> int:
    return sum(t.numel() for t in tensors)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Server:
    """The server half of an :class:`~fedshuffle.methods.algorithm.Algorithm`'s rounds: cohort and plans, broadcast,
    aggregation, server step and the counters, on a population (``data``: its sizes and weights suffice).

    It holds no client rows and does no local work: :class:`Simulation` adds both in this process, the
    Flower server (:mod:`fedshuffle.integrations.flower.strategy`) leaves them to the nodes. Its state (model,
    server and method state, counters) is in :meth:`state_dict`, so a run can be checkpointed and resumed to
    the same numbers.
    """

    problem: Problem
    data: FederatedDataset | LazyFederatedDataset
    algorithm: Algorithm
    sampler: Sampler
    seed: int = 0
    dtype: torch.dtype = torch.float64
    device: str = "cpu"
    #: draws this run shares with runs of the same data that differ only in step sizes (replicas: set by their group)
    shared_draws: SharedDraws | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError("run.device", f"unknown device {self.device!r}; accepted: {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "run.device",
                "CUDA is not available on this machine (torch.cuda.is_available() is False); use device = 'cpu'",
            )
        if self.sampler.num_clients != self.data.num_clients:
            raise ConfigError(
                "sampler", f"sampler is for {self.sampler.num_clients} clients, data has {self.data.num_clients}"
            )
        self.data = self.data.to(self.dtype, self.device)
        torch_gen = torch.Generator().manual_seed(int(generator(self.seed, Stream.INIT).integers(2**62)))
        self.params = self.problem.init_params(torch_gen, self.dtype).to(self.device)
        self.method = self.algorithm.method
        self.server = self.algorithm.server_for(self.sampler)
        self.server_state = self.server.init(self.params)
        self.method_state = self.method.init(self.params)
        self.counters = Counters()
        self._expected_counts = self.sampler.expected_counts()
        self._planned_tau_eff = self.algorithm.planned_tau_eff(self.data.weights, self.data.sizes)
        self.last_extras: dict[str, float] = {}
        privacy = self.algorithm.privacy
        self.privacy = (
            PrivateAggregation(privacy, self.method.aggregator, self.sampler, self.data.weights, self.seed)
            if privacy.active
            else None
        )
        self.privacy_state = self.privacy.init() if self.privacy is not None else {}
        self.counters.epsilon = 0.0 if self.privacy is not None else None

    @property
    def bytes_per_model(self) -> int:
        return self.params.numel() * self.params.element_size()

    def round_info(self) -> RoundInfo:
        """The cohort and plans of the next round (drawn from the run's streams only)."""
        r, alg = self.counters.rounds, self.algorithm
        cohort = self.sampler.sample(r, self.seed)
        scale = alg.schedule(r, self.counters.sample_gradients / self.data.num_samples)
        plans = alg.local.plan(
            self.data.client_indices, cohort, r, self.seed, scale, self.data.sizes, self.shared_draws
        )
        first = ~self.participated(cohort)
        return RoundInfo(
            r,
            cohort,
            plans,
            scale,
            self.data.weights,
            self._expected_counts,
            alg.local.lr * scale,
            self._planned_tau_eff,
            first,
        )

    def participated(self, clients: np.ndarray) -> np.ndarray:
        """Whether each client has taken part before; a server that keeps no client rows takes every client as
        having taken part."""
        return np.ones(len(clients), dtype=bool)

    # The server half of a round, in three calls around the client halves (:meth:`Simulation.step` in this
    # process; on devices :mod:`fedshuffle.integrations.flower`, which may drop members that never answered).

    def open_round(self) -> tuple[RoundInfo, list[torch.Tensor]]:
        """The next round's cohort and plans, and the points where each member returns ∇f_i first (FedShuffleMVR)."""
        rnd = self.round_info()
        return rnd, (self.method.gradient_requests(rnd, self.params, self.method_state) if len(rnd.cohort) else [])

    def broadcast(
        self, rnd: RoundInfo, points: list[torch.Tensor], gradients: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The round's broadcast, after the members' gradients at ``points`` (rows in cohort order) are absorbed."""
        if points:
            self.method_state = self.method.absorb_gradients(rnd, self.params, self.method_state, gradients)
        broadcast = self.method.configure(rnd, self.params, self.method_state)
        return (
            {**broadcast, **self.privacy.broadcast(self.privacy_state, self.params)}
            if self.privacy is not None
            else broadcast
        )

    def close_round(
        self,
        rnd: RoundInfo,
        points: list[torch.Tensor],
        broadcast: Mapping[str, torch.Tensor],
        result: ClientResult | None,
        compute_seconds: float = 0.0,
    ) -> RoundRecord:
        """Aggregate the members' results, take the server step, count the round's cost (``compute_seconds``:
        the measured time of the members' local work, all members together)."""
        members = len(rnd.cohort)
        sent = {id(t): t for t in [*points, *broadcast.values()]}
        down = members * _bytes(sent.values())
        up = members * _bytes(points)
        worker_down = _elements(sent.values()) if members else 0
        worker_up = _elements(points)
        grads_used = len(points) * int(self.data.sizes[rnd.cohort].sum())
        if result is not None and members:
            payload, extras = result.payload, dict(result.extras)
            grads_used += result.sample_gradients
            senders = [
                members if name.endswith("_sum") else 1 for name in payload
            ]  # a summed row: each member sent its own
            up += sum(n * _bytes([t]) for n, t in zip(senders, payload.values()))
            worker_up += sum(n * t.numel() for n, t in zip(senders, payload.values())) // members
        else:
            payload, extras = {}, {}
        direction, self.method_state, more = self.method.aggregate(rnd, self.params, self.method_state, payload)
        extras.update(more)
        if self.privacy is not None:
            direction, self.privacy_state, self.counters.epsilon = self.privacy.release(
                rnd, direction, extras, self.privacy_state
            )
        step, self.server_state = self.server.update(direction, self.server_state, self.params, rnd.lr_scale)
        self.params = self.params - step
        self.last_extras = extras
        record = RoundRecord(rnd.index, rnd.cohort, grads_used, up, down, extras)
        c = self.counters
        c.rounds, c.sample_gradients = rnd.index + 1, c.sample_gradients + grads_used
        c.bytes_up, c.bytes_down = c.bytes_up + up, c.bytes_down + down
        c.worker_elements_up = c.worker_elements_up + worker_up
        c.worker_elements_down = c.worker_elements_down + worker_down
        c.worker_compute_seconds += compute_seconds / members if members else 0.0
        return record

    def state_dict(self) -> dict[str, Any]:
        return {
            "params": self.params.clone(),
            "server": _clone(self.server_state),
            "method": _clone(self.method_state),
            "counters": vars(self.counters).copy(),
            "last_extras": dict(self.last_extras),
            "privacy": _clone(self.privacy_state),
        }

    def commit_checkpoint(self) -> None:
        """Called once the checkpoint holding :meth:`state_dict` is on disk."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.params = state["params"].to(self.device, self.dtype)
        self.server_state = _clone(state["server"])
        self.method_state = _clone(state["method"])
        self.counters = Counters(**state["counters"])
        self.last_extras = dict(state.get("last_extras", {}))
        self.privacy_state = _clone(state.get("privacy", {}))


@dataclass
class Simulation(Server):
    """Runs an :class:`~fedshuffle.methods.algorithm.Algorithm` round by round on one problem and dataset: the
    :class:`Server` with the clients' halves in this process (local work through ``executor``, a stateful method's
    client rows in a :class:`~fedshuffle.state.ClientStateStore`, in memory up to ``state_memory_limit`` bytes, else
    memory-mapped in ``state_dir``). The store is part of :meth:`state_dict`.
    """

    executor: Executor = field(default_factory=SequentialExecutor)
    state_memory_limit: int = 1 << 30
    state_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        fields = {name: self.params.numel() for name in self.method.state_fields}
        state_bytes = limits.array_bytes(
            self.data.num_clients, sum(fields.values()), itemsize=self.params.element_size()
        )
        if fields and state_bytes <= self.state_memory_limit:  # held in memory; beyond the limit it is memory-mapped
            limits.check_fits(
                state_bytes,
                "run.state_memory_mb",
                f"the in-memory client state of {self.data.num_clients} clients ({', '.join(fields)})",
            )
        self.store = (
            ClientStateStore(self.data.num_clients, fields, self.dtype, self.state_memory_limit, self.state_dir)
            if fields
            else None
        )

    def close(self) -> None:
        """Release what the executor holds (the local Ray a Ray executor started); idempotent."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def participated(self, clients: np.ndarray) -> np.ndarray:
        """Whether each client has taken part before (has state rows); always for stateless methods."""
        return self.store.created[clients] if self.store is not None else super().participated(clients)

    def trainer(self, rnd: RoundInfo) -> Trainer:
        return Trainer(self.problem, self.data, self.executor, self.algorithm.local, self.seed, rnd.index, rnd.lr_scale)

    def step(self) -> RoundRecord:
        """Run one round and return its cost."""
        started = time.perf_counter()
        rnd, points = self.open_round()
        trainer = self.trainer(rnd)
        broadcast = self.broadcast(rnd, points, [trainer.gradients(p, rnd.cohort) for p in points])
        result = None
        if len(rnd.cohort):
            if (
                self.method.sums_updates
            ):  # Σ ω_iΔ_i as the executor produces the Δ_i: one model in memory, not the cohort's
                weights = torch.as_tensor(self.method.aggregation_weights(rnd), dtype=self.dtype, device=self.device)
                result = self.method.client_update(broadcast, rnd.plans, {}, trainer, weights)
            else:
                result = self.method.client_update(broadcast, rnd.plans, self._read_rows(rnd.cohort), trainer)
            self._write_rows(rnd.cohort, result.rows)
        return self.close_round(rnd, points, broadcast, result, time.perf_counter() - started)

    def _read_rows(self, cohort: np.ndarray) -> dict[str, torch.Tensor]:
        if self.store is None:
            return {}
        rows = {name: self.store.get(name, cohort, self.device).to(self.dtype) for name in self.method.state_fields}
        rows["created"] = torch.from_numpy(self.store.created[cohort].copy()).to(self.device)
        return rows

    def _write_rows(self, cohort: np.ndarray, rows: Mapping[str, torch.Tensor]) -> None:
        if self.store is None:
            return
        for name, values in rows.items():
            self.store.set(name, cohort, values)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "client_store": self.store.state_dict() if self.store is not None else None}

    def commit_checkpoint(self) -> None:
        """Called once the checkpoint holding :meth:`state_dict` is on disk (see :mod:`fedshuffle.state`)."""
        if self.store is not None:
            self.store.commit()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if self.store is not None:
            self.store.load_state_dict(state["client_store"])


def _clone(tree: Any) -> Any:
    """A deep copy of nested dicts of tensors (server and method states)."""
    return {k: _clone(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree.clone()
