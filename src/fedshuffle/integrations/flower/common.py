"""What the ServerApp and every ClientApp of a federation agree on, built without Flower.

Both sides read the same experiment (embedded in the app) and the same run configuration, so they
build the same list of :class:`FederatedRun` (one per selected variant) and, for each, the same
problem, data, sampler and algorithm as ``fedshuffle run`` (:func:`fedshuffle.experiments.runner.build_simulation`).
A node then keeps only the partitions of the clients it hosts (:class:`NodeData`); the server plans on
the population's sizes alone (:class:`Population`), with each client's rows numbered 0..|D_i|−1, which
are the positions in the client's partition of the rows the simulation's plans name.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.data.federated import PopulationCounts
from fedshuffle.experiments.runner import seeded
from fedshuffle.experiments.schema import Experiment, RunSpec, load_experiment, parse_overrides, validate

#: the experiment inside a written app (JSON: paths already resolved)
EXPERIMENT_FILE = "experiment.json"
#: what the server does with an invalid reply: drop its member from the round, or stop the run
INVALID_REPLY_POLICIES = ("drop", "stop")
#: who scores the model: the server on its data (central), each node its own clients (federated), or auto: central
#: where the server has the data, federated where only the nodes have it (node-data = true)
EVALUATIONS = ("auto", "central", "federated", "both")


def check_evaluation(evaluation: str, node_data: bool) -> None:
    """``evaluation`` is one of :data:`EVALUATIONS`, and the server scores the model only where it has the data."""
    if evaluation not in EVALUATIONS:
        raise ConfigError(
            "run-config.evaluation", f"unknown evaluation {evaluation!r}; accepted: {', '.join(EVALUATIONS)}"
        )
    if evaluation in ("central", "both") and node_data:
        raise ConfigError(
            "run-config.evaluation",
            f'{evaluation!r} needs the data at the server, and with node-data = true it has none: give "federated" '
            '(or "auto")',
        )


@dataclass(frozen=True)
class AppSettings:
    """The app's run configuration (``[tool.flwr.app.config]``, overridden by ``flwr run -c``).

    ``variant``: one variant's label, or "" for every variant in turn; ``seed``: −1 for the
    experiment's first seed; ``set``: overrides as in ``fedshuffle run --set``, separated by ";"
    (e.g. "run.rounds=5; local.lr=0.1"); ``out``: a results folder on the server's machine ("" = none);
    ``round-timeout``: seconds a round waits for its members (later ones are dropped as unfinished work);
    ``connect-timeout``: seconds the server waits for nodes hosting every client to connect; ``resume``:
    continue each run from the checkpoint in ``out`` (stateful methods need nodes with a ``state-dir``);
    ``invalid-reply``: what an invalid reply (wrong dtype, shape, non-finite entries, implausible counts)
    does: ``"drop"`` its member from the round, with the reason logged, or ``"stop"`` the run; ``node-data``: the
    nodes bring their own data (node config ``data-path``) and the server builds none: it plans on the clients'
    sizes and kind of samples the handshake reports, and evaluates federatedly (each node scores its clients);
    ``secure-aggregation``: the server sees only the round's weighted sum, through Flower's SecAgg+, with its settings
    ``secagg-num-shares``, ``secagg-reconstruction-threshold``, ``secagg-clipping-range``, ``secagg-quantization-range``
    (:mod:`~fedshuffle.integrations.flower.secagg`).
    ``evaluation``: ``"central"`` (the server scores the model on its data), ``"federated"`` (each node scores its own
    clients, the server adds their shares), ``"both"`` (central, and the federated scores beside it as
    ``federated_loss``,
    ``federated_grad_norm_sq``, ``federated_train_accuracy``) or ``"auto"``: federated with ``node-data``, central
    otherwise.
    """

    variant: str = ""
    seed: int = -1
    overrides: str = ""
    out: str = ""
    round_timeout: float = 600.0
    connect_timeout: float = 120.0
    resume: bool = False
    invalid_reply: str = "drop"
    node_data: bool = False
    secure_aggregation: bool = False
    secagg_num_shares: float = 3.0
    secagg_reconstruction_threshold: float = 2.0
    secagg_clipping_range: float = 8.0
    secagg_quantization_range: int = 1 << 22
    evaluation: str = "auto"

    KEYS = {
        "variant": ("variant", str),
        "seed": ("seed", int),
        "set": ("overrides", str),
        "out": ("out", str),
        "round-timeout": ("round_timeout", float),
        "connect-timeout": ("connect_timeout", float),
        "resume": ("resume", bool),
        "invalid-reply": ("invalid_reply", str),
        "node-data": ("node_data", bool),
        "secure-aggregation": ("secure_aggregation", bool),
        "secagg-num-shares": ("secagg_num_shares", float),
        "secagg-reconstruction-threshold": ("secagg_reconstruction_threshold", float),
        "secagg-clipping-range": ("secagg_clipping_range", float),
        "secagg-quantization-range": ("secagg_quantization_range", int),
        "evaluation": ("evaluation", str),
    }
    #: each key's one line in a written app's ``pyproject.toml`` (:mod:`.bundle`), which lists every key: Flower
    #: refuses a
    #: ``--run-config`` key the app does not declare
    HELP = {
        "variant": 'one variant\'s label; "" runs every variant in turn',
        "seed": "-1: the experiment's first seed",
        "set": 'overrides as in `fedshuffle run --set`, separated by ";"',
        "out": 'results folder on the server\'s machine ("" = none)',
        "round-timeout": "seconds a round waits; members later than that are dropped (unfinished work)",
        "connect-timeout": "seconds to wait for nodes hosting every client",
        "resume": "continue each run from its checkpoint in `out`",
        "invalid-reply": 'a reply that fails the server\'s checks: "drop" its member for the round, or "stop" the run',
        "node-data": "the nodes bring their own data (node config data-path); the server builds none",
        "secure-aggregation": "the server sees only each round's weighted sum (Flower's SecAgg+)",
        "secagg-num-shares": "SecAgg+: shares of each node's secrets (> 2, or a fraction of the nodes)",
        "secagg-reconstruction-threshold": "SecAgg+: shares that rebuild a secret",
        "secagg-clipping-range": "SecAgg+: a node's input must lie in [-c, c]",
        "secagg-quantization-range": "SecAgg+: levels of [-c, c]; the sum is within nodes·2c/Q",
        "evaluation": 'who scores the model: "central" (the server), "federated" (each node its clients), "both", '
        '"auto"',
    }

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any]) -> AppSettings:
        """Settings from a Flower run configuration; unknown keys and wrong types name the key."""
        values: dict[str, Any] = {}
        for key, value in config.items():
            if key not in cls.KEYS:
                raise ConfigError(f"run-config.{key}", f"unknown setting; accepted: {', '.join(cls.KEYS)}")
            name, kind = cls.KEYS[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ConfigError(f"run-config.{key}", f"expected {kind.__name__}, got {value!r}")
            values[name] = value
        settings = cls(**values)
        for key in ("round-timeout", "connect-timeout"):
            seconds = getattr(settings, cls.KEYS[key][0])
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ConfigError(f"run-config.{key}", f"must be a positive number of seconds, got {seconds}")
        if settings.invalid_reply not in INVALID_REPLY_POLICIES:
            raise ConfigError(
                "run-config.invalid-reply",
                f"unknown policy {settings.invalid_reply!r}; accepted: {', '.join(INVALID_REPLY_POLICIES)}",
            )
        check_evaluation(settings.evaluation, settings.node_data)
        return settings

    def override_sections(self) -> dict[str, Any]:
        """The ``set`` overrides as sections (:func:`fedshuffle.experiments.schema.parse_overrides`)."""
        return parse_overrides([part.strip() for part in self.overrides.split(";") if part.strip()])


class FederationError(RuntimeError):
    """The federation cannot go on: wrong or missing nodes, a failing ClientApp, lost client state, an invalid
    reply under ``invalid_reply="stop"``."""


class ClientStateLost(FederationError):
    """A client's state (SCAFFOLD's c_i, FedCDR's y_i, …) is not on its node any more: never silently reset."""


@dataclass(frozen=True)
class FederatedRun:
    """One variant at one seed, as the federation runs it; ``index`` is its position in the app's run list,
    ``experiment`` the experiment's name (the sinks gather its runs under it)."""

    index: int
    label: str
    spec: RunSpec
    seed: int
    experiment: str = "fedshuffle"

    @property
    def digest(self) -> str:
        """A fingerprint of the run's settings: the server refuses nodes that would run anything else."""
        text = json.dumps(
            {"label": self.label, "seed": self.seed, "spec": self.spec.model_dump(mode="json")}, sort_keys=True
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_experiment(path: str | Path) -> Experiment:
    """An experiment from an app's embedded JSON, or from a TOML file or preset name."""
    path = Path(path)
    if path.suffix != ".json":
        return load_experiment(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("config", f"file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid JSON ({exc})") from None
    return validate(Experiment, raw)


def federated_runs(experiment: Experiment, settings: AppSettings) -> list[FederatedRun]:
    """The runs the app's settings select: every variant (or the one named), at one seed each."""
    runs = experiment.runs(settings.override_sections())
    if settings.variant:
        labels = [label for label, _ in runs]
        if settings.variant not in labels:
            raise ConfigError(
                "run-config.variant",
                f"no variant {settings.variant!r}; the variants are: {', '.join(repr(x) for x in labels)}",
            )
        runs = [(label, spec) for label, spec in runs if label == settings.variant]
    out = []
    for k, (label, spec) in enumerate(runs):
        seed = settings.seed if settings.seed >= 0 else experiment.seeds(spec)[0]
        out.append(FederatedRun(k, label, seeded(spec, seed), seed, experiment.experiment.name))
    return out


class LocalRows(Sequence):
    """Client i's rows numbered 0..|D_i|−1: what a node calls the samples of its own partition."""

    def __init__(self, sizes: np.ndarray) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):
        return np.arange(self.sizes[i], dtype=np.int64)


@dataclass
class Population(PopulationCounts):
    """The server's view of the federation: each client's size |D_i| and weight w_i, no samples."""

    sizes: np.ndarray
    weights: np.ndarray
    client_indices: LocalRows = field(init=False)

    def __post_init__(self) -> None:
        self.sizes = np.asarray(self.sizes, dtype=np.int64)
        self.weights = np.asarray(self.weights, dtype=np.float64)
        self.client_indices = LocalRows(self.sizes)

    def to(self, dtype: torch.dtype, device: str | torch.device | None = None) -> Population:
        return self


class HostedRows(Sequence):
    """``client_indices`` of a node: client i's rows ``offset_i + 0..|D_i|−1`` of the node's tensors, for each client it
    hosts;
    any other client is not here."""

    def __init__(self, offsets: Mapping[int, int], sizes: np.ndarray) -> None:
        self.offsets, self.sizes = dict(offsets), sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):
        i = int(i)
        if i not in self.offsets:
            raise KeyError(f"client {i}'s data is not on this node (it hosts clients {format_clients(self.offsets)})")
        return self.offsets[i] + np.arange(self.sizes[i], dtype=np.int64)


@dataclass
class NodeData(PopulationCounts):
    """The partitions of the clients a node hosts, stacked in the order of ``clients`` (client i's rows
    numbered 0..|D_i|−1 from its offset), with the population's sizes and weights (for planning)."""

    features: torch.Tensor
    labels: torch.Tensor
    clients: tuple[int, ...]
    sizes: np.ndarray
    weights: np.ndarray
    client_indices: HostedRows = field(init=False)

    def __post_init__(self) -> None:
        offsets = np.concatenate([[0], np.cumsum(self.sizes[list(self.clients)])[:-1]]).astype(np.int64)
        self.client_indices = HostedRows(dict(zip(self.clients, offsets.tolist())), self.sizes)

    def to(self, dtype: torch.dtype, device: str | torch.device | None = None) -> NodeData:
        return self

    def offset(self, client: int) -> int:
        """Where client ``client``'s rows start in the node's tensors (a plan's rows are numbered from there)."""
        return self.client_indices.offsets[client]

    @classmethod
    def of(cls, data: Any, clients: Sequence[int]) -> NodeData:
        """Clients ``clients``' rows of a federated dataset, each in the order of its index set."""
        for client in clients:
            if not 0 <= client < data.num_clients:
                raise ConfigError(
                    "node-config.clients",
                    f"client {client} is not in the run: it has clients 0..{data.num_clients - 1}",
                )
        rows = np.concatenate([np.asarray(data.client_indices[c], dtype=np.int64) for c in clients])
        if hasattr(data, "gather"):  # generated on demand: generate these clients only
            order = np.argsort(rows, kind="stable")
            features, labels = data.gather(rows[order])
            back = torch.from_numpy(np.argsort(order, kind="stable"))
            features, labels = features[back], labels[back]
        else:
            index = torch.from_numpy(rows).to(data.features.device)
            features, labels = data.features[index], data.labels[index]
        return cls(
            features,
            labels,
            tuple(clients),
            np.asarray(data.sizes, dtype=np.int64),
            np.asarray(data.weights, dtype=np.float64),
        )


#: the most clients one node config may name
MAX_NODE_CLIENTS = 1_000_000


def parse_clients(value: object, key: str = "clients") -> tuple[int, ...]:
    """The clients a node config names: ``"0-4"``, ``"0,3,7"``, ``"0-2,5"``, one integer or a list of integers (sorted,
    each once); ids in ASCII digits, at most :data:`MAX_NODE_CLIENTS` of them."""
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value).strip()
    clients: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            first, _, last = part.partition("-")
            if not all(re.fullmatch(r"[0-9]+", n.strip(), re.ASCII) for n in (first, last or first)):
                raise ValueError(part)
            low, high = int(first), int(last) if last else int(first)
            if high < low or len(clients) + high - low + 1 > MAX_NODE_CLIENTS:
                raise ValueError(part)
            clients.extend(range(low, high + 1))
    except ValueError:
        why = (
            f"expected client ids (ASCII digits) and ranges such as '0-4' or '0,3,7', at most {MAX_NODE_CLIENTS:,} "
            f"clients, got {str(value)[:100]!r}"
        )
        raise ConfigError(f"node-config.{key}", why) from None
    if not clients:
        raise ConfigError(
            f"node-config.{key}", f"names no client; give ids and ranges such as '0-4' or '0,3,7', got {value!r}"
        )
    if len(set(clients)) != len(clients):
        raise ConfigError(f"node-config.{key}", f"names a client twice: {value!r}")
    return tuple(sorted(clients))


def format_clients(clients: Iterable[int]) -> str:
    """Client ids as ranges: ``0-2,5``."""
    ordered, parts = sorted(clients), []
    for client in ordered:
        if parts and parts[-1][1] == client - 1:
            parts[-1][1] = client
        else:
            parts.append([client, client])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)
