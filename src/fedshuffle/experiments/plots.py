"""The comparison figure: mean over seeds with a band, one line per variant, one panel per metric."""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..core.io import write_atomic
from .results import METRIC_LABELS, PLOT_LIMIT, read_metrics


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
