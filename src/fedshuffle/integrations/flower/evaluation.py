"""Federated evaluation: each node scores its own clients and the server adds their shares.

f(x) = Σ_i w_i f_i(x), ‖∇f(x)‖² and the training accuracy from one ``query.evaluate`` message per node: equal to the
central scores on the pooled data to rounding; the server scores the model itself where it holds the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# first: a clear message where Flower is not installed
from fedshuffle.integrations.flower.messages import (  # isort: skip
    EVALUATE,
    UNANSWERED,
    InvalidReply,
    checked_float,
    checked_tensors,
    tensors_record,
)
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedshuffle.integrations.flower.common import FederationError, format_clients
from fedshuffle.integrations.flower.protocol import content

#: the scores a federated evaluation gives (the others need the data at the server)
FEDERATED_SCORES = ("loss", "grad_norm_sq", "train_accuracy")


@dataclass
class _Scores:
    """The nodes' shares added so far: Σ w_i f_i(x), Σ w_i ∇f_i(x) and the correct predictions (−1: no accuracy)."""

    loss: float
    gradient: torch.Tensor
    correct: float

    def add(self, part: tuple[float, torch.Tensor], correct: float) -> None:
        self.loss += part[0]
        self.gradient = self.gradient + part[1]
        self.correct = -1.0 if correct < 0 or self.correct < 0 else self.correct + correct


class FederatedEvaluation:
    """The strategy's evaluation: central (``evaluator``, the server's data) or federated (the nodes'), per
    ``federated`` and ``both``."""

    federated: bool
    both: bool
    evaluator: Callable[[torch.Tensor], dict[str, float | None]] | None

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
        total = _Scores(0.0, torch.zeros_like(params), 0.0)
        waiting, why = sorted(self.nodes), {}
        for attempt in range(2):
            if attempt:
                self._await_hosts(waiting, set(why))
            else:
                self.rejoin(self._grid, 0.0)
            waiting = self._score_once(waiting, why, params, total)
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
        accuracy = total.correct / self.half.data.num_samples if total.correct >= 0 else None
        return {
            "loss": total.loss,
            "grad_norm_sq": float(total.gradient.pow(2).sum()),
            "train_accuracy": accuracy,
            "f_gap": None,
            "dist_sq": None,
        }

    def _score_once(self, waiting: list[int], why: dict[int, str], params: torch.Tensor, total: _Scores) -> list[int]:
        """One ``query.evaluate`` message to each online node hosting clients of ``waiting``, the shares that come
        added to ``total``: the clients still unscored (``why``: the reason per node that failed them)."""
        by_node: dict[int, list[int]] = {}
        for client in waiting:
            if self.nodes[client] in self.online:
                by_node.setdefault(self.nodes[client], []).append(client)
            else:
                why[self.nodes[client]] = "offline"
        model = tensors_record({"model": params})
        messages = [self._evaluation_message(node, clients, model) for node, clients in by_node.items()]
        replies = {m.metadata.reply_to_message_id: m for m in self.exchange(self._grid, messages, self.round_timeout)}
        for message in messages:
            node = message.metadata.dst_node_id
            reply = replies.get(message.metadata.message_id)
            if reply is not None and reply.has_error() and int(reply.error.code) not in UNANSWERED:
                raise FederationError(
                    f"node {node} did not score its clients in the federated evaluation: {reply.error.reason}"
                )
            if reply is None or reply.has_error():
                why[node] = reply.error.reason if reply is not None else f"no answer within {self.round_timeout:g} s"
                continue
            total.add(*self._scores_part(node, reply, params))
            waiting = [c for c in waiting if c not in by_node[node]]
        return waiting

    def _evaluation_message(self, node: int, clients: list[int], model: ArrayRecord) -> Message:
        """The model, with the clients ``node`` scores and their objective weights w_i."""
        weights = [float(self.half.data.weights[c]) for c in clients]
        instructions = ConfigRecord({"run": self.run.index, "clients": clients, "weights": weights})
        return Message(RecordDict({"model": model, "instructions": instructions}), node, EVALUATE, ttl=self._ttl())

    def _scores_part(self, node: int, reply: Message, params: torch.Tensor) -> tuple[tuple[float, torch.Tensor], float]:
        """A node's share of f(x) and ∇f(x), and its correct predictions (−1: the problem has no accuracy), checked."""
        try:
            info = content(reply, "scores")
            part = checked_tensors(
                content(reply, "gradient"), ["gradient"], (params.numel(),), self.half.dtype, "gradient"
            )["gradient"]
            loss, correct = checked_float(info, "loss", "scores"), checked_float(info, "correct", "scores")
        except (InvalidReply, AttributeError) as exc:
            raise FederationError(f"node {node} sent an invalid federated evaluation: {exc}") from None
        return (loss, part.to(params.device)), correct
