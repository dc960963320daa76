"""Reply validation and the rejection policy of the Flower server: no reply is trusted.

Each training reply must hold exactly the method's declared payload (``Method.payload_fields``), one row per member,
in the run's dtype and the model's size, finite, with the counts the server sent (client, round, members) and a
plausible work count (:func:`work_bound`); nothing is cast. A reply that is not is *invalid*: with
``invalid_reply="drop"`` (the default) its member is dropped from the round as unfinished work, with the reason logged
and counted (``rejected``); with ``"stop"`` the run stops with :class:`FederationError` naming the client and the entry.

A finite reply may still move the model by any amount (a node sending Δ_i ≈ 1e308 passes the checks above): with
run-config ``update-bound = c`` > 0, each member's Δ_i must satisfy ‖Δ_i‖ ≤ c·max(‖x‖, floor) (:class:`UpdateBound`);
one beyond it is rejected as invalid or, with ``update-bound-action = "clip"``, scaled to the bound and counted
(``clipped``).
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

from fedshuffle.core.errors import ConfigError
from fedshuffle.integrations.flower.common import AppSettings, ClientStateLost, FederationError
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
    clipped: int = 0  # rows of ``delta`` scaled to the update bound


@dataclass(frozen=True)
class UpdateBound:
    """‖Δ_i‖ ≤ c·max(‖x‖, floor) for each member's model update Δ_i (payload ``delta``; SCAFFOLD's ``control_delta``,
    a gradient, is not bounded), x the model the round started from.

    A bound relative to the model holds whatever its scale; the floor keeps a model at or near 0 (a zero-initialised
    linear model) from refusing every update: 1 by default, the scale SecAgg+'s resolution check takes for a model
    at 0, so that with c = 1 the first steps may move such a model by up to 1 in norm. ``action`` ``"reject"``: a
    reply beyond the bound is invalid (dropped, or the run stopped, by run-config ``invalid-reply``); ``"clip"``:
    Δ_i ← Δ_i·bound/‖Δ_i‖, counted in the round's ``clipped``.
    """

    factor: float
    floor: float = 1.0
    action: str = "reject"

    @classmethod
    def from_settings(cls, settings: AppSettings) -> UpdateBound | None:
        """Run-config ``update-bound`` (c; 0: none), ``update-bound-floor`` and ``update-bound-action``."""
        if settings.update_bound == 0:
            return None
        return cls(settings.update_bound, settings.update_bound_floor, settings.update_bound_action)

    def check(self, secure: bool) -> None:
        """Refuse, in one line, a bound with secure aggregation (the server never sees a member's Δ_i)."""
        if secure:
            raise ConfigError(
                "run-config.update-bound",
                "needs each member's Δ_i, and with secure-aggregation = true the server sees only their sum (bound a "
                "node's input with secagg-clipping-range): set update-bound = 0 or secure-aggregation = false",
            )

    def apply(self, deltas: torch.Tensor, model: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The rows ``deltas`` (members, d) within the bound, and how many were clipped; :class:`InvalidReply` naming
        the norm and the bound for a row beyond it under ``"reject"``. Norms are taken as s·‖Δ/s‖ with s = max|Δ|,
        so a finite row of entries near 1e308 has its finite norm."""
        size = _norms(model[None])[0].item()
        limit = self.factor * max(size, self.floor)
        norms = _norms(deltas)
        over = norms > limit
        if not bool(over.any()):
            return deltas, 0
        if self.action == "reject":
            row = int(over.nonzero()[0, 0])
            raise InvalidReply(
                f"payload.delta: ‖Δ‖ = {norms[row].item():.4g} (row {row}) beyond the update bound "
                f"c·max(‖x‖, floor) = {self.factor:g}·max({size:.4g}, {self.floor:g}) = "
                f"{limit:.4g} (run-config update-bound)"
            )
        scale = torch.where(over, limit / norms, torch.ones_like(norms))
        return deltas * scale[:, None], int(over.sum())


def _norms(rows: torch.Tensor) -> torch.Tensor:
    """The Euclidean norm of each row, without overflow for finite entries: s·‖row/s‖ with s = max|row| (0 for 0)."""
    largest = rows.abs().amax(dim=1)
    safe = torch.where(largest > 0, largest, torch.ones_like(largest))
    return largest * (rows / safe[:, None]).norm(dim=1)


class ReplyChecks:
    """The strategy's reply checks and rejection policy: ``invalid_reply`` (``"drop"`` or ``"stop"``), the update
    ``bound`` (or None), the count of members dropped for an invalid reply (``rejected``; ``_rejected_now`` in the
    open round), against the strategy's server half (``half``), ``nodes`` and ``secure``."""

    invalid_reply: str
    bound: UpdateBound | None
    rejected: int
    _rejected_now: list[int]
    _log: Callable[[str], None]

    def _start_checks(self, invalid_reply: str, bound: UpdateBound | None) -> None:
        """No reply rejected yet."""
        self.invalid_reply, self.bound = invalid_reply, bound
        self.rejected = 0  # members dropped from a round for an invalid reply
        self._rejected_now = []  # … in the open round

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
        payload = {name: value.to(self.half.device) for name, value in payload.items()}
        clipped = 0
        if self.bound is not None and "delta" in payload:
            payload["delta"], clipped = self.bound.apply(payload["delta"], self.half.params)
        if clipped:
            self._log(f"client {client}: {clipped} update(s) clipped to the update bound (run-config update-bound)")
        return Reply(payload, work, extras, members, clipped)

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
