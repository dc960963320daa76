"""The client half of any fedshuffle method as a Flower ClientApp, on the node's own partition.

A node hosts one or many clients (``node-config``: ``clients="0-4"`` or ``clients="0,3,7"``, TOML strings;
``partition-id=K`` is one client). It builds the run's problem and data as ``fedshuffle run`` would and keeps only its
clients' partitions (:class:`NodeData`), then answers three message types (:mod:`.messages`): the
handshake, FedShuffleMVR's gradient exchange, and the rounds: one message per sampled client, for
which it runs the method's ``client_update`` on the plans the server sent.

Client state (SCAFFOLD's c_i, FedCDR's y_i, x_i, x̂_i, FedDyn's ∇L_i) is kept in two slots: the rows
the server has accepted (``committed``) and the rows of the node's last update (``pending``), each
with its round. Every round message says the last round whose update the server accepted from this
client (L); the node then

* L = −1: starts from fresh rows (the server has never accepted an update from it);
* pending round = L: commits the pending rows (its last reply was aggregated);
* committed round = L: discards the pending rows (its last reply came too late and was dropped);
* otherwise: answers with a ``STATE_LOST`` error; the server stops the run (state is never reset silently).

The slots live in ``context.state`` (the SuperNode keeps it for the run), or in files under the
node-config directory ``state-dir`` (they outlive the SuperNode process).

With ``data-path=FOLDER`` in its node config, a node reads its clients from its own files
(:mod:`.nodedata`, or partitions written by ``flwr-datasets``: :mod:`.partitions`, by its ``label-column`` and
``feature-columns``) instead of building the federation's data.
"""

from __future__ import annotations

import io
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

# first: a clear message where Flower is not installed
# isort: skip
from fedshuffle.integrations.flower.messages import STATE_LOST, WRONG_RUN, record_tensors, records_plans, tensors_record
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import write_atomic
from fedshuffle.executors import SequentialExecutor
from fedshuffle.experiments.build import build_algorithm_from
from fedshuffle.experiments.runner import DTYPES, build_simulation
from fedshuffle.integrations.flower.bundle import installed_version
from fedshuffle.integrations.flower.common import FederatedRun, NodeData, format_clients, parse_clients
from fedshuffle.integrations.flower.partitions import Columns
from fedshuffle.integrations.flower.nodedata import OwnClients, SampleKind, folder_clients, refuse_theory, rows_digest
from fedshuffle.integrations.flower.secagg import keep_weighted_update, node_mod
from fedshuffle.local.plan import ClientPlan
from fedshuffle.methods.algorithm import Algorithm
from fedshuffle.methods.base import Trainer
from fedshuffle.problems import Problem

SLOTS = ("committed", "pending")


class StateLost(RuntimeError):
    """The node does not hold the state the server accepted."""


@dataclass
class NodeRuntime:
    """What a node needs for one run: the problem, its clients' partitions, the algorithm's client half."""

    run: FederatedRun
    problem: Problem
    data: NodeData
    algorithm: Algorithm
    dtype: torch.dtype
    device: str
    dim: int
    sample: SampleKind | None = (
        None  # of a node's own data (data-path): what a server without the data builds the problem from
    )

    @classmethod
    def build(cls, run: FederatedRun, clients: Sequence[int]) -> NodeRuntime:
        """The run's parts as ``fedshuffle run`` builds them, then the samples of those of ``clients`` the run has only
        (a node may host more clients than a smaller run of the same app has)."""
        sim, _ = build_simulation(run.spec, run.seed)
        ours = [c for c in clients if c < sim.data.num_clients]
        if not ours:
            raise ConfigError(
                "node-config.clients",
                f"none of this node's clients ({format_clients(clients)}) is in the run: it has clients "
                f"0..{sim.data.num_clients - 1}",
            )
        return cls(
            run, sim.problem, NodeData.of(sim.data, ours), sim.algorithm, sim.dtype, sim.device, sim.params.numel()
        )

    @classmethod
    def from_folder(
        cls, run: FederatedRun, clients: Sequence[int], folder: str | Path, columns: Columns = Columns()
    ) -> NodeRuntime:
        """The run's problem and client half, and ``clients``' rows from the node's own ``folder``
        (:mod:`.nodedata`; partitions written by ``flwr-datasets`` read by ``columns``), without building the
        federation's data."""
        spec = run.spec
        refuse_theory(spec, "this node brings only its own (data-path)")
        own = OwnClients.read(folder, clients, spec, columns)
        sizes = np.zeros(max(own.clients) + 1, dtype=np.int64)
        sizes[list(own.clients)] = [own.sizes[c] for c in own.clients]
        dtype, device = DTYPES[spec.run.dtype], spec.run.device
        data = NodeData(own.features.to(device), own.labels.to(device), own.clients, sizes, np.zeros(len(sizes)))
        return cls(run, own.problem, data, build_algorithm_from(spec), dtype, device, own.problem.dim, own.sample)

    @property
    def clients(self) -> tuple[int, ...]:
        return self.data.clients

    def trainer(self, round_index: int, lr_scale: float) -> Trainer:
        """The client half's compute on this node's clients (one client at a time: the sequential reference)."""
        return Trainer(
            self.problem, self.data, SequentialExecutor(), self.algorithm.local, self.run.seed, round_index, lr_scale
        )

    def own_plans(self, plans: Sequence[ClientPlan]) -> list[ClientPlan]:
        """Plans whose rows (the client's own numbering 0..|D_i|−1, −1 for padding) index the node's tensors."""
        out = []
        for plan in plans:
            offset = self.data.offset(plan.client)
            out.append(replace(plan, batches=np.where(plan.batches >= 0, plan.batches + offset, plan.batches)))
        return out

    def missing(self, client: int) -> str | None:
        """Why ``client``'s work cannot be done here (None: it is one of this node's clients)."""
        return (
            None
            if client in self.clients
            else f"asked for client {client}, this node hosts clients {format_clients(self.clients)}"
        )


class RuntimeCache:
    """The node runtimes a process has built, kept across messages: keyed by Flower run id, run fingerprint, hosted
    clients and data folder (a new Flower run, other settings, other clients or another folder build afresh), the
    ``capacity`` most recently used kept (a long-lived process serving run after run does not grow without bound)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.runtimes: OrderedDict[tuple, NodeRuntime] = OrderedDict()
        self.builds = 0  # how many runtimes were built (a message that finds its runtime builds none)

    def get(self, key: tuple, build: Callable[[], NodeRuntime]) -> NodeRuntime:
        if key in self.runtimes:
            self.runtimes.move_to_end(key)
        else:
            self.runtimes[key] = build()
            self.builds += 1
            while len(self.runtimes) > self.capacity:
                self.runtimes.popitem(last=False)
        return self.runtimes[key]


class ContextStore:
    """The two state slots in ``context.state`` under ``fedshuffle.<fingerprint>.<slot>``."""

    def __init__(self, state: RecordDict, key: str) -> None:
        self.state, self.key = state, key

    def load(self, slot: str) -> tuple[int, dict[str, np.ndarray]] | None:
        record = self.state.get(f"fedshuffle.{self.key}.{slot}")
        if record is None:
            return None
        arrays = {name: np.array(a.numpy()) for name, a in record.items()}
        return int(arrays.pop("__round__")), arrays

    def save(self, slot: str, round_index: int, rows: dict[str, np.ndarray]) -> None:
        arrays = {name: Array(np.ascontiguousarray(v)) for name, v in rows.items()}
        arrays["__round__"] = Array(np.array(round_index, dtype=np.int64))
        self.state[f"fedshuffle.{self.key}.{slot}"] = ArrayRecord(arrays)

    def drop(self, slot: str) -> None:
        self.state.pop(f"fedshuffle.{self.key}.{slot}", None)


class FileStore:
    """The two state slots as ``<state-dir>/<fingerprint>-<client>/<slot>.npz``, written atomically."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = Path(directory) / key

    def load(self, slot: str) -> tuple[int, dict[str, np.ndarray]] | None:
        path = self.directory / f"{slot}.npz"
        if not path.exists():
            return None
        with np.load(path) as saved:
            arrays = {name: saved[name] for name in saved.files}
        return int(arrays.pop("__round__")), arrays

    def save(self, slot: str, round_index: int, rows: dict[str, np.ndarray]) -> None:
        buf = io.BytesIO()
        np.savez(buf, __round__=np.array(round_index, dtype=np.int64), **rows)
        write_atomic(self.directory / f"{slot}.npz", buf.getvalue())

    def drop(self, slot: str) -> None:
        (self.directory / f"{slot}.npz").unlink(missing_ok=True)


Store = ContextStore | FileStore


def accepted_rows(store: Store, last_round: int) -> dict[str, np.ndarray] | None:
    """The rows the server accepted at ``last_round`` (None: fresh rows), settling the slots (see the module
    docstring)."""
    if last_round < 0:
        for slot in SLOTS:
            store.drop(slot)
        return None
    pending = store.load("pending")
    if pending is not None and pending[0] == last_round:
        store.save("committed", *pending)
        store.drop("pending")
        return pending[1]
    committed = store.load("committed")
    if committed is not None and committed[0] == last_round:
        store.drop("pending")
        return committed[1]
    held = (
        ", ".join(
            f"{slot} rows of round {saved[0]}"
            for slot, saved in (("committed", committed), ("pending", pending))
            if saved is not None
        )
        or "no rows"
    )
    raise StateLost(
        f"the server accepted this client's state of round {last_round}, the node holds {held} (node restarted "
        "without its state-dir?)"
    )


def node_store(context: Context, runtime: NodeRuntime, client: int) -> Store:
    key = f"{runtime.run.digest}-{client}"
    directory = context.node_config.get("state-dir")
    return FileStore(Path(str(directory)), key) if directory else ContextStore(context.state, key)


def handshake_reply(message: Message, context: Context, runtime: Callable[[Context, int], NodeRuntime]) -> Message:
    """The clients this node hosts, and per run asked for: each hosted client's dataset size (−1 for a client the
    run does not have) and rows' digest (:func:`~.nodedata.rows_digest`), the model's size, and the run's
    fingerprint as this node would run it ("" for a run with none of its clients); and the fedshuffle version it
    runs."""
    clients = hosted_clients(context)
    info: dict[str, object] = {
        "clients": list(clients),
        "num-partitions": node_integer(context, "num-partitions", -1),
        "fedshuffle-version": installed_version(),
    }
    digests = []
    for index in message.content["fedshuffle"]["runs"]:
        index = int(index)
        try:
            node = runtime(context, index)
        except ConfigError as exc:
            if exc.field != "node-config.clients":
                raise
            info[f"sizes.{index}"] = [-1] * len(clients)
            info[f"rows.{index}"] = [""] * len(clients)
            info[f"dim.{index}"] = -1
            digests.append("")
            continue
        info[f"sizes.{index}"] = [int(node.data.sizes[c]) if c in node.clients else -1 for c in clients]
        info[f"rows.{index}"] = [rows_digest(node.data, c) if c in node.clients else "" for c in clients]
        info[f"dim.{index}"] = node.dim
        if node.sample is not None:
            info[f"sample.{index}"] = json.dumps(
                {"shape": list(node.sample.shape), "classes": node.sample.classes, "dtype": node.sample.dtype}
            )
        digests.append(node.run.digest)
    info["digests"] = digests
    return Message(RecordDict({"node": ConfigRecord(info)}), reply_to=message)


def gradients_reply(message: Message, context: Context, runtime: Callable[[Context, int], NodeRuntime]) -> Message:
    """∇f_i at each point of FedShuffleMVR's exchange."""
    ins = message.content["instructions"]
    node, client = runtime(context, int(ins["run"])), int(ins["client"])
    if (why := node.missing(client)) is not None:
        return Message(Error(WRONG_RUN, why), reply_to=message)
    points = record_tensors(message.content["points"], node.dtype, node.device)
    trainer = node.trainer(int(ins["round"]), 1.0)
    clients = np.array([client], dtype=np.int64)
    return Message(
        RecordDict({"gradients": tensors_record({k: trainer.gradients(p, clients)[0] for k, p in points.items()})}),
        reply_to=message,
    )


def train_reply(message: Message, context: Context, runtime: Callable[[Context, int], NodeRuntime]) -> Message:
    """One round of the method's client half for one of this node's clients, on its plans and state."""
    ins = message.content["instructions"]
    node = runtime(context, int(ins["run"]))
    client, round_index = int(ins["client"]), int(ins["round"])
    if (why := node.missing(client)) is not None:
        return Message(Error(WRONG_RUN, why), reply_to=message)
    plans = node.own_plans(records_plans(client, ins, message.content["plans"], node.run.seed, round_index))
    broadcast = record_tensors(message.content["broadcast"], node.dtype, node.device)
    method, members = node.algorithm.method, len(plans)
    rows: dict[str, torch.Tensor] = {}
    store = node_store(context, node, client) if method.state_fields else None
    if store is not None:
        try:
            own = accepted_rows(store, int(ins["last-round"]))
        except StateLost as exc:
            return Message(Error(STATE_LOST, str(exc)), reply_to=message)
        for name in method.state_fields:
            row = (
                torch.from_numpy(own[name]).to(node.device, node.dtype)
                if own is not None
                else torch.zeros(node.dim, dtype=node.dtype, device=node.device)
            )
            rows[name] = row.expand(members, -1).clone()
        rows["created"] = torch.full((members,), own is not None, dtype=torch.bool)
    result = method.client_update(broadcast, plans, rows, node.trainer(round_index, float(ins["lr-scale"])))
    if store is not None:  # a client sampled twice keeps its last update, as the simulation's store does
        store.save(
            "pending", round_index, {name: result.rows[name][-1].detach().cpu().numpy() for name in method.state_fields}
        )
    info = ConfigRecord(
        {
            "client": client,
            "round": round_index,
            "members": members,
            "sample-gradients": int(result.sample_gradients),
            **{f"extra.{k}": float(v) for k, v in result.extras.items()},
        }
    )
    payload = result.payload
    if "weights" in ins:  # secure aggregation: Σ ν_iΔ_i stays here until the round's SecAgg+ exchange (:mod:`.secagg`)
        keep_weighted_update(
            context.state,
            node.run.index,
            client,
            round_index,
            torch.tensor(list(ins["weights"]), dtype=node.dtype, device=node.device) @ payload["delta"],
        )
        payload = {}
    return Message(RecordDict({"payload": tensors_record(payload), "result": info}), reply_to=message)


def evaluate_reply(message: Message, context: Context, runtime: Callable[[Context, int], NodeRuntime]) -> Message:
    """Federated evaluation: for the clients the message lists, with their objective weights w_i, this node's share of
    f(x) = Σ_i w_i f_i(x) and of ∇f(x), and its correct predictions (each client's rows weighted s_j = w_i/|D_i|)."""
    ins = message.content["instructions"]
    node = runtime(context, int(ins["run"]))
    clients, weights = [int(c) for c in ins["clients"]], [float(w) for w in ins["weights"]]
    for client in clients:
        if (why := node.missing(client)) is not None:
            return Message(Error(WRONG_RUN, why), reply_to=message)
    params = record_tensors(message.content["model"], node.dtype, node.device)["model"]
    problem, data = node.problem, node.data
    loss, gradient, correct = 0.0, torch.zeros_like(params), 0.0
    for client, weight in zip(clients, weights):
        index = torch.from_numpy(data.client_indices[client]).to(data.features.device)
        features, labels = data.features[index], data.labels[index]
        dtype = features.dtype if features.is_floating_point() else node.dtype
        s = torch.full((len(index),), weight / len(index), dtype=dtype, device=features.device)
        loss += float(problem.weighted_loss(params, features, labels, s))
        gradient += problem.weighted_gradient(params, features, labels, s)
        accuracy = problem.accuracy(params, features, labels)
        correct = -1.0 if accuracy is None or correct < 0 else correct + accuracy * len(index)
    info = ConfigRecord({"loss": loss, "correct": correct, "samples": int(sum(int(data.sizes[c]) for c in clients))})
    return Message(RecordDict({"scores": info, "gradient": tensors_record({"gradient": gradient})}), reply_to=message)


def make_client_app(runtime: Callable[[Context, int], NodeRuntime], mods: Sequence[Mod] = ()) -> ClientApp:
    """A ClientApp answering fedshuffle's four message types with the node runtimes ``runtime(context, run index)``
    gives; Flower's ``mods`` (``mod(message, context, call_next) -> Message``) wrap every message, in order."""
    app = ClientApp(mods=list(mods))
    app.query("fedshuffle")(lambda message, context: handshake_reply(message, context, runtime))
    app.query("evaluate")(lambda message, context: evaluate_reply(message, context, runtime))
    app.train("gradients")(lambda message, context: gradients_reply(message, context, runtime))
    app.train(mods=[node_mod(lambda context, run: runtime(context, run).dim)])(
        lambda message, context: train_reply(message, context, runtime)
    )
    return app


def node_integer(context: Context, key: str, default: int) -> int:
    """An integer setting of the node config (``--node-config 'KEY=VALUE'``), ``default`` when absent."""
    value = context.node_config.get(key, default)
    if isinstance(value, bool) or isinstance(value, str) and not re.fullmatch(r"\s*-?[0-9]+\s*", value, re.ASCII):
        raise ConfigError(f"node-config.{key}", f"expected an integer (ASCII digits), got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"node-config.{key}", f"expected an integer, got {value!r}") from None


def hosted_clients(context: Context) -> tuple[int, ...]:
    """The clients this node hosts: its ``clients`` (``0-4``, ``0,3,7``), or its ``partition-id`` (one client), or
    with neither, every client whose file its ``data-path`` folder holds."""
    config = context.node_config
    if config.get("clients") is not None:
        if config.get("partition-id") is not None:
            raise ConfigError("node-config.clients", "give either clients or partition-id, not both")
        return parse_clients(config["clients"])
    if config.get("partition-id") is None and config.get("data-path"):
        clients = folder_clients(Path(str(config["data-path"])))
        if not clients:
            raise ConfigError(
                "node-config.data-path", f"{config['data-path']} holds no client-<id>.npz file (nor partition)"
            )
        return clients
    if config.get("partition-id") is None:
        raise ConfigError(
            "node-config.clients",
            "this node hosts no client; start it with --node-config 'clients=\"0-4\"' (or 'partition-id=K')",
        )
    partition = node_integer(context, "partition-id", -1)
    if partition < 0:
        raise ConfigError("node-config.partition-id", f"must be a client id >= 0, got {partition}")
    return (partition,)
