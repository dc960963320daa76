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
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from fedshuffle.core.errors import ConfigError
from fedshuffle.data.federated import PopulationCounts
from fedshuffle.experiments.runner import seeded
from fedshuffle.experiments.schema import SECTIONS, Experiment, RunSpec, load_experiment, parse_overrides, validate
from fedshuffle.experiments.sinks import flatten

#: the experiment inside a written app (JSON: paths already resolved)
EXPERIMENT_FILE = "experiment.json"
#: what the server does with an invalid reply: drop its member from the round, or stop the run
INVALID_REPLY_POLICIES = ("drop", "stop")
#: who scores the model: the server on its data (central), each node its own clients (federated), or auto: central
#: where the server has the data, federated where only the nodes have it (node-data = true)
EVALUATIONS = ("auto", "central", "federated", "both")
#: what the server does with an update beyond the bound: drop its member (an invalid reply), or scale it to the bound
UPDATE_BOUND_ACTIONS = ("reject", "clip")
#: the server's aggregation of the members' Δ_i: the method's own, or a robust one (the FedAvg family only)
ROBUST_AGGREGATIONS = ("none", "median", "trimmed-mean")


def _check_evaluation(evaluation: str, node_data: bool) -> None:
    """The server scores the model only where it has the data."""
    if evaluation in ("central", "both") and node_data:
        raise ConfigError(
            "run-config.evaluation",
            f'{evaluation!r} needs the data at the server, and with node-data = true it has none: give "federated" '
            '(or "auto")',
        )


def _key(default: Any, description: str, **constraints: Any) -> Any:
    """A run-config key: its default, its one-line description (the app's pyproject.toml, the docs) and its
    constraints (``title``: the noun of a choice's error); the field's alias (the key) is its name, ``-`` for ``_``."""
    return Field(default, description=description, **constraints)


class AppSettings(BaseModel):
    """The app's run configuration (``[tool.flwr.app.config]``, overridden by ``flwr run --run-config``): one field per
    key, the key its alias. Each key's type, constraint, default and description are declared here once; the app's
    pyproject.toml lines (:func:`pyproject_lines`), the docs' table (:func:`settings_table`) and the errors (one line
    naming the key and the accepted values, :meth:`from_run_config`) come from them.

    Keys with a dot (``local.lr``, ``run.rounds``) are not settings of the app but the experiment's: they override
    its sections as ``fedshuffle run --set`` does (``experiment``), validated by the same schema.
    """

    model_config = ConfigDict(
        strict=True,
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        alias_generator=lambda name: name.replace("_", "-"),
    )

    variant: str = _key("", 'one variant\'s label; "" runs every variant in turn')
    seed: int = _key(-1, "-1: the experiment's first seed", ge=-1)
    overrides: str = Field(
        "", alias="set", description='overrides as in `fedshuffle run --set`, separated by ";" (or keys `local.lr`, …)'
    )
    out: str = _key("", 'results folder on the server\'s machine ("" = none)')
    round_timeout: float = _key(
        600.0, "seconds a round waits; members later than that are dropped (unfinished work)", gt=0, allow_inf_nan=False
    )
    connect_timeout: float = _key(120.0, "seconds to wait for nodes hosting every client", gt=0, allow_inf_nan=False)
    resume: bool = _key(False, "continue each run from its checkpoint in `out`")
    invalid_reply: Literal[INVALID_REPLY_POLICIES] = _key(
        "drop",
        'a reply that fails the server\'s checks: "drop" its member for the round, or "stop" the run',
        title="policy",
    )
    node_data: bool = _key(False, "the nodes bring their own data (node config data-path); the server builds none")
    secure_aggregation: bool = _key(False, "the server sees only each round's weighted sum (Flower's SecAgg+)")
    secagg_num_shares: float = _key(3.0, "SecAgg+: shares of each node's secrets (> 2, or a fraction of the nodes)")
    secagg_reconstruction_threshold: float = _key(2.0, "SecAgg+: shares that rebuild a secret")
    secagg_clipping_range: float = _key(8.0, "SecAgg+: a node's input must lie in [-c, c]")
    secagg_quantization_range: int = _key(1 << 22, "SecAgg+: levels of [-c, c]; the sum is within nodes·2c/Q")
    evaluation: Literal[EVALUATIONS] = _key(
        "auto",
        'who scores the model: "central" (the server), "federated" (each node its clients), "both", "auto"',
        title="evaluation",
    )
    update_bound: float = _key(
        0.0,
        "c: a member's ‖Δ_i‖ may be at most c·max(‖x‖, update-bound-floor); 0 = no bound",
        ge=0,
        allow_inf_nan=False,
    )
    update_bound_floor: float = _key(
        1.0, "the model norm the bound uses at least (a model at 0 is not stuck)", gt=0, allow_inf_nan=False
    )
    update_bound_action: Literal[UPDATE_BOUND_ACTIONS] = _key(
        "reject", 'an update beyond the bound: "reject" it (an invalid reply) or "clip" it to the bound', title="action"
    )
    robust_aggregation: Literal[ROBUST_AGGREGATIONS] = _key(
        "none",
        'the FedAvg family\'s Σ ω_iΔ_i as W·(coordinate-wise) "median" or "trimmed-mean" of the Δ_i',
        title="robust aggregation",
    )
    trim_fraction: float = _key(
        0.1, "trimmed-mean: the fraction β of members cut at each end of every coordinate", ge=0, lt=0.5
    )
    experiment: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any]) -> AppSettings:
        """Settings from a Flower run configuration: the app's keys checked against their fields, the dotted keys
        kept as the experiment's overrides (a value "" leaves the experiment's own); errors name the key."""
        config = flatten(config)  # as Flower flattens the app's pyproject.toml
        own = {key: value for key, value in config.items() if "." not in key}
        experiment = {key: value for key, value in config.items() if "." in key and value != ""}
        if "experiment" in own:
            raise ConfigError("run-config.experiment", f"unknown setting; accepted: {', '.join(_keys())}")
        for key in experiment:
            if key.split(".")[0] not in SECTIONS or key.count(".") != 1:
                raise ConfigError(
                    f"run-config.{key}",
                    f"unknown setting; an experiment's is section.setting, section one of {', '.join(SECTIONS)}",
                )
        try:
            settings = cls.model_validate({**own, "experiment": experiment})
        except ValidationError as exc:
            raise _one_line(exc, own) from None
        _check_evaluation(settings.evaluation, settings.node_data)
        return settings

    def override_sections(self) -> dict[str, Any]:
        """The experiment's overrides as sections (:func:`fedshuffle.experiments.schema.parse_overrides`): the ``set``
        string's, then the dotted keys' (``local.lr = 0.05``), each written as ``--set`` reads it."""
        assignments = [part.strip() for part in self.overrides.split(";") if part.strip()]
        assignments += [f"{key}={_toml_value(value)}" for key, value in self.experiment.items()]
        return parse_overrides(assignments)


def _toml_value(value: Any) -> str:
    """A run-config value as TOML writes it (the form ``--set`` parses)."""
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _one_line(exc: ValidationError, config: Mapping[str, Any]) -> ConfigError:
    """A :class:`ConfigError` naming the run-config key of ``exc``'s first error and what it accepts."""
    error = exc.errors()[0]
    key = str(error["loc"][0]) if error["loc"] else "run-config"
    if error["type"] == "extra_forbidden":
        return ConfigError(f"run-config.{key}", f"unknown setting; accepted: {', '.join(_keys())}, or section.setting")
    value, info = config.get(key), _keys().get(key)
    accepted = get_args(info.annotation) if info is not None else ()
    if error["type"] == "literal_error" and accepted:
        return ConfigError(f"run-config.{key}", f"unknown {info.title} {value!r}; accepted: {', '.join(accepted)}")
    if error["type"].endswith("_type") and info is not None:
        return ConfigError(f"run-config.{key}", f"expected {info.annotation.__name__}, got {value!r}")
    return ConfigError(f"run-config.{key}", f"{error['msg'][0].lower()}{error['msg'][1:]}, got {value!r}")


def _keys() -> dict[str, FieldInfo]:
    """The run-config keys and their fields."""
    return {info.alias: info for info in AppSettings.model_fields.values() if not info.exclude}


def pyproject_lines(settings: AppSettings) -> str:
    """The app's ``[tool.flwr.app.config]`` lines: every key with its value in ``settings`` and its description
    (Flower refuses a ``--run-config`` key the app does not declare)."""
    values = settings.model_dump(by_alias=True)
    return "".join(f"{key} = {_toml_value(values[key])}   # {info.description}\n" for key, info in _keys().items())


def settings_table() -> str:
    """The run-config keys as a Markdown table: key, default, description (the docs' table)."""
    rows = ["| key | default | |", "|---|---|---|"]
    for key, info in _keys().items():
        text = info.description.replace("|", "\\|")
        rows.append(f"| `{key}` | `{_toml_value(info.default)}` | {text} |")
    return "\n".join(rows) + "\n"


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
    given_as = "run-config" if settings.experiment and not settings.overrides else "--set"
    runs = experiment.runs(settings.override_sections(), given_as)
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
