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

The strategy's other jobs are each their own module: the node protocol (handshake, re-join, node reports:
:mod:`~fedshuffle.integrations.flower.protocol`), reply validation and the rejection policy
(:mod:`~fedshuffle.integrations.flower.replies`), federated evaluation
(:mod:`~fedshuffle.integrations.flower.evaluation`), the server half on the clients' sizes
(:mod:`~fedshuffle.integrations.flower.half`) and the rounds under the loop of ``fedshuffle run``
(:mod:`~fedshuffle.integrations.flower.rounds`).

With ``secure`` (run-config ``secure-aggregation = true``), a method whose server half needs only Σ_S ν_iΔ_i gets that
sum through Flower's SecAgg+ instead of the members' payloads: training replies carry counts only, and the server never
holds a member's update (:mod:`~fedshuffle.integrations.flower.secagg`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# first: a clear message where Flower is not installed
from fedshuffle.integrations.flower.messages import (  # isort: skip
    GRADIENTS,
    TRAIN,
    InvalidReply,
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
from fedshuffle.data import FederatedDataset
from fedshuffle.data.federated import objective_weights
from fedshuffle.experiments.build import build_algorithm_from, build_sampler
from fedshuffle.experiments.runner import DTYPES, build_simulation, check_against_data, check_local_work
from fedshuffle.integrations.flower.common import (
    AppSettings,
    ClientStateLost,
    FederatedRun,
    FederationError,
    Population,
)
from fedshuffle.integrations.flower.evaluation import FEDERATED_SCORES, FederatedEvaluation
from fedshuffle.integrations.flower.half import ServerHalf, keep_members
from fedshuffle.integrations.flower.nodedata import SampleKind, refuse_theory, rows_digest
from fedshuffle.integrations.flower.protocol import NodeProtocol, content, exchange, handshake
from fedshuffle.integrations.flower.replies import Reply, ReplyChecks, UpdateBound, work_bound
from fedshuffle.integrations.flower.robust import RobustAggregation
from fedshuffle.integrations.flower.rounds import results_folder, run_rounds
from fedshuffle.integrations.flower.secagg import (
    SecureRounds,
    SecureAggregation,
    refuse_individual_updates,
    sum_metrics,
)
from fedshuffle.local.plan import CohortPlan
from fedshuffle.methods.base import ClientResult, Method, RoundInfo

__all__ = [
    "FEDERATED_SCORES",
    "ClientStateLost",
    "FedShuffleStrategy",
    "FederationError",
    "ServerHalf",
    "exchange",
    "handshake",
    "keep_members",
    "work_bound",
]


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


#: the run config's defaults (:class:`~fedshuffle.integrations.flower.common.AppSettings`)
DEFAULTS = AppSettings()


class FedShuffleStrategy(NodeProtocol, ReplyChecks, FederatedEvaluation, SecureRounds, Strategy):
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
        round_timeout: float = DEFAULTS.round_timeout,
        connect_timeout: float = DEFAULTS.connect_timeout,
        out: str | Path | None = None,
        resume: bool = DEFAULTS.resume,
        poll_interval: float = 0.5,
        log: Callable[[str], None] | None = None,
        invalid_reply: str = DEFAULTS.invalid_reply,
        node_data: bool = DEFAULTS.node_data,
        secure: SecureAggregation | None = None,
        evaluation: str = DEFAULTS.evaluation,
        bound: UpdateBound | None = None,
        robust: RobustAggregation | None = None,
    ) -> None:
        AppSettings.from_run_config(  # the run config's checks: a ConfigError naming the key
            {
                "round-timeout": round_timeout,
                "connect-timeout": connect_timeout,
                "invalid-reply": invalid_reply,
                "node-data": node_data,
                "evaluation": evaluation,
            }
        )
        self.federated = evaluation == "federated" or node_data  # who scores the model: the nodes, or the server
        self.both = evaluation == "both"  # the server scores it, and the nodes' federated scores are recorded beside
        self.run, self.node_data, self.secure, self.robust = run, node_data, secure, robust
        self.half: ServerHalf | None = None
        self.data, self.evaluator, self.step_sizes = None, None, {}
        method = self._build_method() if node_data else self._build_half()
        label = run.label or run.spec.method.name
        if secure is not None:  # refused before any message
            refuse_individual_updates(method, label)
        if bound is not None:
            bound.check(secure is not None)
        if robust is not None:
            robust.check(method, label, secure is not None)
        self._grid: Grid | None = None
        self.round_timeout, self.connect_timeout, self.poll_interval = round_timeout, connect_timeout, poll_interval
        self.resume = resume
        self.folder = results_folder(run, out, resume) if out else None
        self._start_protocol()
        self._start_checks(invalid_reply, bound)
        self._open: _OpenRound | None = None
        self._log = log or (lambda text: None)

    def _build_method(self) -> Method:
        """A run whose data only the nodes hold: its method's settings checked (the server half comes with the
        handshake, :meth:`adopt_population`)."""
        refuse_theory(self.run.spec, "the server builds no data (run-config node-data = true)")
        self.num_clients = self.run.spec.data.model_dump().get("clients")
        return build_algorithm_from(self.run.spec).method

    def _build_half(self) -> Method:
        """The server half on the run's data, as ``fedshuffle run`` builds it, and the central evaluation."""
        sim, self.step_sizes = build_simulation(self.run.spec, self.run.seed)
        population = Population(sim.data.sizes, sim.data.weights)
        self.half = ServerHalf(
            sim.problem, population, sim.algorithm, sim.sampler, seed=self.run.seed, dtype=sim.dtype, device=sim.device
        )
        self.data, self.num_clients = sim.data, sim.data.num_clients
        self.evaluator = metrics.ModelScores(sim.problem, sim.data)
        return self.half.method

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
        decoded = self._decoded(server_round, state, replies)
        keep = np.array([int(i) in decoded for i in rnd.cohort], dtype=bool)
        unanswered = sorted({int(i) for i in rnd.cohort[~keep]} - set(self._rejected_now))
        result, secured = None, sum_metrics(None) if self.secure is not None else {}
        if self.secure is not None and keep.any():
            keep, result, secured = self._secure_result(server_round, state, keep, decoded)
        dropped = state.dropped + sorted({int(i) for i in rnd.cohort[~keep]})
        rnd = keep_members(rnd, keep)
        if self.secure is None and len(rnd.cohort):
            result = self._members_result(rnd, decoded)
        seconds = time.monotonic() - state.started  # the members worked in parallel: each for at most the round's time
        record = self.half.close_round(
            rnd, state.points, state.broadcast, result, compute_seconds=len(rnd.cohort) * seconds, dropped=len(dropped)
        )
        reported = {
            "members": len(rnd.cohort),
            "dropped": len(dropped),
            "rejected": len(self._rejected_now),
            **({"clipped": sum(decoded[int(i)].clipped for i in np.unique(rnd.cohort))} if self.bound else {}),
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

    def _decoded(self, server_round: int, state: _OpenRound, replies: Iterable[Message]) -> dict[int, Reply]:
        """The round's valid replies by client (an invalid one goes through the rejection policy)."""
        decoded, plans = {}, CohortPlan.of(state.rnd.plans)
        for client, reply in self._answers(state.messages, state.clients, replies).items():
            try:
                own = plans.take(np.flatnonzero(plans.clients == client))
                decoded[client] = self._read_train_reply(reply, client, own, state.rnd.index)
            except InvalidReply as exc:
                self._reject(server_round, client, exc)
        return decoded

    def _members_result(self, rnd: RoundInfo, decoded: dict[int, Reply]) -> ClientResult:
        """The members' payload in cohort order; with a robust aggregation, d from a robust estimate of their Δ_i
        (:mod:`~fedshuffle.integrations.flower.robust`), which the method's aggregation takes as the sum."""
        result = self._result(rnd, decoded)
        if self.robust is not None:
            deltas = result.payload["delta"]
            omega = torch.as_tensor(self.half.method.aggregation_weights(rnd), dtype=deltas.dtype, device=deltas.device)
            result.payload = {"delta_sum": self.robust.aggregate(deltas, omega)}
        return result

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No evaluation through Flower's evaluate round: the model is scored by :meth:`evaluate`, centrally or
        federatedly."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

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
        result = run_rounds(self, grid, train_config or ConfigRecord(), evaluate_fn or self.evaluate, num_rounds)
        self._log(f"{self.run.label or self.run.spec.method.name!r} (seed {self.run.seed}): {result.status}")
        return result.result

    def rows_digest(self, client: int) -> str | None:
        """:func:`~.nodedata.rows_digest` of ``client``'s rows in the server's data (None for data generated on
        demand: not checked)."""
        if not isinstance(self.data, FederatedDataset):
            return None
        return rows_digest(self.data, client)

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
                    content(reply, "gradients"),
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

    def _ttl(self) -> float:
        """Messages outlive their round by a minute, then expire (a node that comes back does not run stale rounds)."""
        return self.round_timeout + 60.0

    def _model_of(self, arrays: ArrayRecord) -> torch.Tensor:
        return record_tensors(arrays, self.half.dtype, self.half.device)["model"]
