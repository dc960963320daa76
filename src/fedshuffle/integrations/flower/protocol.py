"""The node protocol of a fedshuffle federation: which node hosts which client, checked before any training message.

The handshake (:func:`handshake`, once per app) asks every node that connects for the clients it hosts and, per run,
their sizes, rows' digests, the model's size and the fingerprint of the settings it would run; a node that re-joins
(:meth:`NodeProtocol.rejoin`, at the start of a round) is asked the same and takes its clients over when its report
passes the same checks. :func:`exchange` pushes messages and pulls their replies within a timeout.

Nodes may leave and come back. The run starts once every client is hosted (the handshake waits up to the connect
timeout); afterwards the cohort is still drawn from all clients by the seeded sampler, and a member whose node is
offline is sent nothing and dropped as unfinished work. A restarted SuperNode comes back with a new node id: at the
start of each round the server asks node ids it has not seen for their clients, and a node whose report passes the
handshake's checks (fingerprint, model size, each client's size and rows' digest equal to what the client's first node
reported) serves its clients from then on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

# first: a clear message where Flower is not installed
from fedshuffle.integrations.flower.messages import HANDSHAKE, UNANSWERED, InvalidReply, checked_int  # isort: skip
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedshuffle.integrations.flower.bundle import installed_version
from fedshuffle.integrations.flower.common import FederationError, format_clients
from fedshuffle.integrations.flower.nodedata import SampleKind

if TYPE_CHECKING:
    from fedshuffle.integrations.flower.strategy import FedShuffleStrategy


def content(reply: Message, key: str) -> object:
    """``reply.content[key]``, or :class:`InvalidReply` naming what is missing."""
    try:
        return reply.content[key]
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidReply(f"no {key!r} in the reply ({type(exc).__name__})") from None


class NodeProtocol:
    """The strategy's side of the node protocol: ``nodes`` (client → node id), ``asked`` (node ids asked for their
    clients), ``online`` (node ids the SuperLink listed last), ``held`` (client → its rows' digest as its first node
    reported it) and the handshakes awaited (``_joining``), on the strategy's ``connect_timeout`` and
    ``poll_interval``."""

    nodes: dict[int, int]
    asked: set[int]
    online: set[int]
    held: dict[int, str]
    _joining: dict[str, int]
    connect_timeout: float
    poll_interval: float

    def _start_protocol(self) -> None:
        """No node known yet."""
        self.nodes = {}
        self.asked, self.online = set(), set()
        self.held = {}
        self._joining = {}  # handshake message id → node id, for nodes that joined and have not answered

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
    state = _Handshake(grid, strategies, max(counts) if None not in counts else None, connect_timeout)
    deadline = time.monotonic() + connect_timeout
    while not state.complete() and time.monotonic() < deadline:
        state.ask_new()
        state.read_replies()
        if not state.complete():
            time.sleep(min(0.05 if state.waiting else 0.2, poll_interval, max(0.0, deadline - time.monotonic())))
    n = state.hosted()
    for k, s in enumerate(strategies):
        if s.node_data:
            _adopt(s, n if s.num_clients is None else s.num_clients, state.nodes, state.reports_of(k))
        for node, report in state.reports_of(k).items():
            _check_report(s, node, report)
        s.asked, s.online = state.asked | set(state.unavailable), set(state.nodes.values())
    return state.nodes


@dataclass
class _Handshake:
    """The handshake under way: ``nodes`` (client → node), each node's ``reports`` (one per run), the node ids
    ``asked``, the messages ``waiting`` for a reply (message id → node) and the nodes listed but ``unavailable``."""

    grid: Grid
    strategies: Sequence[FedShuffleStrategy]
    wanted: int | None  # the number of clients of the largest run (None: those the nodes host)
    timeout: float
    nodes: dict[int, int] = field(default_factory=dict)
    reports: dict[int, list[_NodeReport]] = field(default_factory=dict)
    asked: set[int] = field(default_factory=set)
    waiting: dict[str, int] = field(default_factory=dict)
    unavailable: dict[int, str] = field(default_factory=dict)

    def complete(self) -> bool:
        return self.wanted is not None and len(self.nodes) >= self.wanted

    def ask_new(self) -> None:
        """Ask every node the SuperLink lists and that was not asked yet for its clients and reports."""
        new = [node for node in sorted(self.grid.get_node_ids()) if node not in self.asked]
        self.asked.update(new)
        ask = ConfigRecord({"runs": [s.run.index for s in self.strategies]})
        messages = [Message(RecordDict({"fedshuffle": ask}), node, HANDSHAKE, ttl=self.timeout + 60.0) for node in new]
        if messages:
            self.waiting.update({i: node for i, node in zip(self.grid.push_messages(messages), new) if i})

    def read_replies(self) -> None:
        """The replies that came: a dead node's is noted (asked again while the handshake waits), any other read."""
        for reply in self.grid.pull_messages(list(self.waiting)) if self.waiting else []:
            node = self.waiting.pop(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            if reply.has_error() and int(reply.error.code) in UNANSWERED:
                why = UNANSWERED[int(reply.error.code)]
                if node not in self.unavailable:
                    self.strategies[0]._log(
                        f"node {node} is listed but did not answer the handshake ({why}): left out unless it answers "
                        "later"
                    )
                self.unavailable[node] = why
                self.asked.discard(node)
                continue
            self.unavailable.pop(node, None)
            clients, self.reports[node] = _handshake_report(reply, node, self.strategies, self.wanted)
            for client in clients:
                if client in self.nodes:
                    raise FederationError(f"nodes {self.nodes[client]} and {node} both host client {client}")
                self.nodes[client] = node

    def hosted(self) -> int:
        """The number of clients n, once every client 0..n−1 is hosted; else :class:`FederationError` naming those
        no node hosts and the unavailable nodes."""
        n = self.wanted if self.wanted is not None else max(self.nodes, default=-1) + 1
        missing = sorted(set(range(n)) - set(self.nodes))
        if missing or not n:
            dead = "".join(
                f"; unavailable: node {node} ({why})" if k == 0 else f", node {node} ({why})"
                for k, (node, why) in enumerate(sorted(self.unavailable.items()))
            )
            raise FederationError(
                f"no node hosts client(s) {format_clients(missing) if missing else 'at all'} "
                f"({len(self.asked | set(self.unavailable))} node(s) connected within {self.timeout:g} s{dead}); "
                f"the run has clients 0..{n - 1}: start nodes with --node-config 'clients=\"…\"' covering them"
            )
        return n

    def reports_of(self, k: int) -> dict[int, _NodeReport]:
        """Each node's report on run ``k``."""
        return {node: reports[k] for node, reports in self.reports.items()}


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
        info = content(reply, "node")
        if (version := info.get("fedshuffle-version")) is not None and version != installed_version():
            raise _other_version(node, version)
        clients = info.get("clients")
        if not isinstance(clients, list) or not clients or not all(type(c) is int for c in clients):
            raise InvalidReply(f"node.clients: expected a list of client ids, got {clients!r}"[:300])
        parts = checked_int(info, "num-partitions", -(2**63), 2**63 - 1, "node")
        reports = [_run_report(info, s.run.index, k, len(strategies), clients) for k, s in enumerate(strategies)]
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


def _run_report(info: ConfigRecord, run: int, k: int, runs: int, clients: list[int]) -> _NodeReport:
    """A node's report on run ``run`` (the ``k``-th of ``runs`` asked for), its form checked."""
    sizes, rows, sample = info.get(f"sizes.{run}"), info.get(f"rows.{run}"), info.get(f"sample.{run}")
    dim = checked_int(info, f"dim.{run}", -1, 2**63 - 1, "node")
    digests = info.get("digests")
    if (
        not isinstance(digests, list)
        or len(digests) != runs
        or not all(isinstance(v, list) and len(v) == len(clients) for v in (sizes, rows))
    ):
        raise InvalidReply(
            f"node: expected 'digests' with one entry per run ({runs}) and per run 'sizes.<run>' "
            "and 'rows.<run>' with one entry per client"
        )
    return _NodeReport(clients, sizes, rows, dim, str(digests[k]), sample if isinstance(sample, str) else None)


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
