"""Results on disk: atomic writes, metric tables, and the comparison plot."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

METRIC_COLUMNS = (
    "round", "sample_gradients", "epochs", "bytes_up", "bytes_down",
    "loss", "f_gap", "dist_sq", "grad_norm_sq", "train_accuracy", "test_loss", "test_accuracy", "prox_residual",
)

PLOT_LIMIT = 1e100  # values beyond this (a run blowing up) are not drawn

INTEGER_COLUMNS = ("round", "sample_gradients", "bytes_up", "bytes_down")

METRIC_LABELS = {
    "loss": "f(x)", "f_gap": "f(x) − f*", "dist_sq": "‖x − x*‖²", "grad_norm_sq": "‖∇f(x)‖²",
    "train_accuracy": "train accuracy", "prox_residual": "mean prox residual", "test_accuracy": "test accuracy", "test_loss": "test loss",
    "round": "communication rounds", "epochs": "epochs of data", "sample_gradients": "gradient evaluations",
    "bytes": "bytes communicated (up + down)",
}


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def write_metrics(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=METRIC_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else repr(row[k]) if isinstance(row[k], float) else row[k]) for k in METRIC_COLUMNS})
    write_atomic(path, buf.getvalue())


def write_parquet(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """The metric rows as a Parquet table (columns of :data:`METRIC_COLUMNS`, nulls where missing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({col: pa.array([row.get(col) for row in rows], type=pa.int64() if col in INTEGER_COLUMNS else pa.float64()) for col in METRIC_COLUMNS})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    write_atomic(path, buf.getvalue().to_pybytes())


def read_metrics(path: Path) -> dict[str, np.ndarray]:
    """Columns of a ``metrics.csv`` as float arrays (NaN where a value is missing)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {col: np.array([float(r[col]) if r.get(col) not in (None, "") else np.nan for r in rows]) for col in METRIC_COLUMNS}


def plot_comparison(
    curves: Mapping[str, Sequence[Path]], out_stem: Path, *, metric: str | Sequence[str], x: str = "round", log_y: bool = True, band: str = "std", title: str = ""
) -> list[Path]:
    """Mean over seeds with a std or min–max band, one line per variant, one panel per metric; PNG and PDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [metric] if isinstance(metric, str) else list(metric)
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.4 * len(metrics), 4.2), constrained_layout=True, squeeze=False)
    tables = {label: [t for t in (read_metrics(p) for p in paths if Path(p).exists()) if len(t["round"])] for label, paths in curves.items()}
    for ax, name in zip(axes[0], metrics):
        plotted = False
        for label, runs in tables.items():
            if not runs:
                continue
            length = min(len(t["round"]) for t in runs)
            xs = runs[0]["bytes_up"][:length] + runs[0]["bytes_down"][:length] if x == "bytes" else runs[0][x][:length]
            ys = np.stack([t[name][:length] for t in runs])
            ys = np.where(np.isfinite(ys) & (np.abs(ys) < PLOT_LIMIT), ys, np.nan)  # a diverging seed ends its line instead of breaking the axis
            if np.all(np.isnan(ys)):
                continue
            with warnings.catch_warnings():  # columns where every seed has stopped are NaN, on purpose
                warnings.simplefilter("ignore", RuntimeWarning)
                mean, spread, lowest = np.nanmean(ys, axis=0), np.nanstd(ys, axis=0), np.nanmin(ys, axis=0)
                lo, hi = (mean - spread, mean + spread) if band == "std" else (lowest, np.nanmax(ys, axis=0))
            (line,) = ax.plot(xs, mean, label=label or name)
            if len(runs) > 1:
                lo = np.maximum(lo, lowest) if log_y else lo  # a std band must not reach below the lowest seed on a log axis
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            plotted = True
        if log_y and plotted:
            ax.set_yscale("log")
        ax.set_xlabel(METRIC_LABELS.get(x, x))
        ax.set_ylabel(METRIC_LABELS.get(name, name))
        if plotted:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    out = [out_stem.with_suffix(".png"), out_stem.with_suffix(".pdf")]
    for path in out:
        buf = io.BytesIO()
        fig.savefig(buf, format=path.suffix[1:], dpi=130)
        write_atomic(path, buf.getvalue())
    plt.close(fig)
    return out


def summarize(values: Iterable[float]) -> dict[str, float]:
    arr = np.array([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {"mean": float(np.mean(arr)), "std": float(np.std(arr)), "n": int(arr.size)}
