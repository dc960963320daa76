"""Results on disk: metric tables (CSV, Parquet) and summaries over seeds."""

from __future__ import annotations

import csv
import errno
import io
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedshuffle import metrics
from fedshuffle.core.errors import ConfigError, did_you_mean
from fedshuffle.core.io import open_regular, read_text, write_atomic

import numpy as np

#: columns of ``metrics.csv`` (deterministic) and ``timing.csv`` (measured), in declaration order
METRIC_COLUMNS = metrics.names()
TIMING_COLUMNS = ("round", *metrics.names(measured=True))

PLOT_LIMIT = 1e100  # values beyond this (a run blowing up) are not drawn

INTEGER_COLUMNS = tuple(e.name for e in metrics.METRICS.entries() if e.defaults["integer"])

METRIC_LABELS = {**{e.name: e.summary for e in metrics.METRICS.entries()}, "bytes": "bytes communicated (up + down)"}


def _csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], header: bool) -> str:
    """Rows as CSV text: empty cells where a metric does not apply, floats written exactly (``repr``)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow(
            {k: ("" if row.get(k) is None else repr(row[k]) if isinstance(row[k], float) else row[k]) for k in columns}
        )
    return buf.getvalue()


def write_metrics(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] = METRIC_COLUMNS) -> None:
    """One CSV row per evaluation (empty cells where a metric does not apply; floats written exactly)."""
    write_atomic(path, _csv_text(rows, columns, header=True))


class AppendedTable:
    """A metric table that grows by whole rows, for a run in progress.

    Opening rewrites the file atomically with the header and ``rows`` (a resumed run's rows up to its
    checkpoint: anything appended after the checkpoint is dropped). :meth:`append` then adds one row
    with a single ``write`` to the end of the file, so a process killed at any moment leaves whole rows;
    a short write (a full disk, a file-size limit) is cut back to the last whole row and raised. Nothing
    is fsynced before :meth:`sync`: a resumed run rewrites the table from its checkpoint, so only the
    finished table (the one ``summary.json`` seals) needs to reach the disk. The bytes are those of
    :func:`write_metrics` for the same rows.
    """

    def __init__(self, path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] = METRIC_COLUMNS) -> None:
        self.path, self.columns = Path(path), tuple(columns)
        write_metrics(self.path, rows, self.columns)
        self.fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND)  # never through a link put there meanwhile

    def append(self, row: Mapping[str, Any]) -> None:
        line = _csv_text([row], self.columns, header=False).encode()
        size = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, line)
        except OSError:
            os.ftruncate(self.fd, size)
            raise
        if written != len(line):
            os.ftruncate(self.fd, size)
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(self.path))

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def write_parquet(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """The metric rows as a Parquet table (columns of :data:`METRIC_COLUMNS`, nulls where missing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            col: pa.array([row.get(col) for row in rows], type=pa.int64() if col in INTEGER_COLUMNS else pa.float64())
            for col in METRIC_COLUMNS
        }
    )
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    write_atomic(path, buf.getvalue().to_pybytes())


def x_axes() -> tuple[str, ...]:
    """What can be an x axis: the declared costs, and ``bytes`` (up + down)."""
    return (*metrics.of_kind("cost"), "bytes")


def check_metrics(names: Sequence[str], option: str) -> list[str]:
    """The metric names (any declared in :mod:`fedshuffle.metrics`), refused up front when unknown or none."""
    names, accepted = list(names), metrics.METRICS.names()
    if not names:
        raise ConfigError(option, f"give at least one metric; accepted: {', '.join(accepted)}")
    for m in names:
        if m not in accepted:
            raise ConfigError(
                option, f"unknown metric {m!r}{did_you_mean(m, accepted)}; accepted: {', '.join(accepted)}"
            )
    return names


def read_metrics(path: Path) -> dict[str, np.ndarray]:
    """Columns of a ``metrics.csv`` (and of the ``timing.csv`` beside it) as float arrays (NaN where a value is
    missing);
    a damaged table (or a link, FIFO or device in its place) is an error naming it."""
    timing = Path(path).with_name("timing.csv")
    try:
        rows = list(csv.DictReader(io.StringIO(read_text(path), newline="")))
        if rows and "round" not in rows[0]:
            raise ValueError("no 'round' column")
        if timing.exists():
            measured = {
                int(float(r["round"])): r
                for r in csv.DictReader(io.StringIO(read_text(timing), newline=""))
                if r.get("round")
            }
            rows = [{**measured.get(int(float(r["round"])), {}), **r} for r in rows]
        table = {
            col: np.array([float(r[col]) if r.get(col) not in (None, "") else np.nan for r in rows], dtype=np.float64)
            for col in (*METRIC_COLUMNS, *TIMING_COLUMNS[1:])
        }
    except (OSError, csv.Error, ValueError, TypeError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), f"unreadable metrics table ({exc.__class__.__name__}: {exc})") from None
    if not np.all(np.isfinite(table["round"])):
        raise ConfigError(str(path), "unreadable metrics table (a row without its round)")
    return table


def summarize(values: Iterable[float]) -> dict[str, float]:
    arr = np.array([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {"mean": float(np.mean(arr)), "std": float(np.std(arr)), "n": int(arr.size)}
