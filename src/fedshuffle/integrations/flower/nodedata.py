"""A node's own data: the files of the clients it hosts, and the helper that writes them from any experiment.

A node given ``--node-config 'data-path=FOLDER'`` builds its clients from ``FOLDER`` alone, never the
federation's whole dataset. The format, one NumPy ``.npz`` file per client::

    FOLDER/client-<id>.npz     x        the client's samples, shape (|D_i|, ...): features (float) or token ids
                               y        their labels, shape (|D_i|,) (integer classes; per-position targets (|D_i|, L))
                               classes  (optional, a 0-d integer) the federation's number of classes; default:
                                        the largest label in the node's files + 1

``<id>`` is written in ASCII digits. A client's data may instead be a partition written by Flower's
dataset tooling (``flwr-datasets``: a saved ``Dataset`` folder ``client-<id>/``, ``client-<id>.parquet`` or
``client-<id>.csv``), its columns named by the node config (:mod:`.partitions`). Each client's data is checked as
the ``npz`` data source checks its file (a regular file, its headers before any data is read, real and finite
features, labels that are class indices 0..classes−1; ``classes`` 0 for targets without classes; :func:`check_client`
for every format); a file that fails is one error naming it, which the node's handshake reply carries.

The rows are in the order the client's minibatch plans number them (0..|D_i|−1). The node builds the
run's problem from its samples' shape and ``classes``, then each client's rows as ``fedshuffle run``
holds them (features flattened per sample, labels encoded by the problem, floats in the run's dtype).
In the handshake it reports each client's size and :func:`rows_digest`; a server that has the data too
compares them with its own, so a node holding other rows is refused before round 1.

:func:`write_node_folders` (``fedshuffle flower-split CONFIG --nodes K --out DIR``) writes an
experiment's clients into ``DIR/node-<k>/`` this way, the split ``fedshuffle run`` makes at the seed.
Nothing here needs Flower.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedshuffle.core.errors import ConfigError, DataError, section
from fedshuffle.core.io import special_kind, write_atomic
from fedshuffle.data.catalog import Samples, federate, load_samples
from fedshuffle.data.sources import checks
from fedshuffle.data.sources.arrays import READ_ERRORS
from fedshuffle.experiments.runner import DTYPES, seeded
from fedshuffle.experiments.schema import Experiment, RunSpec
from fedshuffle.integrations.flower.partitions import PARTITION_NAMES, Columns, read_partition
from fedshuffle.problems import PROBLEMS, Problem

#: a client's file in a node's folder
CLIENT_FILE = "client-{}.npz"


def rows_digest(data: Any, client: int) -> str:
    """SHA-256 (first 16 hex digits) of ``client``'s rows as ``data`` (a federated dataset, or a node's clients) holds
    them: its features then its labels, their bytes, in the order of the client's index set."""
    index = torch.from_numpy(np.asarray(data.client_indices[client], dtype=np.int64)).to(data.features.device)
    digest = hashlib.sha256()
    for tensor in (data.features[index], data.labels[index]):
        digest.update(np.ascontiguousarray(tensor.detach().cpu().numpy()).tobytes())
    return digest.hexdigest()[:16]


def refuse_theory(spec: RunSpec, why: str) -> None:
    """'theory' step sizes (any of the run's step sizes, :meth:`RunSpec.step_sizes`) need the smoothness of the whole
    federation's data: refused where ``why`` says it is not there."""
    for name in spec.step_sizes():
        if spec.value(name) == "theory":
            raise ConfigError(name, f"'theory' step sizes need the whole federation's data, and {why}; give a number")


def folder_clients(folder: Path) -> tuple[int, ...]:
    """The clients whose data a node's folder holds: ``client-<id>.npz``, or a partition written by ``flwr-datasets``
    (``client-<id>/``, ``client-<id>.parquet``, ``client-<id>.csv``: :mod:`.partitions`)."""
    clients = set()
    for path in Path(folder).glob("client-*"):
        tail = path.name[len("client-") :]
        for suffix in (".npz", ".parquet", ".csv"):
            tail = tail.removesuffix(suffix)
        if tail.isascii() and tail.isdigit():
            clients.add(int(tail))
    return tuple(sorted(clients))


def client_path(folder: Path, client: int) -> Path:
    """The one file (or saved dataset's folder) of ``client`` in a node's ``folder``; :class:`ConfigError` naming the
    folder where there is none or more than one."""
    found = [folder / name.format(client) for name in (CLIENT_FILE, *PARTITION_NAMES)]
    found = [path for path in found if path.exists()]
    if not found:
        raise ConfigError(
            "node-config.data-path",
            f"{folder / CLIENT_FILE.format(client)} not found: the node hosts client {client} but its folder has no "
            f"file for it (nor a partition client-{client}/, client-{client}.parquet or client-{client}.csv)",
        )
    if len(found) > 1:
        raise ConfigError(
            "node-config.data-path", f"{folder} holds client {client} twice ({', '.join(p.name for p in found)})"
        )
    return found[0]


#: the most classes a client file may declare
MAX_CLASSES = 2**31 - 1


def _classes(value: np.ndarray, where: str) -> int:
    """A file's ``classes``: one integer 0..MAX_CLASSES, 0 for targets without classes (an integral float such as
    10.0 is one; 2.7 is not)."""
    if value.ndim != 0 or not (np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating)):
        raise DataError(where, f"classes: expected one integer (a 0-d array), got shape {value.shape} of {value.dtype}")
    number = value.item()
    if isinstance(number, float) and not (np.isfinite(number) and number == int(number)):
        raise DataError(where, f"classes = {number:g}: the number of classes is an integer 0..{MAX_CLASSES}")
    if not 0 <= int(number) <= MAX_CLASSES:
        raise DataError(where, f"classes = {int(number)}: the number of classes is an integer 0..{MAX_CLASSES}")
    return int(number)


def read_client_file(path: Path) -> tuple[np.ndarray, np.ndarray, int | None]:
    """``x``, ``y`` and ``classes`` (None where the file gives none) of one client file, checked as the ``npz`` data
    source checks its file; any problem is a :class:`DataError` naming ``path``. A FIFO, a device or a folder is
    refused without being opened; headers are checked before any data is read (no objects, no more than the file
    holds or memory allows)."""
    where = str(path)
    try:
        kind = special_kind(os.stat(path).st_mode)
        if kind is not None:
            raise DataError(where, f"is {kind}, not a regular file: a client file is an .npz archive")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        with os.fdopen(fd, "rb") as fh:
            kind = special_kind(os.fstat(fh.fileno()).st_mode)
            if kind is not None:
                raise DataError(where, f"is {kind}, not a regular file: a client file is an .npz archive")
            checks.check_npz_members(fh, where, ("x", "y", "classes"))
            fh.seek(0)
            with np.load(fh, allow_pickle=False) as saved:
                arrays = {name: saved[name] for name in saved.files if name in ("x", "y", "classes")}
                names = sorted(saved.files)
    except FileNotFoundError:
        raise
    except ConfigError:
        raise
    except READ_ERRORS as exc:
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise DataError(where, f"not a readable .npz file ({why})") from None
    if "x" not in arrays or "y" not in arrays:
        raise DataError(where, f"expected arrays 'x' (samples) and 'y' (labels), got {names}")
    classes = _classes(arrays["classes"], where) if "classes" in arrays else None
    return check_client(arrays["x"], arrays["y"], classes, where)


def check_client(
    x: np.ndarray, y: np.ndarray, classes: int | None, where: str
) -> tuple[np.ndarray, np.ndarray, int | None]:
    """A client's samples ``x`` and labels ``y``, whatever file they came from, checked as the ``npz`` data source
    checks its file: one label per row, labels class indices 0..classes−1, real and finite features; a problem is
    a :class:`DataError` naming ``where``."""
    if x.ndim < 1 or len(x) == 0 or y.ndim not in (1, 2) or len(y) != len(x):
        raise DataError(
            where,
            f"expected x with one row per sample and y with one label per row, got shapes {x.shape} and {y.shape}",
        )
    labels = checks.class_labels(y.reshape(-1), where, "y").reshape(y.shape)
    if classes and labels.size and int(labels.max()) >= classes:
        row = int(np.flatnonzero(labels.reshape(-1) >= classes)[0])
        raise DataError(
            where,
            f"y[{row}] = {int(labels.reshape(-1)[row])}: labels must be class indices "
            f"0..{classes - 1} (the file's classes = {classes})",
        )
    checks.features(x, where, "x", samples=len(labels))
    return x, y, classes


@dataclass(frozen=True)
class SampleKind:
    """What a problem is built from besides its settings: one sample's shape, the number of classes, the samples' dtype
    (NumPy's ``dtype.str``). A server without the data builds the run's problem from the nodes' report of it."""

    shape: tuple[int, ...]
    classes: int
    dtype: str

    def problem(self, spec: RunSpec) -> Problem:
        """``spec``'s problem for samples of this kind (a model's shape depends on nothing else)."""
        stand_in = Samples(
            np.zeros((1, *self.shape), dtype=np.dtype(self.dtype)), np.zeros(1, dtype=np.int64), self.classes
        )
        with section("problem"):
            return PROBLEMS[spec.problem.name].build(spec.problem.own_settings(), samples=stand_in)


@dataclass
class OwnClients:
    """A node's clients built from its own files: the run's problem, and the clients' rows stacked in ``clients``
    order."""

    problem: Problem
    features: torch.Tensor
    labels: torch.Tensor
    clients: tuple[int, ...]
    sizes: dict[int, int]
    sample: SampleKind

    @classmethod
    def read(
        cls, folder: str | Path, clients: Sequence[int] | None, spec: RunSpec, columns: Columns = Columns()
    ) -> OwnClients:
        """``clients``' files (None: every client in ``folder``), built for ``spec``'s problem and dtype; partitions
        written by ``flwr-datasets`` read by ``columns`` (:mod:`.partitions`)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError("node-config.data-path", f"{folder} is not a folder (it must hold client-<id>.npz files)")
        clients = tuple(clients) if clients is not None else folder_clients(folder)
        if not clients:
            raise ConfigError("node-config.data-path", f"{folder} holds no client-<id>.npz file (nor partition)")
        xs, ys, classes, paths = [], [], set(), []
        for client in clients:
            path = client_path(folder, client)
            if path.suffix == ".npz":
                x, y, given = read_client_file(path)
            else:
                x, y, given = check_client(*read_partition(path, columns), str(path))
            if given is not None:
                classes.add(given)
            if xs and x.shape[1:] != xs[0].shape[1:]:
                raise DataError(
                    str(path), f"samples of shape {x.shape[1:]}, the node's other clients have {xs[0].shape[1:]}"
                )
            if xs and y.shape[1:] != ys[0].shape[1:]:
                raise DataError(
                    str(path),
                    f"labels of shape {y.shape[1:]} per sample, the node's other clients have {ys[0].shape[1:]}",
                )
            xs.append(x)
            ys.append(y)
            paths.append(path)
        if len(classes) > 1:
            raise DataError(str(folder), f"the client files disagree on 'classes' ({sorted(classes)})")
        x, y = np.concatenate(xs), np.concatenate(ys)
        given = bool(classes)
        num_classes = classes.pop() if classes else int(y.max(initial=0)) + 1
        try:
            with section("problem"):
                samples = Samples(x, y, num_classes)
                problem = PROBLEMS[spec.problem.name].build(spec.problem.own_settings(), samples=samples)
        except ConfigError as exc:
            if given or isinstance(exc, DataError):
                raise
            largest = max(range(len(ys)), key=lambda k: int(ys[k].max(initial=0)))  # the file that set the classes
            most = int(ys[largest].max(initial=0))
            why = f"its largest label, {most}, makes {num_classes} classes: {exc}"
            raise DataError(str(paths[largest]), why) from None
        dtype = DTYPES[spec.run.dtype]
        features, labels = torch.as_tensor(x.reshape(len(x), -1)), problem.encode_labels(y)
        features = features.to(dtype) if features.is_floating_point() else features
        labels = labels.to(dtype) if labels.is_floating_point() else labels
        return cls(
            problem,
            features,
            labels,
            clients,
            {c: len(part) for c, part in zip(clients, xs)},
            SampleKind(tuple(x.shape[1:]), num_classes, x.dtype.str),
        )


def raw_federation(spec: RunSpec):
    """The federated dataset of ``spec`` as ``fedshuffle run`` splits it, with each sample's features in the source's
    shape (not flattened) and its labels as the source gives them (not encoded), and that shape."""
    settings = spec.data.model_dump()
    samples, rng = load_samples(settings, spec.run.seed)
    data = federate(samples, settings, rng)  # the same split: the stream does not depend on the labels' encoding
    return data, tuple(samples.features.shape[1:]), samples.num_classes


def write_node_folders(
    experiment: Experiment, nodes: int, out: str | Path, seed: int | None = None, overrides: dict | None = None
) -> list[tuple[Path, tuple[int, ...]]]:
    """Write the clients of ``experiment``'s first variant (its split at ``seed``, default its first seed) into
    ``out/node-<k>/client-<id>.npz`` (the format of this module), ``nodes`` folders of consecutive clients;
    returns each folder with its clients. Every variant of an experiment splits the data alike unless it
    changes ``[data]``; the split is the first variant's."""
    (label, spec), *_ = experiment.runs(overrides or {})
    seed = experiment.seeds(spec)[0] if seed is None else seed
    spec = seeded(spec, seed)
    data, shape, classes = raw_federation(spec)
    if not 1 <= nodes <= data.num_clients:
        raise ConfigError("--nodes", f"must be 1..{data.num_clients} (the number of clients), got {nodes}")
    out = Path(out)
    written = []
    for k, clients in enumerate(np.array_split(np.arange(data.num_clients), nodes)):
        folder = out / f"node-{k}"
        folder.mkdir(parents=True, exist_ok=True)
        for client in clients.tolist():
            rows = torch.from_numpy(np.asarray(data.client_indices[client], dtype=np.int64))
            x = data.features[rows].numpy().reshape(len(rows), *shape)
            y = data.labels[rows].numpy()
            buffer = _npz(x=x, y=y, classes=np.array(classes, dtype=np.int64))
            write_atomic(folder / CLIENT_FILE.format(client), buffer)
        written.append((folder, tuple(clients.tolist())))
    return written


def _npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()
