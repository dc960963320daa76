"""Commands that run experiments: ``run`` and ``sweep``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from fedshuffle.core.errors import ClusterError, ConfigError, ResultsError
from fedshuffle.core.io import read_text
from fedshuffle.cli.output import mean_std, print_table
from fedshuffle.cli.common import (
    DEFAULT_PRESET,
    EXIT_STATUS,
    PluginsOption,
    app,
    console,
    fail,
    fail_cluster,
    fail_results,
    interrupted,
    load_config,
    note,
    resume_command,
)


def _print_summary(summary: dict, title: str) -> None:
    from fedshuffle.experiments.report import SUMMARY_METRICS

    metrics = [m for m in SUMMARY_METRICS if any(m in v["final"] for v in summary["variants"].values())]
    rows = []
    for label, v in summary["variants"].items():
        cells = [
            mean_std(v["final"][m]["mean"], v["final"][m]["std"], v["final"][m]["n"]) if m in v["final"] else ""
            for m in metrics
        ]
        rows.append((label, *cells, ", ".join(sorted(set(v["status"])))))
    print_table(
        title, ("variant", *(f"final {m}" for m in metrics), "status"), rows, right={f"final {m}" for m in metrics}
    )


def _arguments(
    config: str,
    out: str | None,
    set_: list[str] | None,
    seeds: str | None,
    extend_to: int | None,
    variants: list[str] | None = None,
) -> tuple[Any, Path | None, dict, list[int] | None]:
    """What ``run`` and ``sweep`` read alike: the experiment (only ``variants`` when given), the ``--out`` folder (None:
    the
    default), the overrides and the seeds."""
    from fedshuffle.experiments.session import (
        check_out,
        extend_rounds,
        normalize_overrides,
        only_variants,
        requested_seeds,
    )

    out_dir = check_out(out)
    experiment = only_variants(load_config(config), variants)
    overrides = normalize_overrides(set_ or [])
    seed_list = requested_seeds(seeds, overrides)
    extend_rounds(extend_to, overrides)
    return experiment, out_dir, overrides, seed_list


def _operator_threads(outcomes) -> list[str]:
    """What the runs chose (``operator_threads`` in each run's config.json), each choice once."""
    chosen = set()
    for outcome in outcomes:
        try:
            threads = json.loads(read_text(outcome.job.run_dir / "config.json"))["operator_threads"]
            chosen.add(f"{threads['count']} ({threads['reason']})")
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a run that failed before writing its config, or one written before the choice was recorded
    return sorted(chosen)


@app.command(
    help=f"""Run a preset or config file (every variant and seed), write results and a plot.

    A new run goes into --out (default results/NAME); an --out that already holds results is left
    alone and the run goes into NAME-2 (a note says so). --resume DIR continues the runs of DIR; it
    refuses a config whose settings differ from those DIR was run with (naming them), and a different
    run.rounds unless --extend-to N: then finished runs continue to N rounds, with the numbers of
    runs asked for N rounds from the start. --set run.seed=S runs seed S alone, as --seeds S.

    {EXIT_STATUS}"""
)
def run(
    config: Annotated[str, typer.Argument(help="preset name or TOML file")] = DEFAULT_PRESET,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override, e.g. --set local.lr=0.01")] = None,
    out: Annotated[
        Optional[str],
        typer.Option(help="results folder (default: results/<name>); an existing one is kept and NAME-2 used"),
    ] = None,
    resume: Annotated[
        Optional[Path], typer.Option(help="continue the runs of this results folder from their checkpoints")
    ] = None,
    seeds: Annotated[Optional[str], typer.Option(help="seeds: a..b or a,b,c (default: the config's)")] = None,
    extend_to: Annotated[
        Optional[int], typer.Option("--extend-to", help="with --resume: continue the runs to this many rounds")
    ] = None,
    workers: Annotated[int, typer.Option(help="runs in parallel worker processes")] = 1,
    variant: Annotated[
        Optional[list[str]],
        typer.Option(help="only these variants (repeat; default all), e.g. to --set what the variants set themselves"),
    ] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
    plugins_: PluginsOption = None,
) -> None:
    from fedshuffle.experiments.session import pick_folder, resume_folder, run_experiment

    target: Path | None = None
    try:
        experiment, out_dir, overrides, seed_list = _arguments(config, out, set_, seeds, extend_to, variant)
        if extend_to is not None and resume is None:
            raise ConfigError("--extend-to", "extends the runs of a results folder: give the folder with --resume DIR")
        if resume is not None:
            if out_dir is not None and out_dir != resume:
                raise ConfigError(
                    "--resume",
                    "give the folder to continue either as --resume DIR or as --out, not two different folders",
                )
            target, moved = resume_folder(resume), ""
        else:
            requested = out_dir or Path("results") / experiment.experiment.name
            target, moved = pick_folder(requested, f"--resume {requested}")

        def opened(folder) -> None:
            if moved:
                note(moved)
            if resume is not None:
                note(f"continuing {len(folder.jobs)} runs in {target} ({folder.finished} already finished)")

        summary, outcomes = run_experiment(
            experiment,
            target,
            overrides=overrides,
            seeds=seed_list,
            resume=resume is not None,
            extend=extend_to is not None,
            show_progress=not quiet,
            workers=workers,
            on_open=opened,
        )
    except ConfigError as exc:
        fail(exc)
    except ResultsError as exc:
        fail_results(
            exc,
            f"continue with: {resume_command('run', config, set_, seeds, extend_to, target)}"
            if target is not None and target.is_dir()
            else "",
        )
    except ClusterError as exc:
        hint = f"continue with: {resume_command('run', config, set_, seeds, extend_to, target)}"
        fail_cluster(exc, hint if target is not None and target.is_dir() else "")
    except KeyboardInterrupt:
        written = target is not None and target.is_dir()
        interrupted(f"continue with: {resume_command('run', config, set_, seeds, extend_to, target)}", written)
    _print_summary(summary, experiment.experiment.title or experiment.experiment.name)
    for chosen in _operator_threads(outcomes):
        console.print(f"operator threads per run: {chosen}", highlight=False, soft_wrap=True)
    console.print(f"results: {target}/ (plot: {target / 'plot.png'})")
    if any(o.status != "complete" for o in outcomes):
        raise typer.Exit(3)


@app.command(
    help=f"""Every grid point × variant × seed, in parallel, each in its own folder; optionally pick the best point.

    Started again with the same config and --set, a sweep keeps its finished runs and continues the
    others (other grid points, seeds and --variant may be added); another config, or other settings
    for a run it holds, is refused, naming the settings that differ. --extend-to N continues its runs to N rounds.

    {EXIT_STATUS}"""
)
def sweep(
    config: Annotated[str, typer.Argument(help="preset name or TOML file")],
    grid: Annotated[
        Optional[list[str]],
        typer.Option(help="section.setting=v1,v2,... (repeat for more axes; every combination runs)"),
    ] = None,
    seeds: Annotated[Optional[str], typer.Option(help="seeds: a..b or a,b,c (default: the config's)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override applied to every point")] = None,
    out: Annotated[
        Optional[str],
        typer.Option(help="results folder (default: results/<name>-sweep); started again, finished runs are kept"),
    ] = None,
    workers: Annotated[int, typer.Option(help="runs in parallel worker processes", show_default="one per core")] = max(
        1, (os.cpu_count() or 1)
    ),
    pick: Annotated[
        Optional[str],
        typer.Option(help="choose the best point per variant by this final metric (min; max for accuracies)"),
    ] = None,
    variant: Annotated[
        Optional[list[str]],
        typer.Option(help="only these variants (repeat; default all), e.g. to grid a method's own settings"),
    ] = None,
    extend_to: Annotated[
        Optional[int], typer.Option("--extend-to", help="continue the sweep's runs to this many rounds")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
    plugins_: PluginsOption = None,
) -> None:
    target, record, outcomes = _run_sweep(
        config,
        grid,
        seeds,
        set_,
        out,
        workers=workers,
        pick=pick,
        variant=variant,
        extend_to=extend_to,
        quiet=quiet,
    )
    console.print(f"{record['runs']} runs in {target}/: " + ", ".join(f"{n} {s}" for s, n in record["status"].items()))
    if pick:
        _print_best(record, pick)
    if any(o.status != "complete" for o in outcomes):
        raise typer.Exit(3)


def _run_sweep(
    config: str,
    grid: list[str] | None,
    seeds: str | None,
    set_: list[str] | None,
    out: str | None,
    *,
    workers: int,
    pick: str | None,
    variant: list[str] | None,
    extend_to: int | None,
    quiet: bool,
) -> tuple[Path, dict, list]:
    """``sweep``'s options run (:func:`~fedshuffle.experiments.session.run_sweep`): (its folder, its record, the runs'
    outcomes); an error, or an interruption, ends the command with its exit status."""
    from fedshuffle.experiments.results import check_metrics
    from fedshuffle.experiments.session import run_sweep
    from fedshuffle.experiments.sweep import parse_grid

    target: Path | None = None
    try:
        if pick is not None:
            check_metrics([pick], "--pick")
        experiment, out_dir, overrides, seed_list = _arguments(config, out, set_, seeds, extend_to)
        points = parse_grid(grid or [])
        target = out_dir or Path("results") / f"{experiment.experiment.name}-sweep"
        existed = target.is_dir() and any(target.iterdir())

        def opened(folder) -> None:
            if existed:
                note(
                    f"{target} already holds a sweep of this config: {folder.finished} of its {len(folder.jobs)} "
                    "runs are finished and kept, the others run now"
                )

        record, outcomes = run_sweep(
            experiment,
            target,
            points,
            seeds=seed_list,
            overrides=overrides,
            variants=variant,
            pick=pick,
            extend=extend_to is not None,
            workers=workers,
            show_progress=not quiet,
            record={"config": config, "grid": grid or []},
            on_open=opened,
        )
    except ConfigError as exc:
        fail(exc)
    except ResultsError as exc:
        fail_results(exc, _again(target))
    except ClusterError as exc:
        fail_cluster(exc, _again(target))
    except KeyboardInterrupt:
        interrupted(_again(target), written=target is not None and target.is_dir())
    return target, record, outcomes


def _again(target: Path | None) -> str:
    """How to continue a sweep that stopped with its folder ``target`` written ("" where nothing was)."""
    if target is not None and target.is_dir():
        return (
            "run the same sweep command again to continue: finished runs are kept, the others resume from their "
            "checkpoints"
        )
    return ""


def _print_best(record: dict, pick: str) -> None:
    """The best point of each variant by the final ``pick`` (a table), and a note for each best point at the edge of
    its grid."""
    rows = [
        (
            label,
            _point(b["point"]),
            "—" if b["mean"] is None else f"{b['mean']:.4g}",
            "—" if b["std"] is None else f"{b['std']:.2g}",
            str(b["candidates"]),
        )
        for label, b in record["best"].items()
    ]
    print_table(
        f"best point per variant by final {pick}",
        ("variant", "point", f"mean {pick}", "std", "points tried"),
        rows,
        right=(f"mean {pick}", "std", "points tried"),
    )
    for label, b in record["best"].items():
        if b.get("at_edge"):
            note(
                f"{label or 'run'}: the best {', '.join(b['at_edge'])} is at the edge of the grid; the optimum "
                "may lie beyond it, widen the grid there"
            )


def _point(point: dict | None) -> str:
    from fedshuffle.experiments.report import point_text

    return "none converged" if point is None else (point_text(point) or "base")
