"""The comparison figure: mean over seeds (matched by round) with a band, one line per variant, one panel per metric."""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import metrics as metric_registry
from ..core.errors import ConfigError
from ..core.io import write_atomic
from .results import METRIC_LABELS, PLOT_LIMIT, check_metrics, read_metrics, x_axes


_SUPERSCRIPT = str.maketrans("0123456789-−", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁻")


def _plain_log_labels(axis: Any) -> None:
    """Log-axis tick labels (10⁻², 2×10⁻²) as plain text: parsed as mathtext, they take about a second per figure."""
    from matplotlib import ticker

    class Plain(ticker.LogFormatterSciNotation):
        def __call__(self, x: float, pos: int | None = None) -> str:
            label = super().__call__(x, pos)
            match = re.fullmatch(r"\$\\mathdefault\{(.*)\}\$", label)
            if not match:
                return label
            return re.sub(
                r"\^\{([^}]*)\}", lambda m: m.group(1).translate(_SUPERSCRIPT), match.group(1).replace("\\times", "×")
            )

    axis.set_major_formatter(Plain())
    axis.set_minor_formatter(Plain(labelOnlyBase=False))


def _aligned(runs: Sequence[dict[str, np.ndarray]], column: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    """x values and a (seeds, rounds) matrix of ``column`` at the rounds every run recorded.

    Seeds are matched by round, never by row; on an axis other than rounds, x is the mean over seeds
    of that axis at the round (epochs or bytes can differ between seeds).
    """
    common = runs[0]["round"]
    for t in runs[1:]:
        common = np.intersect1d(common, t["round"])
    common = np.unique(common)
    rows = []
    for t in runs:
        values, first = np.unique(t["round"], return_index=True)  # a round recorded twice counts once
        rows.append(first[np.searchsorted(values, common)])
    ys = np.stack([t[column][i] for t, i in zip(runs, rows)]) if len(common) else np.zeros((len(runs), 0))
    if x == "round":
        return common, ys
    xs = np.stack([(t["bytes_up"] + t["bytes_down"] if x == "bytes" else t[x])[i] for t, i in zip(runs, rows)])
    return xs.mean(axis=0), ys


#: dash patterns cycled with the ten colours (see :func:`line_style`)
LINE_STYLES = ("-", "--", "-.", ":")


def line_style(k: int) -> dict[str, str]:
    """Colour and dash pattern of the k-th line: colour k mod 10, pattern (k + ⌊k/10⌋) mod 4, so adjacent
    lines differ in both and no two of the first 40 lines look alike."""
    return {"color": f"C{k % 10}", "linestyle": LINE_STYLES[(k + k // 10) % len(LINE_STYLES)]}


def _tables(curves: Mapping[str, Sequence[Path]]) -> dict[str, list[dict[str, np.ndarray]]]:
    return {
        label: [t for t in (read_metrics(p) for p in paths if Path(p).exists()) if len(t["round"])]
        for label, paths in curves.items()
    }


def comparison_figure(
    curves: Mapping[str, Sequence[Path]],
    *,
    metric: str | Sequence[str],
    x: str = "round",
    log_y: bool = True,
    band: str = "std",
    title: str = "",
    require_data: bool = False,
    recorded_only: bool = False,
) -> Any:
    """The matplotlib figure of :func:`plot_comparison` (the caller closes it): one panel per metric, one
    line per curve in its own colour and dash pattern, and one legend for all panels, outside the axes.
    With ``recorded_only`` (a metric left at its default), metrics that no run recorded are left out, and
    the training loss is drawn when none is left."""
    metrics = check_metrics([metric] if isinstance(metric, str) else list(metric), "--metric")
    if x not in x_axes():
        raise ConfigError("--x", f"unknown axis {x!r}; accepted: {', '.join(x_axes())}")
    if band not in ("std", "minmax"):
        raise ConfigError("--band", f"unknown {band!r}; accepted: std, minmax")
    tables = _tables(curves)
    metrics = _drawn_metrics(metrics, tables, require_data=require_data, recorded_only=recorded_only)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max((len(label) for label in tables), default=0)
    legend_width = min(0.5 + 0.065 * longest, 5.0) if tables else 0.0
    fig, axes = plt.subplots(
        1, len(metrics), figsize=(5.6 * len(metrics) + legend_width, 4.2), layout="constrained", squeeze=False
    )
    handles: dict[str, Any] = {}
    for ax, name in zip(axes[0], metrics):
        _draw_panel(ax, name, tables, handles, x=x, log_y=log_y, band=band)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _recorded(name: str, tables: Mapping[str, list[dict[str, np.ndarray]]]) -> bool:
    """Whether any run of any curve recorded a finite value of the metric ``name``."""
    return any(np.isfinite(t[name]).any() for runs in tables.values() for t in runs)


def _drawn_metrics(
    metrics: list[str], tables: Mapping[str, list[dict[str, np.ndarray]]], *, require_data: bool, recorded_only: bool
) -> list[str]:
    """The metrics given a panel: with ``recorded_only``, those some run recorded (the training loss where none
    is); with ``require_data``, a metric no run recorded is an error naming those the runs recorded."""
    if recorded_only:
        metrics = [name for name in metrics if _recorded(name, tables)] or ["loss"]
    if require_data:
        scores = metric_registry.of_kind("model", "method")
        recorded = [name for name in scores if _recorded(name, tables)] or ["none of " + ", ".join(scores)]
        for name in metrics:
            if not _recorded(name, tables):
                raise ConfigError(
                    "--metric",
                    f"no run recorded {name!r} (e.g. f_gap and dist_sq need a problem with a known optimum); the "
                    f"runs recorded: {', '.join(recorded)}",
                )
    return metrics


def _draw_panel(
    ax: Any,
    name: str,
    tables: Mapping[str, list[dict[str, np.ndarray]]],
    handles: dict[str, Any],
    *,
    x: str,
    log_y: bool,
    band: str,
) -> None:
    """The panel of the metric ``name``: per curve the mean over its seeds against ``x``, with a band where it has
    more than one seed; each curve's first line goes to ``handles`` (label → line) for the legend."""
    plotted = False
    for k, (label, runs) in enumerate(tables.items()):
        if not runs:
            continue
        xs, ys = _aligned(runs, name, x)
        ys = np.where(
            np.isfinite(ys) & (np.abs(ys) < PLOT_LIMIT), ys, np.nan
        )  # a diverging seed ends its line instead of breaking the axis
        if not ys.size or np.all(np.isnan(ys)):
            continue
        with warnings.catch_warnings():  # columns where every seed has stopped are NaN, on purpose
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, spread, lowest = np.nanmean(ys, axis=0), np.nanstd(ys, axis=0), np.nanmin(ys, axis=0)
            lo, hi = (mean - spread, mean + spread) if band == "std" else (lowest, np.nanmax(ys, axis=0))
        (line,) = ax.plot(xs, mean, label=label or name, linewidth=1.6, **line_style(k))
        handles.setdefault(label or name, line)
        if len(runs) > 1:
            lo = (
                np.maximum(lo, lowest) if log_y else lo
            )  # a std band must not reach below the lowest seed on a log axis
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        plotted = True
    if log_y and plotted:
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)
    ax.set_xlabel(METRIC_LABELS.get(x, x))
    ax.set_ylabel(METRIC_LABELS.get(name, name))
    ax.grid(alpha=0.3)


def plot_comparison(
    curves: Mapping[str, Sequence[Path]],
    out_stem: Path,
    *,
    metric: str | Sequence[str],
    x: str = "round",
    log_y: bool = True,
    band: str = "std",
    title: str = "",
    require_data: bool = False,
    recorded_only: bool = False,
) -> list[Path]:
    """Mean over seeds with a std or min–max band, one line per variant, one panel per metric; PNG and PDF.

    With ``require_data``, a metric that no run recorded is an error naming the metrics they did record.
    """
    fig = comparison_figure(
        curves,
        metric=metric,
        x=x,
        log_y=log_y,
        band=band,
        title=title,
        require_data=require_data,
        recorded_only=recorded_only,
    )
    import matplotlib.pyplot as plt

    out = [out_stem.with_suffix(".png"), out_stem.with_suffix(".pdf")]
    try:
        for path in out:
            buf = io.BytesIO()
            try:
                fig.savefig(buf, format=path.suffix[1:], dpi=130)
            except ValueError as exc:  # matplotlib's mathtext parser rejects a '$...$' it cannot typeset
                reason = " ".join(str(exc).split())
                raise ConfigError(
                    "plot",
                    f"a title or variant label is not valid matplotlib math text ({reason}); write a literal dollar "
                    "sign as '\\$'",
                ) from None
            write_atomic(path, buf.getvalue())
    finally:
        plt.close(fig)
    return out
