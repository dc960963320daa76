"""A node's clients as Flower's dataset tooling (``flwr-datasets``) writes partitions, read with pyarrow alone.

Beside fedshuffle's own ``client-<id>.npz``, a node's ``data-path`` folder may hold each client's partition as

    client-<id>/          a Hugging Face ``Dataset`` saved with ``save_to_disk`` (what ``FederatedDataset``'s
                          ``load_partition(id)`` returns): ``data-*.arrow`` (Arrow IPC streams, in the order
                          ``state.json`` lists them), ``dataset_info.json``, ``state.json``
    client-<id>.parquet   one Parquet file (``partition.to_parquet``)
    client-<id>.csv       one CSV file with a header row (``partition.to_csv``)

Columns are mapped by the node config: ``label-column`` (default ``"label"``) holds integer classes;
``feature-columns`` (names separated by ",", default every other column) the features: one column keeps its
per-row shape (a list of lists: an image's pixels), several are flattened per row and put side by side. The
number of classes is the ``ClassLabel``'s names in ``dataset_info.json`` where it declares one. Text or image
columns (strings, encoded bytes) are refused: decode them into numbers first. The rows then go through the same
checks as a client's ``.npz`` file (:func:`~fedshuffle.integrations.flower.nodedata.check_client`); any problem is
one error naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from fedshuffle.core.errors import ConfigError, DataError

#: a client's partition, by format: the name in a node's folder
PARTITION_NAMES = ("client-{}", "client-{}.parquet", "client-{}.csv")


@dataclass(frozen=True)
class Columns:
    """Which columns of a partition are the features and which the label (node config ``feature-columns`` and
    ``label-column``); ``features`` None: every column but the label."""

    features: tuple[str, ...] | None = None
    label: str = "label"

    @classmethod
    def from_node_config(cls, config: Any) -> Columns:
        """From a node config: ``feature-columns`` as "a,b" (or a list), ``label-column`` one name."""
        label = config.get("label-column", "label")
        if not isinstance(label, str) or not label.strip():
            raise ConfigError("node-config.label-column", f"expected a column's name, got {label!r}")
        given = config.get("feature-columns")
        if given is None:
            return cls(None, label.strip())
        names = tuple(n.strip() for n in (given.split(",") if isinstance(given, str) else map(str, given)))
        if not names or not all(names) or label.strip() in names:
            raise ConfigError(
                "node-config.feature-columns",
                f"expected column names separated by ',', none empty and not the label column, got {given!r}",
            )
        return cls(names, label.strip())


def read_partition(path: Path, columns: Columns) -> tuple[np.ndarray, np.ndarray, int | None]:
    """``x``, ``y`` and the number of classes (None where the partition declares none) of a partition in any of
    :data:`PARTITION_NAMES`' formats; a problem is a :class:`DataError` naming ``path``."""
    where = str(path)
    try:
        if path.is_dir():
            table, classes = _saved_dataset(path), _class_count(path / "dataset_info.json", columns.label)
        elif path.suffix == ".parquet":
            table, classes = pq.read_table(path), None
        else:
            table, classes = pa_csv.read_csv(path), None
    except (pa.ArrowException, OSError, ValueError) as exc:
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise DataError(where, f"not a readable partition ({why})") from None
    names = table.column_names
    if columns.label not in names:
        raise DataError(where, f"no label column {columns.label!r} (node config label-column); columns: {names}")
    wanted = columns.features or tuple(n for n in names if n != columns.label)
    missing = [n for n in wanted if n not in names]
    if missing or not wanted:
        raise DataError(
            where, f"no feature column {missing or '(none left)'} (node config feature-columns); columns: {names}"
        )
    parts = [_numbers(table.column(name), where, name) for name in wanted]
    x = parts[0] if len(parts) == 1 else np.concatenate([p.reshape(len(p), -1) for p in parts], axis=1)
    return x, _numbers(table.column(columns.label), where, columns.label), classes


def _saved_dataset(folder: Path) -> pa.Table:
    """The rows of a ``save_to_disk`` folder: its Arrow IPC stream files, in the order ``state.json`` gives."""
    state = folder / "state.json"
    files = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])] if state.is_file() else []
    paths = [folder / name for name in files] or sorted(folder.glob("data-*.arrow"))
    if not paths:
        raise ValueError("no data-*.arrow file: a folder written by Dataset.save_to_disk holds them")
    tables = []
    for path in paths:
        with pa.memory_map(str(path)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables)


def _class_count(info: Path, label: str) -> int | None:
    """The number of names of the label's ``ClassLabel`` in ``dataset_info.json`` (None where there is none)."""
    if not info.is_file():
        return None
    feature = json.loads(info.read_text()).get("features", {}).get(label, {})
    names = feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None
    return len(names) if isinstance(names, list) else None


def _numbers(column: pa.ChunkedArray, where: str, name: str) -> np.ndarray:
    """A column as a NumPy array, one row per sample (list columns: their values' shape per row); strings, bytes
    and rows of unequal lengths refused."""
    kind = column.type
    while pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        kind = kind.value_type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        raise DataError(where, f"column {name!r} holds {kind}, not numbers: decode it into numbers first")
    if column.null_count:
        raise DataError(where, f"column {name!r} has {column.null_count} missing value(s)")
    if kind == column.type:
        return column.to_numpy()
    try:
        return np.asarray(column.to_pylist(), dtype=kind.to_pandas_dtype())
    except ValueError:
        raise DataError(where, f"column {name!r} holds rows of different lengths") from None
