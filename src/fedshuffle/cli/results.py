"""Commands that read results folders back: ``plot`` and ``table``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.cli.common import app, console, err, fail, fail_results, note
from fedshuffle.cli.output import print_table

ALLOW_UNSEALED = (
    "also show runs whose metrics.csv changed after they finished, or whose summary.json holds no SHA-256 of their "
    "files "
    "(a warning names each; default: refused)"
)


def _warn(text: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {text}", highlight=False, soft_wrap=True)


@app.command()
def plot(
    paths: Annotated[list[Path], typer.Argument(help="run, experiment or sweep folders")],
    metric: Annotated[
        Optional[list[str]], typer.Option(help="metric(s), one panel each (default: the config's)")
    ] = None,
    x: Annotated[
        Optional[str],
        typer.Option(
            help="a cost metric (round, epochs, sample_gradients, mib_up, ...) or bytes (default: the config's)"
        ),
    ] = None,
    band: Annotated[str, typer.Option(help="std or minmax over seeds")] = "std",
    linear: Annotated[bool, typer.Option(help="linear y axis (default: log)")] = False,
    out: Annotated[
        Optional[str],
        typer.Option(
            help="output path without suffix (default: <first folder>/plot-METRIC-by-X, never the run's own plot)"
        ),
    ] = None,
    title: Annotated[
        Optional[str], typer.Option(help="figure title (default: the experiment's title, as run draws it)")
    ] = None,
    all_points: Annotated[
        bool,
        typer.Option(
            "--all-points",
            help="every grid point of a sweep (default: the best point per variant by the first metric's final value)",
        ),
    ] = False,
    allow_unsealed: Annotated[bool, typer.Option("--allow-unsealed", help=ALLOW_UNSEALED)] = False,
) -> None:
    """Mean and band over seeds of every variant found under PATHS; PNG and PDF, written beside the run's own plot
    (FOLDER/plot-METRIC-by-X.png, or --out), titled as run titles it.

    Runs are grouped by experiment folder, variant and grid point (two folders sharing a label are two
    lines, named by folder), and seeds are matched by round. Of a sweep, each variant's best grid point
    is drawn (lowest mean final value of the first metric over seeds; highest for accuracies), every
    point with --all-points. A run whose files changed after it finished (or whose summary holds no
    SHA-256 of them) is refused unless --allow-unsealed. Exit status 2 for bad input or a damaged
    results file, 4 when the figure cannot be written.
    """
    from fedshuffle.experiments.report import best_point_runs, collect_runs, group_runs, plot_defaults, plot_runs
    from fedshuffle.experiments.results import check_metrics, x_axes
    from fedshuffle.experiments.session import check_out, figure_title

    out_stem: Path | None = None
    try:
        if metric is not None:
            check_metrics(metric, "--metric")
        if x is not None and x not in x_axes():
            raise ConfigError("--x", f"unknown axis {x!r}; accepted: {', '.join(x_axes())}")
        if band not in ("std", "minmax"):
            raise ConfigError("--band", f"unknown {band!r}; accepted: std, minmax")
        out_stem = check_out(out)
        runs = collect_runs(paths, allow_unsealed=allow_unsealed, warn=_warn)
        defaults = plot_defaults(runs[0])
        axis = x or defaults.get("x", "round")
        if axis not in x_axes():
            raise ConfigError("--x", f"unknown axis {axis!r}; accepted: {', '.join(x_axes())}")
        metrics = metric or defaults["metric"]
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        points = len({json.dumps(r.point, sort_keys=True) for r in runs})
        if points > 1 and not all_points:
            runs = best_point_runs(runs, metrics[0])
            note(f"the best of {points} grid points per variant by final {metrics[0]} (--all-points for every point)")
        out_stem = out_stem or paths[0] / f"plot-{'-'.join(metrics)}-by-{axis}"
        files = plot_runs(
            group_runs(runs),
            out_stem,
            metric=metrics,
            x=axis,
            band=band,
            log_y=not linear,
            title=figure_title(runs) if title is None else title,
            require_data=True,
        )
    except ConfigError as exc:
        fail(exc)
    except OSError as exc:
        fail_results(ResultsError(f"cannot write the figure to {out_stem or paths[0]} ({exc.strerror or exc})"))
    console.print("wrote " + ", ".join(map(str, files)))


@app.command("table")
def table_command(
    paths: Annotated[list[Path], typer.Argument(help="run, experiment or sweep folders")],
    metric: Annotated[
        Optional[list[str]], typer.Option(help="metric(s) (default: f_gap, dist_sq, loss, accuracies where present)")
    ] = None,
    stat: Annotated[str, typer.Option(help="final value, or best value along the run")] = "final",
    target: Annotated[
        Optional[list[str]],
        typer.Option(
            help="METRIC=VALUE: rounds, MiB per worker and wall-clock until the metric first reaches VALUE (Yang et "
            "al.'s Table 2)"
        ),
    ] = None,
    allow_unsealed: Annotated[bool, typer.Option("--allow-unsealed", help=ALLOW_UNSEALED)] = False,
) -> None:
    """Final (or best) values: mean ± std over seeds per experiment folder, variant and grid point (a rich table on a
    terminal, Markdown in a pipe or a file); with --target, the cost of reaching a value instead."""
    from fedshuffle.experiments.report import SUMMARY_METRICS, collect_runs, group_runs, summary_table
    from fedshuffle.experiments.results import check_metrics
    from fedshuffle.experiments.targets import Target, target_table

    try:
        if metric is not None:
            check_metrics(metric, "--metric")
        if stat not in ("final", "best"):
            raise ConfigError("--stat", f"unknown {stat!r}; accepted: final, best")
        targets = [Target.parse(t) for t in target or []]
        runs = collect_runs(paths, allow_unsealed=allow_unsealed, warn=_warn)
        groups = group_runs(runs)
        if targets:
            for t in targets:
                columns, rows = target_table(
                    {name: [r.path / "metrics.csv" for r in members] for name, members in groups.items()}, t
                )
                print_table("", columns, rows, right=columns[1:-1])
            return
        metrics = metric or [m for m in SUMMARY_METRICS if any(r.final.get(m) is not None for r in runs)] or ["loss"]
        columns, rows = summary_table(groups, metrics, stat)
        print_table("", columns, rows, right=columns[1:-1])
    except ConfigError as exc:
        fail(exc)
