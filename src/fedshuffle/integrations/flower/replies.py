"""Reply validation and the rejection policy of the Flower server: no reply is trusted.

Each training reply must hold exactly the method's declared payload (``Method.payload_fields``), one row per member,
in the run's dtype and the model's size, finite, with the counts the server sent (client, round, members) and a
plausible work count (:func:`work_bound`); nothing is cast. A reply that is not is *invalid*: with
``invalid_reply="drop"`` (the default) its member is dropped from the round as unfinished work, with the reason logged
and counted (``rejected``); with ``"stop"`` the run stops with :class:`FederationError` naming the client and the entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# first: a clear message where Flower is not installed
from fedshuffle.integrations.flower.messages import (  # isort: skip
    STATE_LOST,
    UNANSWERED,
    InvalidReply,
    checked_float,
    checked_int,
    checked_tensors,
)
from flwr.app import ConfigRecord, Message

from fedshuffle.integrations.flower.common import ClientStateLost, FederationError
from fedshuffle.integrations.flower.protocol import content
from fedshuffle.local.plan import ClientPlan
from fedshuffle.methods.base import ClientResult, Method, RoundInfo, sample_gradients


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


@dataclass
class Reply:
    """A member's checked reply: its payload rows ``(members, d)``, the work it reports, its diagnostics."""

    payload: dict[str, torch.Tensor]
    sample_gradients: int
    extras: dict[str, float]
    members: int


class ReplyChecks:
    """The strategy's reply checks and rejection policy: ``invalid_reply`` (``"drop"`` or ``"stop"``), the count of
    members dropped for an invalid reply (``rejected``; ``_rejected_now`` in the open round), against the strategy's
    server half (``half``), ``nodes`` and ``secure``."""

    invalid_reply: str
    rejected: int
    _rejected_now: list[int]
    _log: Callable[[str], None]

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

    def _read_train_reply(self, reply: Message, client: int, plans: Sequence[ClientPlan], round_index: int) -> Reply:
        """A member's reply checked against what the server sent it (see the module docstring);
        :class:`InvalidReply` if it is not."""
        self._check_sender(reply, client)
        info = content(reply, "result")
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
            content(reply, "payload"), fields, (members, self.half.params.numel()), self.half.dtype, "payload"
        )
        return Reply({name: value.to(self.half.device) for name, value in payload.items()}, work, extras, members)

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

    def _result(self, rnd: RoundInfo, decoded: dict[int, Reply]) -> ClientResult:
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
