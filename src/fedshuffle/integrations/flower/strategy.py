"""The server half of any fedshuffle method as a Flower strategy.

:class:`FedShuffleStrategy` runs one :class:`~fedshuffle.integrations.flower.common.FederatedRun`
round by round exactly as :class:`fedshuffle.simulation.Simulation` does, with the clients' halves
on Flower nodes::

    handshake (once)    the clients each node hosts, their |D_i| and the run's fingerprint
    re-join (per round) node ids not seen before are asked the same; a node that passes takes over its clients
    configure_train     S ~ sampler (fedshuffle's seeded streams), plans, [FedShuffleMVR: ∇f_i(x^r), ∇f_i(x^{r−1})
                        from each member], broadcast; one message per distinct member with its exact plans
    aggregate_train     replies in cohort order → the method's aggregate → server optimizer → x^{r+1}

The cohort, plans, broadcast, aggregation and server step are the simulation's own code
(:class:`ServerHalf` is the simulation's :class:`~fedshuffle.simulation.Server`, on the clients' sizes alone),
so a federation reproduces ``fedshuffle run`` to rounding. The rounds are driven by the same
:class:`~fedshuffle.experiments.loop.RoundLoop` as ``fedshuffle run``'s, which owns the evaluations,
the divergence stop, the checkpoints and the results folder; a Flower round is only the loop's step.
A member whose reply does not come within the round's timeout is unfinished work: it is dropped from
the round (the method's aggregation of the members that finished; the client's state is not advanced)
and counted in the round's metrics.

Nodes may leave and come back (:meth:`FedShuffleStrategy.rejoin`). The run starts once every client is hosted
(the handshake waits up to the connect timeout); afterwards the cohort is still drawn from all clients by the
seeded sampler, and a member whose node is offline is sent nothing and dropped as unfinished work. A restarted
SuperNode comes back with a new node id: at the start of each round the server asks node ids it has not seen
for their clients, and a node whose report passes the handshake's checks (fingerprint, model size, each
client's size and rows' digest equal to what the client's first node reported) serves its clients from then on.

No reply is trusted: each must hold exactly the method's declared payload (``Method.payload_fields``),
one row per member, in the run's dtype and the model's size, finite, with the counts the server sent
(client, round, members) and a plausible work count (:func:`work_bound`); nothing is cast. A reply
that is not is *invalid*: with ``invalid_reply="drop"`` (the default) its member is dropped from the
round as unfinished work, with the reason logged and counted (``rejected``); with ``"stop"`` the run
stops with :class:`FederationError` naming the client and the entry.

With ``secure`` (run-config ``secure-aggregation = true``), a method whose server half needs only Σ_S ν_iΔ_i gets that
sum
through Flower's SecAgg+ instead of the members' payloads: training replies carry counts only, and the server never
holds a member's update (:mod:`~fedshuffle.integrations.flower.secagg`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

# first: a clear message where Flower is not installed
from fedshuffle.integrations.flower.messages import (  # isort: skip
    EVALUATE,
    GRADIENTS,
    HANDSHAKE,
    STATE_LOST,
    TRAIN,
    UNANSWERED,
    InvalidReply,
    checked_float,
    checked_int,
    checked_tensors,
    plans_records,
    record_tensors,
    tensors_record,
)
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedshuffle import metrics
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.loop import Callback, Driver, RoundLoop
from fedshuffle.data.federated import objective_weights
from fedshuffle.experiments.build import build_algorithm_from, build_sampler
from fedshuffle.experiments.runner import DTYPES, RunFolder, build_simulation, check_against_data, check_local_work
from fedshuffle.experiments.schema import slug
from fedshuffle.data import FederatedDataset
from fedshuffle.integrations.flower.bundle import installed_version
from fedshuffle.integrations.flower.common import (
    INVALID_REPLY_POLICIES,
    FederatedRun,
    Population,
    check_evaluation,
    format_clients,
)
from fedshuffle.integrations.flower.nodedata import SampleKind, refuse_theory, rows_digest
from fedshuffle.integrations.flower.secagg import (
    SecureAggregation,
    refuse_individual_updates,
    rescaling,
    secure_sum,
    sum_metrics,
)
from fedshuffle.local.plan import ClientPlan, CohortPlan
from fedshuffle.methods.base import ClientResult, Method, RoundInfo, sample_gradients
from fedshuffle.simulation import RoundRecord, Server


#: the scores a federated evaluation gives (the others need the data at the server)
FEDERATED_SCORES = ("loss", "grad_norm_sq", "train_accuracy")


class FederationError(RuntimeError):
    """The federation cannot go on: wrong or missing nodes, a failing ClientApp, lost client state, an invalid
    reply under ``invalid_reply="stop"``."""


def work_bound(method: Method, plans: Sequence[ClientPlan], size: int) -> int:
    """The most per-sample gradients a reply for ``plans`` (one client of ``size`` samples) may report.

    Four times the planned steps' minibatch gradients (FedShuffleMVR takes a second minibatch gradient per
    step; FedCDR's SGD prox solves a new client's first prox with as many again), plus per member one pass
    over the client's data (SCAFFOLD option I's control variate) and the method's own extra passes
    (:meth:`~fedshuffle.methods.base.Method.extra_passes`: FedCDR's L-BFGS prox). A bound for plausibility, not the
    exact cost.
    """
    passes = 1 + getattr(method, "inner", method).extra_passes()
    return 4 * sample_gradients(plans) + len(plans) * passes * size


class ClientStateLost(FederationError):
    """A client's state (SCAFFOLD's c_i, FedCDR's y_i, …) is not on its node any more: never silently reset."""


class ServerHalf(Server):
    """The simulation's :class:`Server` on the population's sizes alone: cohort, plans, broadcast, aggregation and
    server step, no samples and no client rows (nodes keep their own). ``last_round[i]`` is the last
    round whose update the server accepted from client i (−1: never); it is what a client's state must
    match, and it says who takes part for the first time. The members dropped so far are the ``dropped``
    entry of ``last_extras`` (the ``dropped`` metric)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.last_round = np.full(self.data.num_clients, -1, dtype=np.int64)
        self.last_extras = {"dropped": 0}

    @property
    def dropped(self) -> int:
        return int(self.last_extras.get("dropped", 0))

    def close_round(
        self,
        rnd: RoundInfo,
        points: list[torch.Tensor],
        broadcast: dict[str, torch.Tensor],
        result: ClientResult | None,
        compute_seconds: float = 0.0,
        dropped: int = 0,
    ) -> RoundRecord:
        """:meth:`Server.close_round` of the members that finished (``dropped``: how many did not); they are
        accepted."""
        before = self.dropped
        record = super().close_round(rnd, points, broadcast, result, compute_seconds)
        self.last_extras = {**record.extras, "dropped": before + dropped}
        self.last_round[np.unique(rnd.cohort)] = rnd.index
        return record

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
    return replace(
        rnd, cohort=rnd.cohort[keep], plans=CohortPlan.of(rnd.plans).take(np.flatnonzero(keep)), first_time=first
    )


@dataclass
class _Reply:
    """A member's checked reply: its payload rows ``(members, d)``, the work it reports, its diagnostics."""

    payload: dict[str, torch.Tensor]
    sample_gradients: int
    extras: dict[str, float]
    members: int


def _content(reply: Message, key: str) -> object:
    """``reply.content[key]``, or :class:`InvalidReply` naming what is missing."""
    try:
        return reply.content[key]
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidReply(f"no {key!r} in the reply ({type(exc).__name__})") from None


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
    grid: Grid | None = None
    weights: np.ndarray | None = None  # ν_i of the cohort's members, sent with their plans (secure aggregation)


class FedShuffleStrategy(Strategy):
    """Any registered fedshuffle method (with its sampler, local solver, aggregation and server optimizer) as a Flower
    strategy.

    Built from a :class:`FederatedRun`: everything is validated and built here, before any message is
    sent (a bad configuration raises :class:`~fedshuffle.core.errors.ConfigError`). ``out`` receives
    the run's results in ``out/<variant>/seed-<s>``, written by the loop of ``fedshuffle run``
    (:class:`~fedshuffle.experiments.runner.RunFolder`): the same files, the checkpoint holding the server's
    state (model, server and method state, counters, each client's last accepted round). With ``resume``,
    :meth:`start` continues from that checkpoint; stateful methods then need the nodes' state (``state-dir``).
    With ``secure`` (SecAgg+'s settings), the server gets only each round's weighted sum
    (:mod:`~fedshuffle.integrations.flower.secagg`).
    """

    def __init__(
        self,
        run: FederatedRun,
        *,
        round_timeout: float = 600.0,
        connect_timeout: float = 120.0,
        out: str | Path | None = None,
        resume: bool = False,
        poll_interval: float = 0.5,
        log: Callable[[str], None] | None = None,
        invalid_reply: str = "drop",
        node_data: bool = False,
        secure: SecureAggregation | None = None,
        evaluation: str = "auto",
    ) -> None:
        if invalid_reply not in INVALID_REPLY_POLICIES:
            raise ConfigError(
                "run-config.invalid-reply",
                f"unknown policy {invalid_reply!r}; accepted: {', '.join(INVALID_REPLY_POLICIES)}",
            )
        check_evaluation(evaluation, node_data)
        self.federated = evaluation == "federated" or node_data  # who scores the model: the nodes, or the server
        self.both = evaluation == "both"  # the server scores it, and the nodes' federated scores are recorded beside
        self.invalid_reply = invalid_reply
        self.run, self.node_data, self.secure = run, node_data, secure
        self.half: ServerHalf | None = None
        self.data, self.evaluator, self.step_sizes = None, None, {}
        if node_data:  # the population comes with the handshake (:meth:`adopt_population`)
            refuse_theory(run.spec, "the server builds no data (run-config node-data = true)")
            method = build_algorithm_from(run.spec).method  # its settings are checked before any message
            self.num_clients = run.spec.data.model_dump().get("clients")
        else:
            sim, self.step_sizes = build_simulation(run.spec, run.seed)
            self.half = ServerHalf(
                sim.problem,
                Population(sim.data.sizes, sim.data.weights),
                sim.algorithm,
                sim.sampler,
                seed=run.seed,
                dtype=sim.dtype,
                device=sim.device,
            )
            self.data, self.num_clients = sim.data, sim.data.num_clients
            self.evaluator = metrics.ModelScores(sim.problem, sim.data)
            method = self.half.method
        if secure is not None:  # refused before any message
            refuse_individual_updates(method, run.label or run.spec.method.name)
        self._grid: Grid | None = None
        self.round_timeout, self.connect_timeout, self.poll_interval = round_timeout, connect_timeout, poll_interval
        self.resume = resume
        self.folder = None
        if out:
            run_dir = Path(out) / (slug(run.label) if run.label else "") / f"seed-{run.seed}"
            self.folder = RunFolder(
                run_dir, run.spec, label=run.label, out_option="run-config.out", resume_option="run-config resume=true"
            )
            self.folder.check(resume=resume, extend=False)  # refused before any message
        self.nodes: dict[int, int] = {}  # client → node id
        self.asked: set[int] = set()  # node ids asked for their clients
        self.online: set[int] = set()  # node ids the SuperLink listed at the last re-join
        self.held: dict[int, str] = {}  # client → its rows' digest, as its first node reported it
        self._joining: dict[
            str, int
        ] = {}  # handshake message id → node id, for nodes that joined and have not answered
        self.rejected = 0  # clients dropped from a round for an invalid reply
        self._rejected_now: list[int] = []  # … in the open round
        self._open: _OpenRound | None = None
        self._log = log or (lambda text: None)

    # -- Flower's strategy interface --------------------------------------------------------------

    def adopt_population(self, sizes: np.ndarray, sample: SampleKind) -> None:
        """The server half of a run whose data only the nodes hold: the problem built for the nodes' kind of samples,
        the objective weights w_i (``data.weights``) and the sampler on the clients' sizes |D_i| the handshake
        reported."""
        spec = self.run.spec
        problem = sample.problem(spec)
        check_against_data(spec, len(sizes))
        population = Population(sizes, objective_weights(sizes, spec.data.weights))
        sampler = build_sampler(spec.sampler, population)
        algorithm = build_algorithm_from(spec)
        check_local_work(spec, algorithm.local, sizes)
        self.half = ServerHalf(
            problem,
            population,
            algorithm,
            sampler,
            seed=self.run.seed,
            dtype=DTYPES[spec.run.dtype],
            device=spec.run.device,
        )
        self.num_clients = len(sizes)

    def summary(self) -> None:
        self._log(
            f"fedshuffle run {self.run.label or self.run.spec.method.name!r} (seed {self.run.seed}): "
            f"{self.half.method.describe()}, "
            f"{self.half.sampler.describe()}, {self.half.data.num_clients} clients, {self.run.spec.run.rounds} rounds"
        )

    def initial_arrays(self) -> ArrayRecord:
        """x⁰ from the run's seeded stream, as ``fedshuffle run`` starts."""
        return tensors_record({"model": self.half.params})

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round's messages: one per distinct member, carrying its plans, the broadcast and its last accepted round.

        ``arrays`` must be the current model (the strategy keeps the model it aggregates). The first
        call does the handshake; FedShuffleMVR's gradient exchange happens here, before the broadcast.
        """
        if not self.nodes:
            self.handshake(grid)
        else:
            self.rejoin(grid, min(self.connect_timeout, self.round_timeout))
        half = self.half
        if not torch.equal(self._model_of(arrays), half.params):
            raise FederationError(
                "configure_train got a model other than the strategy's current one (a fedshuffle strategy keeps the "
                "model it aggregates)"
            )
        rnd, points = half.open_round()
        self._rejected_now = []
        if server_round != rnd.index + 1:
            raise FederationError(f"round {server_round} asked for, the run is at round {rnd.index + 1}")
        started, dropped, gradients = time.monotonic(), [], []
        if points:
            rnd, gradients, dropped = self._gradient_exchange(grid, rnd, points)
        broadcast = half.broadcast(rnd, points, gradients)
        shared = tensors_record(broadcast)
        messages, clients = [], self._reachable(np.unique(rnd.cohort).tolist(), server_round)
        weights = half.method.sum_weights(rnd) if self.secure is not None else None
        plans = CohortPlan.of(rnd.plans)
        for client in clients:
            members = np.flatnonzero(plans.clients == client)
            plans_config, batches = plans_records(plans.take(members))
            plans_config.update(
                {
                    "run": self.run.index,
                    "round": rnd.index,
                    "client": client,
                    "lr-scale": float(rnd.lr_scale),
                    "last-round": int(half.last_round[client]),
                }
            )
            if weights is not None:  # the node keeps Σ ν_iΔ_i of the client's members for the SecAgg+ exchange
                plans_config["weights"] = [float(w) for w in np.asarray(weights)[members]]
            content = RecordDict({"broadcast": shared, "plans": batches, "instructions": plans_config})
            messages.append(Message(content, self.nodes[client], TRAIN, group_id=str(server_round), ttl=self._ttl()))
        self._open = _OpenRound(rnd, points, broadcast, messages, clients, dropped, started, grid, weights)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """x^{r+1} from the replies: the members that answered, in cohort order, aggregated by the method.

        Members without a reply (timeout, node gone) are dropped as unfinished work; their clients'
        last accepted round stays, so their nodes discard the unaccepted state next time.
        """
        if self._open is None:
            raise FederationError("aggregate_train without configure_train")
        state, self._open = self._open, None
        rnd = state.rnd
        decoded, plans = {}, CohortPlan.of(rnd.plans)
        for client, reply in self._answers(state.messages, state.clients, replies).items():
            try:
                decoded[client] = self._read_train_reply(
                    reply, client, plans.take(np.flatnonzero(plans.clients == client)), rnd.index
                )
            except InvalidReply as exc:
                self._reject(server_round, client, exc)
        keep = np.array([int(i) in decoded for i in rnd.cohort], dtype=bool)
        unanswered = sorted({int(i) for i in rnd.cohort[~keep]} - set(self._rejected_now))
        result, secured = None, sum_metrics(None) if self.secure is not None else {}
        if self.secure is not None and keep.any():
            keep, result, secured = self._secure_result(server_round, state, keep, decoded)
        dropped = state.dropped + sorted({int(i) for i in rnd.cohort[~keep]})
        rnd = keep_members(rnd, keep)
        if self.secure is None and len(rnd.cohort):
            result = self._result(rnd, decoded)
        seconds = time.monotonic() - state.started  # the members worked in parallel: each for at most the round's time
        record = self.half.close_round(
            rnd, state.points, state.broadcast, result, compute_seconds=len(rnd.cohort) * seconds, dropped=len(dropped)
        )
        reported = {
            "members": len(rnd.cohort),
            "dropped": len(dropped),
            "rejected": len(self._rejected_now),
            "seconds": seconds,
            "sample_gradients": record.sample_gradients,
            "bytes_up": record.bytes_up,
            "bytes_down": record.bytes_down,
            **record.extras,
            **secured,
        }
        if unanswered:
            self._log(
                f"round {server_round}: no answer from client(s) {', '.join(map(str, unanswered))}: dropped as "
                "unfinished work"
            )
        return tensors_record({"model": self.half.params}), MetricRecord({k: float(v) for k, v in reported.items()})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No evaluation through Flower's evaluate round: the model is scored by :meth:`evaluate`, centrally or
        federatedly."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Centralized evaluation: f(x), f − f*, ‖x − x*‖², ‖∇f(x)‖², accuracies, as ``fedshuffle run`` records them;
        with ``node_data`` or ``evaluation="federated"``, federated evaluation (:meth:`federated_scores`); with
        ``evaluation="both"``, the central scores and the federated ones beside them (``federated_loss``, …)."""
        params = self._model_of(arrays)
        values = self.federated_scores(params) if self.federated else self.evaluator(params)
        if self.both:
            values |= {
                f"federated_{name}": value
                for name, value in self.federated_scores(params).items()
                if name in FEDERATED_SCORES
            }
        return MetricRecord({k: float(v) for k, v in values.items() if v is not None})

    def federated_scores(self, params: torch.Tensor) -> dict[str, float | None]:
        """f(x) = Σ_i w_i f_i(x), ‖∇f(x)‖² and the training accuracy from every node's share of its clients (one
        ``query.evaluate`` message per node): equal to the central scores on the pooled data to rounding. f − f*,
        ‖x − x*‖² and test scores need the data at the server and are left empty. Every client must be scored: where
        a node is offline or does not answer within the round timeout, the server re-joins nodes (waiting up to the
        connect timeout) and asks the new hosts of those clients once more, then stops with :class:`FederationError`."""
        half = self.half
        model = tensors_record({"model": params})
        loss, gradient, correct = 0.0, torch.zeros_like(params), 0.0
        waiting, why = sorted(self.nodes), {}
        for attempt in range(2):
            if attempt:
                self._await_hosts(waiting, set(why))
            else:
                self.rejoin(self._grid, 0.0)
            by_node: dict[int, list[int]] = {}
            for client in waiting:
                if self.nodes[client] in self.online:
                    by_node.setdefault(self.nodes[client], []).append(client)
                else:
                    why[self.nodes[client]] = "offline"
            messages = [
                Message(
                    RecordDict(
                        {
                            "model": model,
                            "instructions": ConfigRecord(
                                {
                                    "run": self.run.index,
                                    "clients": clients,
                                    "weights": [float(half.data.weights[c]) for c in clients],
                                }
                            ),
                        }
                    ),
                    node,
                    EVALUATE,
                    ttl=self._ttl(),
                )
                for node, clients in by_node.items()
            ]
            replies = {
                m.metadata.reply_to_message_id: m for m in self.exchange(self._grid, messages, self.round_timeout)
            }
            for message in messages:
                node = message.metadata.dst_node_id
                reply = replies.get(message.metadata.message_id)
                if reply is not None and reply.has_error() and int(reply.error.code) not in UNANSWERED:
                    raise FederationError(
                        f"node {node} did not score its clients in the federated evaluation: {reply.error.reason}"
                    )
                if reply is None or reply.has_error():
                    why[node] = (
                        reply.error.reason if reply is not None else f"no answer within {self.round_timeout:g} s"
                    )
                    continue
                part, got = self._scores_part(node, reply, params)
                loss = loss + part[0]
                gradient = gradient + part[1]
                correct = -1.0 if got < 0 or correct < 0 else correct + got
                waiting = [c for c in waiting if c not in by_node[node]]
            if not waiting:
                break
        if waiting:
            reasons = "; ".join(
                f"node {n}: {why.get(n, 'no answer')}" for n in sorted({self.nodes[c] for c in waiting})
            )
            raise FederationError(
                f"client(s) {format_clients(waiting)} could not be scored in the federated evaluation ({reasons}); "
                "restart their nodes within run-config connect-timeout, or evaluate centrally (run-config evaluation "
                '= "central", the server holding the data)'
            )
        accuracy = correct / half.data.num_samples if correct >= 0 else None
        return {
            "loss": loss,
            "grad_norm_sq": float(gradient.pow(2).sum()),
            "train_accuracy": accuracy,
            "f_gap": None,
            "dist_sq": None,
        }

    def _await_hosts(self, clients: Sequence[int], failed: set[int]) -> None:
        """Re-join nodes until every one of ``clients`` has an online host not in ``failed``, for up to the connect
        timeout."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            self.rejoin(self._grid, max(0.0, deadline - time.monotonic()))
            if (
                all(self.nodes[c] in self.online and self.nodes[c] not in failed for c in clients)
                or time.monotonic() >= deadline
            ):
                return
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    def _scores_part(self, node: int, reply: Message, params: torch.Tensor) -> tuple[tuple[float, torch.Tensor], float]:
        """A node's share of f(x) and ∇f(x), and its correct predictions (−1: the problem has no accuracy), checked."""
        try:
            info = _content(reply, "scores")
            part = checked_tensors(
                _content(reply, "gradient"), ["gradient"], (params.numel(),), self.half.dtype, "gradient"
            )["gradient"]
            loss, correct = checked_float(info, "loss", "scores"), checked_float(info, "correct", "scores")
        except (InvalidReply, AttributeError) as exc:
            raise FederationError(f"node {node} sent an invalid federated evaluation: {exc}") from None
        return (loss, part.to(params.device)), correct

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Handshake, then the run's rounds through :class:`~fedshuffle.experiments.loop.RoundLoop`, each waiting up
        to the round timeout (``timeout`` overrides it) for its replies. The server evaluates the model
        (``evaluate_fn``, else :meth:`evaluate`) every ``run.eval_every`` rounds and at the last; a model or loss
        that is not finite stops the run (diverged); with ``out``, results and checkpoints are written as
        ``fedshuffle run`` writes them. ``num_rounds`` below ``run.rounds`` pauses the run after that round
        (a checkpoint, no summary: ``resume`` continues it); a finished run is not run again when resumed."""
        spec = self.run.spec.run
        if num_rounds is not None and not 0 < num_rounds <= spec.rounds:
            raise ConfigError(
                "num_rounds",
                f"{num_rounds} rounds asked for; the run has {spec.rounds} (run.rounds): give 1..{spec.rounds} "
                "(fewer pause it)",
            )
        if timeout is not None:
            self.round_timeout = timeout
        if initial_arrays is not None:
            self.handshake(grid)
            if not torch.equal(self._model_of(initial_arrays), self.half.params):
                raise FederationError("a fedshuffle run starts from its own x⁰ (run.seed); leave initial_arrays out")
        self.handshake(grid)
        if self.secure is not None:
            self.secure.check_federation(len(self._run_nodes()))
            self.secure.check_resolution(self.half.params)
        self._grid = grid
        self.summary()
        rounds = _FlowerRounds(self, grid, train_config or ConfigRecord(), evaluate_fn or self.evaluate)
        executor = {
            "name": "flower",
            "digest": self.run.digest,
            "nodes": {str(k): v for k, v in sorted(self.nodes.items())},
            "evaluation": "both" if self.both else "federated" if self.federated else "central",
        }
        driver = Driver(self.half, rounds.step, rounds.score, executor, self.step_sizes)
        if self.folder is None:
            status, message = RoundLoop(
                driver, rounds=spec.rounds, eval_every=spec.eval_every, bandwidth_mib_s=spec.bandwidth_mib_s
            ).run([rounds], num_rounds)
        else:
            outcome = self.folder.run(
                lambda: driver, resume=self.resume, experiment=self.run.experiment, callbacks=[rounds], until=num_rounds
            )
            status, message = outcome.status, outcome.message
            if not rounds.result.arrays:  # finished before, and not run again: its final model
                final = torch.from_numpy(np.load(self.folder.run_dir / "final_params.npy")).to(self.half.dtype)
                rounds.result.arrays = tensors_record({"model": final})
        self._log(f"{self.run.label or self.run.spec.method.name!r} (seed {self.run.seed}): {message or status}")
        return rounds.result

    def rows_digest(self, client: int) -> str | None:
        """:func:`~.nodedata.rows_digest` of ``client``'s rows in the server's data (None for data generated on
        demand: not checked)."""
        if not isinstance(self.data, FederatedDataset):
            return None
        return rows_digest(self.data, client)

    # -- exchanges ---------------------------------------------------------------------------------

    def exchange(self, grid: Grid, messages: Sequence[Message], timeout: float) -> list[Message]:
        return exchange(grid, messages, timeout, self.poll_interval)

    def handshake(self, grid: Grid) -> None:
        """Learn which node hosts which client, checking sizes and settings (before any training message)."""
        if not self.nodes:
            self.nodes = handshake(grid, [self], self.connect_timeout, self.poll_interval)

    def rejoin(self, grid: Grid, wait: float) -> None:
        """Re-learn which node hosts which client: the node ids the SuperLink lists are ``online``; each one not seen
        before is asked for its clients (the handshake's message) and its answer awaited up to ``wait`` s (a later
        answer is taken at a later round). A node whose report passes the handshake's checks, each client's rows'
        digest equal to what the client's first node reported included, serves its clients from then on (a restarted
        SuperNode comes back with a new node id); one that does not is logged and not used."""
        self.online = set(grid.get_node_ids())
        new = sorted(self.online - self.asked)
        self.asked.update(new)
        if new:
            ask = ConfigRecord({"runs": [self.run.index]})
            messages = [
                Message(RecordDict({"fedshuffle": ask}), node, HANDSHAKE, ttl=self.connect_timeout + 60.0)
                for node in new
            ]
            self._joining.update({i: node for i, node in zip(grid.push_messages(messages), new) if i})
        deadline, pause = time.monotonic() + wait, 0.01
        while self._joining:
            for reply in grid.pull_messages(list(self._joining)):
                node = self._joining.pop(reply.metadata.reply_to_message_id, None)
                if node is not None:
                    self._take_over(node, reply)
            if not self._joining or time.monotonic() >= deadline:
                break
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, self.poll_interval)

    def _take_over(self, node: int, reply: Message) -> None:
        """A joining node's handshake reply: checked as at the start; its clients of this run are served by it from
        now."""
        try:
            clients, (report,) = _handshake_report(reply, node, [self], None)
            _check_report(self, node, report)
        except FederationError as exc:
            self._log(f"node {node} joined and is not used: {exc}")
            return
        ours = [c for c in clients if c < self.num_clients]
        if ours:
            before = sorted({self.nodes[c] for c in ours if c in self.nodes})
            self.nodes.update({c: node for c in ours})
            self._log(
                f"node {node} joined: it serves client(s) {format_clients(ours)} from now on (node(s) "
                f"{', '.join(map(str, before)) or 'none'} before)"
            )

    def _reachable(self, clients: Sequence[int], server_round: int) -> list[int]:
        """Those of ``clients`` whose node is online; the others get no message (unfinished work: dropped)."""
        offline = [c for c in clients if self.nodes[c] not in self.online]
        if offline:
            self._log(
                f"round {server_round}: client(s) {format_clients(offline)} on offline node(s) "
                f"{', '.join(map(str, sorted({self.nodes[c] for c in offline})))}: dropped as unfinished work"
            )
        return [c for c in clients if c not in offline]

    def _gradient_exchange(
        self, grid: Grid, rnd: RoundInfo, points: list[torch.Tensor]
    ) -> tuple[RoundInfo, list[torch.Tensor], list[int]]:
        """FedShuffleMVR's extra exchange: every distinct member returns ∇f_i at each point; rows in cohort order."""
        shared = tensors_record({str(k): p for k, p in enumerate(points)})
        clients = self._reachable(np.unique(rnd.cohort).tolist(), rnd.index + 1)
        messages = [
            Message(
                RecordDict(
                    {
                        "points": shared,
                        "instructions": ConfigRecord({"run": self.run.index, "round": rnd.index, "client": c}),
                    }
                ),
                self.nodes[c],
                GRADIENTS,
                group_id=str(rnd.index + 1),
                ttl=self._ttl(),
            )
            for c in clients
        ]
        replies = self.exchange(grid, messages, self.round_timeout)
        rows = {}
        for c, reply in self._answers(messages, clients, replies).items():
            try:
                self._check_sender(reply, c)
                rows[c] = checked_tensors(
                    _content(reply, "gradients"),
                    [str(k) for k in range(len(points))],
                    (self.half.params.numel(),),
                    self.half.dtype,
                    "gradients",
                )
            except InvalidReply as exc:
                self._reject(rnd.index + 1, c, exc)
        rows = {c: {k: v.to(self.half.device) for k, v in got.items()} for c, got in rows.items()}
        keep = np.array([int(i) in rows for i in rnd.cohort], dtype=bool)
        dropped = sorted({int(i) for i in rnd.cohort[~keep]})
        rnd = keep_members(rnd, keep)
        gradients = [
            torch.stack([rows[int(i)][str(k)] for i in rnd.cohort])
            if len(rnd.cohort)
            else points[k].new_zeros((0, points[k].numel()))
            for k in range(len(points))
        ]
        return rnd, gradients, dropped

    def _answers(
        self, messages: Sequence[Message], clients: Sequence[int], replies: Iterable[Message]
    ) -> dict[int, Message]:
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

    def _check_sender(self, reply: Message, client: int) -> None:
        node = self.nodes.get(client)
        if reply.metadata.src_node_id != node:
            raise InvalidReply(f"sent by node {reply.metadata.src_node_id}, the message went to node {node}")

    def _read_train_reply(self, reply: Message, client: int, plans: Sequence[ClientPlan], round_index: int) -> _Reply:
        """A member's reply checked against what the server sent it (see the module docstring);
        :class:`InvalidReply` if it is not."""
        self._check_sender(reply, client)
        info = _content(reply, "result")
        if not isinstance(info, ConfigRecord):
            raise InvalidReply(f"result: expected a config record, got {type(info).__name__}")
        members = len(plans)
        for key, wanted in (("client", client), ("round", round_index), ("members", members)):
            checked_int(info, key, wanted, wanted, "result")
        work = checked_int(
            info,
            "sample-gradients",
            0,
            work_bound(self.half.method, plans, int(self.half.data.sizes[client])),
            "result",
        )
        unknown = sorted(
            k
            for k in info
            if k not in ("client", "round", "members", "sample-gradients") and not k.startswith("extra.")
        )
        if unknown:
            raise InvalidReply(f"result: unexpected entries {unknown[:5]}")
        extras = {key[6:]: checked_float(info, key, "result") for key in info if key.startswith("extra.")}
        fields = (
            () if self.secure is not None else self.half.method.payload_fields
        )  # secure: the update stays on the node
        payload = checked_tensors(
            _content(reply, "payload"), fields, (members, self.half.params.numel()), self.half.dtype, "payload"
        )
        return _Reply({name: value.to(self.half.device) for name, value in payload.items()}, work, extras, members)

    def _reject(self, server_round: int, client: int, error: InvalidReply) -> None:
        """An invalid reply: stop the run (``invalid_reply="stop"``) or log why its member is dropped."""
        where = (
            f"client {client} (node {self.nodes.get(client)}) sent an invalid reply in round {server_round}: {error}"
        )
        if self.invalid_reply == "stop":
            raise FederationError(f'{where} (run-config invalid-reply = "stop")')
        self.rejected += 1
        self._rejected_now.append(client)
        self._log(f"{where}; dropped from the round, the model is not changed by it")

    def _secure_result(
        self, server_round: int, state: _OpenRound, keep: np.ndarray, decoded: dict[int, _Reply]
    ) -> tuple[np.ndarray, ClientResult | None, dict[str, float]]:
        """The round's aggregate through SecAgg+ (:func:`~.secagg.secure_sum`) over the nodes of the members that
        answered (``keep``),
        with a node without members where only one node has any: the members whose node's input is in the sum stay, and
        their aggregate is d = ρ·Σ_k s_k (ρ: their weights ν_i over the ν_i they were sent,
        :func:`~.secagg.rescaling`)."""
        rnd, half = state.rnd, self.half
        inputs: dict[int, list[int]] = {}
        for client in sorted({int(i) for i in rnd.cohort[keep]}):
            inputs.setdefault(self.nodes[client], []).append(client)
        for node in sorted(self._run_nodes() - set(inputs))[: max(0, 2 - len(inputs))]:
            inputs[node] = []
        summed = secure_sum(state.grid, self.secure, inputs, self.run.index, rnd.index, self.round_timeout)
        for node, error in summed.errors:
            if int(error.code) not in UNANSWERED:
                raise FederationError(
                    f"node {node} failed the secure aggregation of round {server_round}: {error.reason}"
                )
        extras = sum_metrics(summed)
        if summed.total is None:
            self._log(
                f"round {server_round}: SecAgg+ halted (too few nodes answered for reconstruction-threshold): every "
                "member dropped, the model is not changed"
            )
            return np.zeros_like(keep), None, extras
        bound = len(summed.nodes) * self.secure.clipping_range + self.secure.tolerance(len(summed.nodes))
        if not np.all(
            np.abs(summed.total) <= bound
        ):  # inputs in [−c, c] cannot sum beyond this: a masked input was malformed
            raise FederationError(
                f"round {server_round}: the SecAgg+ sum of {len(summed.nodes)} node(s) has entries beyond "
                f"±{bound:g}: a node sent a malformed masked input"
            )
        keep = keep & np.array([self.nodes[int(i)] in summed.nodes for i in rnd.cohort], dtype=bool)
        kept = keep_members(rnd, keep)
        rho = rescaling(state.weights[keep], half.method.sum_weights(kept))
        if rho is None:
            raise FederationError(
                f"round {server_round}: the method's weights of the members that remain are not one multiple of "
                "those they were sent; the secure sum cannot be rescaled"
            )
        result = self._result(kept, {c: decoded[c] for c in np.unique(kept.cohort).tolist()})
        result.payload = {"delta_sum": torch.from_numpy(rho * summed.total).to(half.device, half.dtype)}
        return keep, result, extras

    def _run_nodes(self) -> set[int]:
        """The nodes hosting clients of this run (a node of the app may host only clients of a larger run)."""
        return {node for client, node in self.nodes.items() if client < self.half.data.num_clients}

    def _result(self, rnd: RoundInfo, decoded: dict[int, _Reply]) -> ClientResult:
        """The members' payload rows in cohort order, their work, and their diagnostics (member-weighted means)."""
        occurrence: dict[int, int] = {}
        rows: dict[str, list[torch.Tensor]] = {}
        for i in rnd.cohort.tolist():
            k = occurrence[i] = occurrence.get(i, -1) + 1
            for name, value in decoded[i].payload.items():
                rows.setdefault(name, []).append(value[k])
        payload = {name: torch.stack(values) for name, values in rows.items()}
        work, extras, members = 0, {}, 0
        for reply in decoded.values():
            work += reply.sample_gradients
            members += reply.members
            for key, value in reply.extras.items():
                extras[key] = extras.get(key, 0.0) + reply.members * value
        return ClientResult(payload, sample_gradients=work, extras={k: v / members for k, v in extras.items()})

    # -- bookkeeping -------------------------------------------------------------------------------

    def _ttl(self) -> float:
        """Messages outlive their round by a minute, then expire (a node that comes back does not run stale rounds)."""
        return self.round_timeout + 60.0

    def _model_of(self, arrays: ArrayRecord) -> torch.Tensor:
        return record_tensors(arrays, self.half.dtype, self.half.device)["model"]


class _FlowerRounds(Callback):
    """The loop's step and scores on Flower: a round is :meth:`~FedShuffleStrategy.configure_train`, the messages'
    exchange and :meth:`~FedShuffleStrategy.aggregate_train`; Flower's :class:`Result` follows the run."""

    def __init__(
        self,
        strategy: FedShuffleStrategy,
        grid: Grid,
        train_config: ConfigRecord,
        evaluate: Callable[[int, ArrayRecord], MetricRecord | None],
    ) -> None:
        self.strategy, self.grid, self.train_config, self.evaluate = strategy, grid, train_config, evaluate
        self.result = Result()

    def on_start(self, loop: RoundLoop) -> None:
        s = self.strategy
        self.result.arrays = s.initial_arrays()  # a resumed run's model
        if loop.sim.counters.rounds:
            s._log(f"resumed {s.run.label or s.run.spec.method.name!r} at round {loop.sim.counters.rounds}")

    def step(self) -> None:
        s, r = self.strategy, self.strategy.half.counters.rounds + 1
        messages = list(s.configure_train(r, self.result.arrays, self.train_config, self.grid))
        arrays, reported = s.aggregate_train(r, s.exchange(self.grid, messages, s.round_timeout))
        self.result.arrays, self.result.train_metrics_clientapp[r] = arrays, reported
        secured = (
            f", SecAgg+ sum of {int(reported['secagg_nodes'])} node(s), {int(reported['secagg_bytes_up'])} B up"
            if "secagg_nodes" in reported
            else ""
        )
        s._log(
            f"round {r}/{s.run.spec.run.rounds}: {int(reported['members'])} member(s), {int(reported['dropped'])} "
            f"dropped, {reported['seconds']:.2f} s{secured}"
        )

    def score(self) -> dict[str, float]:
        r = self.strategy.half.counters.rounds
        evaluated = self.result.evaluate_metrics_serverapp[r] = self.evaluate(r, self.result.arrays)
        return dict(evaluated or {})


def exchange(grid: Grid, messages: Sequence[Message], timeout: float, poll_interval: float = 0.5) -> list[Message]:
    """Push ``messages``, then pull their replies until all came or ``timeout`` s passed, waiting 10 ms after the
    first pull and doubling up to ``poll_interval`` s (Flower's own ``send_and_receive`` waits 3 s between pulls on a
    SuperLink)."""
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


def handshake(
    grid: Grid, strategies: Sequence[FedShuffleStrategy], connect_timeout: float, poll_interval: float = 0.5
) -> dict[int, int]:
    """One exchange for all runs of an app: client → node id, every node's clients, sizes and fingerprints checked.

    For up to ``connect_timeout`` s, asks every node that connects (once each) for the clients it hosts and,
    per run, each one's dataset size and rows' digest, the model's size and the fingerprint of the settings it
    would run, until every client of the largest run is hosted. Two nodes hosting one client, a client no node
    hosts, a size, digest, model size or fingerprint other than the server's: :class:`FederationError` naming
    the node and client, before any training message. A run whose data only the nodes hold (``node_data``)
    takes its clients' sizes and kind of samples from the replies (:meth:`FedShuffleStrategy.adopt_population`);
    where its number of clients is not in its settings (``data.clients``), the handshake waits the whole
    ``connect_timeout`` and the clients are those the nodes host, which must be 0..n−1.

    A node the SuperLink lists but that is dead (its reply an "unavailable" error, as during training: a run resumed
    after a node was lost) is left out, with a line in the log, and asked again while the handshake waits; the run
    starts once the nodes that answer host every client, as always, and the error for a client no node hosts names
    the unavailable nodes.
    """
    counts = [s.num_clients for s in strategies]
    wanted = max(counts) if all(c is not None for c in counts) else None
    ask = ConfigRecord({"runs": [s.run.index for s in strategies]})
    deadline = time.monotonic() + connect_timeout
    nodes: dict[int, int] = {}
    reports: dict[int, list[_NodeReport]] = {}  # node → its report per run
    asked: set[int] = set()
    waiting: dict[str, int] = {}  # message id → node
    unavailable: dict[int, str] = {}  # node → why it did not answer (listed, but dead)
    while (wanted is None or len(nodes) < wanted) and time.monotonic() < deadline:
        new = [node for node in sorted(grid.get_node_ids()) if node not in asked]
        asked.update(new)
        messages = [
            Message(RecordDict({"fedshuffle": ask}), node, HANDSHAKE, ttl=connect_timeout + 60.0) for node in new
        ]
        if messages:
            waiting.update({i: node for i, node in zip(grid.push_messages(messages), new) if i})
        for reply in grid.pull_messages(list(waiting)) if waiting else []:
            node = waiting.pop(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            if reply.has_error() and int(reply.error.code) in UNANSWERED:
                if node not in unavailable:
                    strategies[0]._log(
                        f"node {node} is listed but did not answer the handshake "
                        f"({UNANSWERED[int(reply.error.code)]}): left out unless it answers later"
                    )
                unavailable[node] = UNANSWERED[int(reply.error.code)]
                asked.discard(node)  # asked again while the handshake waits, if it is still listed
                continue
            unavailable.pop(node, None)
            clients, reports[node] = _handshake_report(reply, node, strategies, wanted)
            for client in clients:
                if client in nodes:
                    raise FederationError(f"nodes {nodes[client]} and {node} both host client {client}")
                nodes[client] = node
        if wanted is None or len(nodes) < wanted:
            time.sleep(min(0.05 if waiting else 0.2, poll_interval, max(0.0, deadline - time.monotonic())))
    n = wanted if wanted is not None else max(nodes, default=-1) + 1
    missing = sorted(set(range(n)) - set(nodes))
    if missing or not n:
        dead = "".join(
            f"; unavailable: node {node} ({why})" if k == 0 else f", node {node} ({why})"
            for k, (node, why) in enumerate(sorted(unavailable.items()))
        )
        raise FederationError(
            f"no node hosts client(s) {format_clients(missing) if missing else 'at all'} "
            f"({len(asked | set(unavailable))} node(s) connected within {connect_timeout:g} s"
            f"{dead}); "
            f"the run has clients 0..{n - 1}: start nodes with --node-config 'clients=\"…\"' covering them"
        )
    for k, s in enumerate(strategies):
        if s.node_data:
            _adopt(s, n if s.num_clients is None else s.num_clients, nodes, {node: r[k] for node, r in reports.items()})
        for node, report in reports.items():
            _check_report(s, node, report[k])
        s.asked, s.online = asked | set(unavailable), set(nodes.values())
    return nodes


@dataclass
class _NodeReport:
    """What a node's handshake said about one run: its clients, their sizes and rows' digests, the model's size,
    the fingerprint of its settings and (with its own data) its kind of samples."""

    clients: list[int]
    sizes: list[int]
    rows: list[str]
    dim: int
    digest: str
    sample: str | None


def _handshake_report(
    reply: Message, node: int, strategies: Sequence[FedShuffleStrategy], n: int | None
) -> tuple[tuple[int, ...], list[_NodeReport]]:
    """The clients a node's handshake reply says it hosts, and its report per run (the form checked, not the values).
    A node stating another fedshuffle version than the server's is refused first; one stating none (a version
    before the check), once its reply's form is checked."""
    if reply.has_error():
        raise FederationError(f"node {node} failed the handshake: {reply.error.reason}")
    try:
        info = _content(reply, "node")
        if (version := info.get("fedshuffle-version")) is not None and version != installed_version():
            raise _other_version(node, version)
        clients = info.get("clients")
        if (
            not isinstance(clients, list)
            or not clients
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in clients)
        ):
            raise InvalidReply(f"node.clients: expected a list of client ids, got {clients!r}"[:300])
        parts = checked_int(info, "num-partitions", -(2**63), 2**63 - 1, "node")
        digests = info.get("digests")
        reports = []
        for k, s in enumerate(strategies):
            sizes = info.get(f"sizes.{s.run.index}")
            rows = info.get(f"rows.{s.run.index}")
            sample = info.get(f"sample.{s.run.index}")
            dim = checked_int(info, f"dim.{s.run.index}", -1, 2**63 - 1, "node")
            if (
                not isinstance(digests, list)
                or len(digests) != len(strategies)
                or not all(isinstance(v, list) and len(v) == len(clients) for v in (sizes, rows))
            ):
                raise InvalidReply(
                    f"node: expected 'digests' with one entry per run ({len(strategies)}) and per run 'sizes.<run>' "
                    "and 'rows.<run>' with one entry per client"
                )
            reports.append(
                _NodeReport(clients, sizes, rows, dim, str(digests[k]), sample if isinstance(sample, str) else None)
            )
    except (InvalidReply, AttributeError) as exc:
        raise FederationError(f"node {node} sent a malformed handshake reply: {exc}") from None
    if version is None:
        raise _other_version(node, "unknown (its reply does not say)")
    outside = [c for c in clients if c < 0 or (n is not None and c >= n)]
    if (n is not None and parts not in (-1, n)) or outside:
        raise FederationError(
            f"node {node} hosts clients {format_clients(clients) if all(c >= 0 for c in clients) else clients} "
            f"(num-partitions={parts}); "
            f"the federation has {n} clients (ids 0..{n - 1}, num-partitions={n})"
        )
    return tuple(clients), reports


def _other_version(node: int, version: object) -> FederationError:
    return FederationError(
        f"node {node} runs fedshuffle {version}, the server fedshuffle {installed_version()}: "
        f"every node must run the server's version (pip install fedshuffle=={installed_version()}, or the app's wheel)"
    )


def _adopt(s: FedShuffleStrategy, n: int, nodes: dict[int, int], reports: dict[int, _NodeReport]) -> None:
    """A ``node_data`` run's population from the nodes' reports: every client's size, one kind of samples."""
    sizes = np.zeros(n, dtype=np.int64)
    kinds: dict[str, int] = {}
    for node, report in reports.items():
        if report.sample is None:
            raise FederationError(
                f"node {node} brings no data of its own (no data-path in its node config); with run-config node-data "
                "= true every node must"
            )
        kinds.setdefault(report.sample, node)
        for client, size in zip(report.clients, report.sizes):
            if client < n:
                sizes[client] = size
    if len(kinds) > 1:
        (a, first), (b, second) = list(kinds.items())[:2]
        raise FederationError(
            f"nodes {first} and {second} hold different kinds of samples ({a} and {b}): every node's data must have "
            "one sample shape, classes and dtype"
        )
    empty = np.flatnonzero(sizes < 1)
    if empty.size:
        raise FederationError(
            f"node {nodes.get(int(empty[0]))} reports {int(sizes[empty[0]])} samples for client {int(empty[0])}; "
            "every client needs at least one"
        )
    raw = json.loads(next(iter(kinds)))
    s.adopt_population(sizes, SampleKind(tuple(raw["shape"]), int(raw["classes"]), str(raw["dtype"])))


def _check_report(s: FedShuffleStrategy, node: int, report: _NodeReport) -> None:
    """A node's report on run ``s`` against the server's: fingerprint, model size, each client's size and rows."""
    ours = [(c, size, held) for c, size, held in zip(report.clients, report.sizes, report.rows) if c < s.num_clients]
    if not ours:
        return
    clients = format_clients(report.clients)
    if report.digest != s.run.digest:
        raise FederationError(
            f"node {node} (clients {clients}) would run other settings for {s.run.label or 'the run'!r} (fingerprint "
            f"{report.digest}, "
            f"the server's {s.run.digest}): start every node from the same app and run config"
        )
    if report.dim != s.half.params.numel():
        raise FederationError(
            f"node {node} (clients {clients}) builds a model of {report.dim} parameters, the server's has "
            f"{s.half.params.numel()} "
            "(its data has another sample shape or number of classes: give each client file 'classes')"
        )
    for client, size, held in ours:
        if size != int(s.half.data.sizes[client]):
            raise FederationError(
                f"node {node} holds {size!r} samples for client {client}, the config's client {client} has "
                f"{int(s.half.data.sizes[client])}"
            )
        expected = s.rows_digest(client)
        if expected is not None and held != expected:
            raise FederationError(
                f"node {node} holds other samples for client {client} than the server's data (digest "
                f"{str(held)[:16]!r}, the server's {expected!r})"
            )
        first = s.held.setdefault(client, str(held))
        if first != held:
            raise FederationError(
                f"node {node} holds other samples for client {client} than its node at the start (digest "
                f"{str(held)[:16]!r}, then {first[:16]!r})"
            )
