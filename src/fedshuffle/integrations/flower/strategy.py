"""The server half of any fedshuffle method as a Flower strategy.

:class:`FedShuffleStrategy` runs one :class:`~fedshuffle.integrations.flower.common.FederatedRun`
round by round exactly as :class:`fedshuffle.simulation.Simulation` does, with the clients' halves
on Flower nodes::

    handshake (once)    partition id, num-partitions, |D_i| and run fingerprint of every node
    configure_train     S ~ sampler (fedshuffle's seeded streams), plans, [FedShuffleMVR: ∇f_i(x^r), ∇f_i(x^{r−1})
                        from each member], broadcast; one message per distinct member with its exact plans
    aggregate_train     replies in cohort order → the method's aggregate → server optimizer → x^{r+1}

The cohort, plans, broadcast, aggregation and server step are the simulation's own code
(:class:`ServerHalf` is a :class:`~fedshuffle.simulation.Simulation` without samples or client rows),
so a federation reproduces ``fedshuffle run`` to rounding. A member whose reply does not come within
the round's timeout is unfinished work: it is dropped from the round (the method's aggregation of the
members that finished; the client's state is not advanced) and counted in the round's metrics.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

# first: a clear message where Flower is not installed
from fedshuffle.integrations.flower.messages import GRADIENTS, HANDSHAKE, STATE_LOST, TRAIN, UNANSWERED, plans_records, record_tensors, tensors_record  # isort: skip
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedshuffle.core.checkpoint import load_checkpoint, save_checkpoint
from fedshuffle.core.io import write_atomic, write_json
from fedshuffle.experiments.folders import sealed
from fedshuffle.experiments.results import write_metrics
from fedshuffle import metrics
from fedshuffle.experiments.runner import build_simulation, environment
from fedshuffle.experiments.schema import slug
from fedshuffle.integrations.flower.common import FederatedRun, Population
from fedshuffle.methods.base import ClientResult, RoundInfo
from fedshuffle.simulation import Simulation


class FederationError(RuntimeError):
    """The federation cannot go on: wrong or missing nodes, a failing ClientApp, lost client state."""


class ClientStateLost(FederationError):
    """A client's state (SCAFFOLD's c_i, FedCDR's y_i, …) is not on its node any more: never silently reset."""


class ServerHalf(Simulation):
    """A :class:`Simulation` on the population's sizes alone: cohort, plans, broadcast, aggregation and
    server step, no samples and no client rows (nodes keep their own). ``last_round[i]`` is the last
    round whose update the server accepted from client i (−1: never); it is what a client's state must
    match, and it says who takes part for the first time."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.last_round = np.full(self.data.num_clients, -1, dtype=np.int64)

    def _client_store(self) -> None:
        return None

    def participated(self, clients: np.ndarray) -> np.ndarray:
        if not self.method.state_fields:
            return super().participated(clients)
        return self.last_round[clients] >= 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_round": self.last_round.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_round = np.array(state["last_round"], dtype=np.int64)


def keep_members(rnd: RoundInfo, keep: np.ndarray) -> RoundInfo:
    """The round without the members ``keep`` is False for (they did not finish)."""
    keep = np.asarray(keep, dtype=bool)
    if keep.all():
        return rnd
    first = rnd.first_time[keep] if len(rnd.first_time) else rnd.first_time
    return replace(rnd, cohort=rnd.cohort[keep], plans=[p for p, k in zip(rnd.plans, keep) if k], first_time=first)


@dataclass
class _OpenRound:
    """What configure_train leaves for aggregate_train."""

    rnd: RoundInfo
    points: list[torch.Tensor]
    broadcast: dict[str, torch.Tensor]
    messages: list[Message]
    clients: list[int]  # the client of each message
    dropped: list[int]  # members dropped in the gradient exchange
    started: float


class FedShuffleStrategy(Strategy):
    """Any registered fedshuffle method (with its sampler, local solver, aggregation and server optimizer) as a Flower strategy.

    Built from a :class:`FederatedRun`: everything is validated and built here, before any message is
    sent (a bad configuration raises :class:`~fedshuffle.core.errors.ConfigError`). ``out`` receives
    the run's results as ``fedshuffle run`` writes them (config.json, metrics.csv, summary.json,
    final_params.npy, and checkpoint.pt with the server's state: model, server and method state,
    counters and each client's last accepted round).
    """

    def __init__(self, run: FederatedRun, *, round_timeout: float = 600.0, connect_timeout: float = 120.0, out: str | Path | None = None,
                 resume: bool = False, poll_interval: float = 0.5, log: Callable[[str], None] | None = None) -> None:
        sim, self.step_sizes = build_simulation(run.spec, run.seed)
        self.run = run
        self.half = ServerHalf(sim.problem, Population(sim.data.sizes, sim.data.weights), sim.algorithm, sim.sampler, seed=run.seed, dtype=sim.dtype, device=sim.device)
        self.evaluator = metrics.ModelScores(sim.problem, sim.data)
        self.round_timeout, self.connect_timeout, self.poll_interval = round_timeout, connect_timeout, poll_interval
        self.out = Path(out) / (slug(run.label) if run.label else "") / f"seed-{run.seed}" if out else None
        self.nodes: dict[int, int] = {}  # client → node id
        self.rows: list[dict[str, Any]] = []  # the evaluations, as metrics.csv holds them
        self.dropped = 0
        self.round_seconds: list[float] = []  # wall time of each round, configure to aggregate
        self._open: _OpenRound | None = None
        self._log = log or (lambda text: None)
        if resume:
            self.restore()

    def restore(self) -> bool:
        """Continue from ``out``'s checkpoint, if there is one: model, server and method state, counters, each
        client's last accepted round, metrics. Stateful methods then need the nodes' state (``state-dir``)."""
        checkpoint = self.out / "checkpoint.pt" if self.out is not None else None
        if checkpoint is None or not checkpoint.exists():
            return False
        saved = load_checkpoint(checkpoint)
        self.half.load_state_dict(saved["simulation"])
        self.rows, self.round_seconds = saved["rows"], saved.get("round_seconds", [])
        self.dropped = self.rows[-1]["dropped"] if self.rows else 0
        self._log(f"resumed {self.run.label or self.run.spec.method.name!r} at round {self.half.counters.rounds}")
        return True

    # -- Flower's strategy interface --------------------------------------------------------------

    def summary(self) -> None:
        self._log(f"fedshuffle run {self.run.label or self.run.spec.method.name!r} (seed {self.run.seed}): {self.half.method.describe()}, "
                  f"{self.half.sampler.describe()}, {self.half.data.num_clients} clients, {self.run.spec.run.rounds} rounds")

    def initial_arrays(self) -> ArrayRecord:
        """x⁰ from the run's seeded stream, as ``fedshuffle run`` starts."""
        return tensors_record({"model": self.half.params})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """The round's messages: one per distinct member, carrying its plans, the broadcast and its last accepted round.

        ``arrays`` must be the current model (the strategy keeps the model it aggregates). The first
        call does the handshake; FedShuffleMVR's gradient exchange happens here, before the broadcast.
        """
        if not self.nodes:
            self.handshake(grid)
        half = self.half
        if not torch.equal(self._model_of(arrays), half.params):
            raise FederationError("configure_train got a model other than the strategy's current one (a fedshuffle strategy keeps the model it aggregates)")
        rnd, points = half.open_round()
        if server_round != rnd.index + 1:
            raise FederationError(f"round {server_round} asked for, the run is at round {rnd.index + 1}")
        started, dropped, gradients = time.monotonic(), [], []
        if points:
            rnd, gradients, dropped = self._gradient_exchange(grid, rnd, points)
        broadcast = half.broadcast(rnd, points, gradients)
        shared = tensors_record(broadcast)
        messages, clients = [], np.unique(rnd.cohort).tolist()
        for client in clients:
            plans_config, batches = plans_records([plan for plan in rnd.plans if plan.client == client])
            plans_config.update({"run": self.run.index, "round": rnd.index, "client": client, "lr-scale": float(rnd.lr_scale), "last-round": int(half.last_round[client])})
            content = RecordDict({"broadcast": shared, "plans": batches, "instructions": plans_config})
            messages.append(Message(content, self.nodes[client], TRAIN, group_id=str(server_round), ttl=self._ttl()))
        self._open = _OpenRound(rnd, points, broadcast, messages, clients, dropped, started)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """x^{r+1} from the replies: the members that answered, in cohort order, aggregated by the method.

        Members without a reply (timeout, node gone) are dropped as unfinished work; their clients'
        last accepted round stays, so their nodes discard the unaccepted state next time.
        """
        if self._open is None:
            raise FederationError("aggregate_train without configure_train")
        state, self._open = self._open, None
        answers = self._answers(state.messages, state.clients, replies)
        rnd = state.rnd
        keep = np.array([int(i) in answers for i in rnd.cohort], dtype=bool)
        dropped = state.dropped + sorted({int(i) for i in rnd.cohort[~keep]})
        rnd = keep_members(rnd, keep)
        result = self._result(rnd, answers) if len(rnd.cohort) else None
        record = self.half.close_round(rnd, state.points, state.broadcast, result)
        self.half.last_round[np.unique(rnd.cohort)] = rnd.index
        self.dropped += len(dropped)
        self.round_seconds.append(time.monotonic() - state.started)
        reported = {"members": len(rnd.cohort), "dropped": len(dropped), "seconds": self.round_seconds[-1],
                    "sample_gradients": record.sample_gradients, "bytes_up": record.bytes_up, "bytes_down": record.bytes_down, **record.extras}
        if dropped:
            self._log(f"round {server_round}: no answer from client(s) {', '.join(map(str, dropped))}: dropped as unfinished work")
        return tensors_record({"model": self.half.params}), MetricRecord({k: float(v) for k, v in reported.items()})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """No federated evaluation: the server evaluates the global model on the run's data (:meth:`evaluate`)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Centralized evaluation: f(x), f − f*, ‖x − x*‖², ‖∇f(x)‖², accuracies, as ``fedshuffle run`` records them."""
        values = self.evaluator(self._model_of(arrays))
        return MetricRecord({k: float(v) for k, v in values.items() if v is not None})

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None, timeout: float | None = None,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Handshake, then the run's rounds (``run.rounds`` unless ``num_rounds``), each waiting up to the round
        timeout (``timeout`` overrides it) for its replies; the server evaluates the model every ``run.eval_every``
        rounds and writes results and checkpoints as ``fedshuffle run`` does."""
        if initial_arrays is not None and not torch.equal(self._model_of(initial_arrays), self.half.params):
            raise FederationError("a fedshuffle run starts from its own x⁰ (run.seed); leave initial_arrays out")
        if timeout is not None:
            self.round_timeout = timeout
        rounds = num_rounds if num_rounds is not None else self.run.spec.run.rounds
        evaluate = evaluate_fn or self.evaluate
        self.summary()
        result = Result(arrays=self.initial_arrays())
        self.handshake(grid)
        self._write_config()
        if not self.rows:
            self._record(evaluate(0, result.arrays))
        spec = self.run.spec.run
        while self.half.counters.rounds < rounds:
            r = self.half.counters.rounds + 1
            messages = list(self.configure_train(r, result.arrays, train_config or ConfigRecord(), grid))
            arrays, metrics = self.aggregate_train(r, self.exchange(grid, messages, self.round_timeout))
            result.arrays, result.train_metrics_clientapp[r] = arrays, metrics
            self._log(f"round {r}/{rounds}: {int(metrics['members'])} member(s), {int(metrics['dropped'])} dropped, {metrics['seconds']:.2f} s")
            if r % spec.eval_every == 0 or r == rounds:
                result.evaluate_metrics_serverapp[r] = evaluated = evaluate(r, arrays)
                self._record(evaluated)
                if spec.checkpoint_every == 0:
                    self._save()
            if spec.checkpoint_every and r % spec.checkpoint_every == 0:
                self._save()
        self._finish()
        return result

    # -- exchanges ---------------------------------------------------------------------------------

    def exchange(self, grid: Grid, messages: Sequence[Message], timeout: float) -> list[Message]:
        return exchange(grid, messages, timeout, self.poll_interval)

    def handshake(self, grid: Grid) -> None:
        """Learn which node holds which partition, checking sizes and settings (before any training message)."""
        if not self.nodes:
            self.nodes = handshake(grid, [self], self.connect_timeout, self.poll_interval)

    def _gradient_exchange(self, grid: Grid, rnd: RoundInfo, points: list[torch.Tensor]) -> tuple[RoundInfo, list[torch.Tensor], list[int]]:
        """FedShuffleMVR's extra exchange: every distinct member returns ∇f_i at each point; rows in cohort order."""
        shared = tensors_record({str(k): p for k, p in enumerate(points)})
        clients = np.unique(rnd.cohort).tolist()
        messages = [
            Message(RecordDict({"points": shared, "instructions": ConfigRecord({"run": self.run.index, "round": rnd.index, "client": c})}), self.nodes[c], GRADIENTS, group_id=str(rnd.index + 1), ttl=self._ttl())
            for c in clients
        ]
        replies = self.exchange(grid, messages, self.round_timeout)
        answers = self._answers(messages, clients, replies)
        rows = {c: record_tensors(m.content["gradients"], self.half.dtype, self.half.device) for c, m in answers.items()}
        keep = np.array([int(i) in rows for i in rnd.cohort], dtype=bool)
        dropped = sorted({int(i) for i in rnd.cohort[~keep]})
        rnd = keep_members(rnd, keep)
        gradients = [torch.stack([rows[int(i)][str(k)] for i in rnd.cohort]) if len(rnd.cohort) else points[k].new_zeros((0, points[k].numel())) for k in range(len(points))]
        return rnd, gradients, dropped

    def _answers(self, messages: Sequence[Message], clients: Sequence[int], replies: Iterable[Message]) -> dict[int, Message]:
        """The replies without error, keyed by the client each message was sent to; an error reply goes
        through :meth:`_check_error` (an unanswered member is left out, any other error stops the run)."""
        sent = {m.metadata.message_id: c for m, c in zip(messages, clients) if m.metadata.message_id}
        answers: dict[int, Message] = {}
        for reply in replies:
            client = sent.get(reply.metadata.reply_to_message_id)
            if client is None:
                continue
            if reply.has_error():
                self._check_error(reply, client)
            else:
                answers[client] = reply
        return answers

    def _check_error(self, reply: Message, client: int) -> None:
        """An unanswered message is unfinished work (the caller drops the member); any other error stops the run."""
        code, reason = int(reply.error.code), reply.error.reason
        if code in UNANSWERED:
            return
        node = self.nodes.get(client)
        if code == STATE_LOST:
            raise ClientStateLost(f"client {client} (node {node}): {reason}")
        raise FederationError(f"client {client} (node {node}) failed: {reason} (error code {code})")

    def _result(self, rnd: RoundInfo, answers: dict[int, Message]) -> ClientResult:
        """The members' payload rows in cohort order, their work, and their diagnostics (member-weighted means)."""
        decoded = {c: record_tensors(m.content["payload"], self.half.dtype, self.half.device) for c, m in answers.items()}
        occurrence: dict[int, int] = {}
        rows: dict[str, list[torch.Tensor]] = {}
        for i in rnd.cohort.tolist():
            k = occurrence[i] = occurrence.get(i, -1) + 1
            for name, value in decoded[i].items():
                rows.setdefault(name, []).append(value[k])
        payload = {name: torch.stack(values) for name, values in rows.items()}
        work, extras, members = 0, {}, 0
        for c in decoded:
            info = answers[c].content["result"]
            m = int(info["members"])
            work += int(info["sample-gradients"])
            members += m
            for key, value in info.items():
                if key.startswith("extra."):
                    extras[key[6:]] = extras.get(key[6:], 0.0) + m * float(value)
        return ClientResult(payload, sample_gradients=work, extras={k: v / members for k, v in extras.items()})

    # -- bookkeeping -------------------------------------------------------------------------------

    def _ttl(self) -> float:
        """Messages outlive their round by a minute, then expire (a node that comes back does not run stale rounds)."""
        return self.round_timeout + 60.0

    def _model_of(self, arrays: ArrayRecord) -> torch.Tensor:
        return record_tensors(arrays, self.half.dtype, self.half.device)["model"]

    def _record(self, evaluation: MetricRecord | None) -> None:
        """A metrics row: the run's cost so far, the evaluation, the method's diagnostics, members dropped so far."""
        extras = {**self.half.last_extras, "dropped": self.dropped}
        evaluated = metrics.Evaluation(self.half.counters, self.half.data.num_samples, self.run.spec.run.bandwidth_mib_s, extras, dict(evaluation or {}))
        row = metrics.evaluate(evaluated)
        self.rows.append(row)
        if self.out is not None:
            write_metrics(self.out / "metrics.csv", self.rows)

    def _write_config(self) -> None:
        if self.out is None:
            return
        write_json(self.out / "config.json", {
            "spec": self.run.spec.model_dump(), "label": self.run.label, "point": {}, "seed": self.run.seed, "step_sizes": self.step_sizes,
            "environment": environment(), "flower": {"nodes": {str(k): v for k, v in sorted(self.nodes.items())}, "digest": self.run.digest},
        })

    def _save(self) -> None:
        """The server's checkpoint: model, server and method state, counters, each client's last accepted round, metrics."""
        if self.out is None:
            return
        save_checkpoint(self.out / "checkpoint.pt", {"simulation": self.half.state_dict(), "rows": self.rows, "round_seconds": self.round_seconds, "nodes": dict(self.nodes)})

    def _finish(self) -> None:
        if self.out is None:
            return
        self._save()
        npy = io.BytesIO()
        np.save(npy, self.half.params.detach().double().cpu().numpy())
        write_atomic(self.out / "final_params.npy", npy.getvalue())
        write_json(self.out / "summary.json", sealed({"status": "complete", "message": "", "final": self.rows[-1], "rounds": self.half.counters.rounds,
                                                     "label": self.run.label, "point": {}, "seed": self.run.seed, "round_seconds": self.round_seconds}, self.out))


def exchange(grid: Grid, messages: Sequence[Message], timeout: float, poll_interval: float = 0.5) -> list[Message]:
    """Push ``messages``, then pull their replies until all came or ``timeout`` s passed, waiting 10 ms after the
    first pull and doubling up to ``poll_interval`` s (Flower's own ``send_and_receive`` waits 3 s between pulls on a SuperLink)."""
    messages = list(messages)
    if not messages:
        return []
    waiting = {i for i in grid.push_messages(messages) if i}
    deadline, replies, wait = time.monotonic() + timeout, [], 0.01
    while waiting:
        got = list(grid.pull_messages(waiting))
        replies += got
        waiting -= {m.metadata.reply_to_message_id for m in got}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
        wait = min(2 * wait, poll_interval)
    return replies


def handshake(grid: Grid, strategies: Sequence[FedShuffleStrategy], connect_timeout: float, poll_interval: float = 0.5) -> dict[int, int]:
    """One exchange for all runs of an app: partition → node id, every node's sizes and fingerprints checked.

    Waits up to ``connect_timeout`` s for one node per partition (the largest run's number of clients),
    then asks each node for its ``partition-id``, ``num-partitions`` and, per run, its dataset size and the
    fingerprint of the settings it would run. Any mismatch raises :class:`FederationError` naming the node.
    """
    n = max(s.half.data.num_clients for s in strategies)
    deadline = time.monotonic() + connect_timeout
    while len(ids := sorted(grid.get_node_ids())) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    if len(ids) < n:
        raise FederationError(f"{len(ids)} node(s) connected within {connect_timeout:g} s; the run has {n} clients (one node per partition, partition-id 0..{n - 1})")
    ask = ConfigRecord({"runs": [s.run.index for s in strategies]})
    messages = [Message(RecordDict({"fedshuffle": ask}), node, HANDSHAKE, ttl=connect_timeout + 60.0) for node in ids]
    nodes: dict[int, int] = {}
    for reply in exchange(grid, messages, max(1.0, deadline - time.monotonic()), poll_interval):
        node = reply.metadata.src_node_id
        if reply.has_error():
            raise FederationError(f"node {node} failed the handshake: {reply.error.reason}")
        info = reply.content["node"]
        part, parts = int(info["partition-id"]), int(info["num-partitions"])
        if parts not in (-1, n) or not 0 <= part < n:
            raise FederationError(f"node {node} has partition-id={part} num-partitions={parts}; the federation has {n} clients (partition-id 0..{n - 1}, num-partitions={n})")
        if part in nodes:
            raise FederationError(f"nodes {nodes[part]} and {node} both hold partition {part}")
        for s, size, digest in zip(strategies, info["sizes"], info["digests"]):
            if part >= s.half.data.num_clients:
                continue
            if digest != s.run.digest:
                raise FederationError(f"node {node} (partition {part}) would run other settings for {s.run.label or 'the run'!r} (fingerprint {digest}, the server's {s.run.digest}): "
                                      "start every node from the same app and run config")
            if int(size) != int(s.half.data.sizes[part]):
                raise FederationError(f"node {node} holds {int(size)} samples for partition {part}, the config's partition has {int(s.half.data.sizes[part])}")
        nodes[part] = node
    missing = sorted(set(range(n)) - set(nodes))
    if missing:
        raise FederationError(f"no node answered the handshake for partition(s) {', '.join(map(str, missing))} within {connect_timeout:g} s")
    return nodes
