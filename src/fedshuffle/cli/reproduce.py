"""``fedshuffle reproduce``: run presets and check every claim of their papers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from fedshuffle.core.errors import ClusterError, ConfigError, ResultsError
from fedshuffle.cli.common import (
    EXIT_STATUS,
    PluginsOption,
    app,
    console,
    err,
    fail,
    fail_cluster,
    fail_results,
    interrupted,
    note,
)
from fedshuffle.cli.output import print_table


@app.command(
    help=f"""Run presets or experiment files (what is missing) and judge every claim; write report.md and report.html.

    Each preset, or TOML file with its own claims tables, runs into OUT/NAME (default OUT:
    results/reproduce); runs already there are kept and continued, a folder holding another experiment
    is refused. A variant with a tuning protocol (tune = {{grid, metric, at, seeds}}) first runs its grid
    on the tuning seeds into OUT/NAME.tuning/, and is judged at the selected point on the experiment's
    seeds. Every claim (an ordering of variants, a value within a tolerance, a target reached first or
    at a cost) gets a verdict over the seeds: holds (means more than k standard errors apart), partly
    (in the claimed order but closer), does not hold, or not measured (no value, or a target no arm
    reached). Only primary claims enter a paper's totals; proxy, extrapolation, duplicate and post-hoc
    claims are counted beside them. The verdicts join those already in OUT (OUT/verdicts.json), so
    the report shows every preset judged there. --budget cpu skips the presets sized for a GPU, saying so.

    {EXIT_STATUS}"""
)
def reproduce(
    presets: Annotated[Optional[list[str]], typer.Argument(help="preset names or TOML files")] = None,
    all_: Annotated[bool, typer.Option("--all", help="every shipped preset")] = False,
    budget: Annotated[
        Optional[str], typer.Option(help="cpu: skip the presets sized for a GPU; gpu: run every preset")
    ] = None,
    out: Annotated[
        Optional[str], typer.Option(help="folder of the runs and the report (default: results/reproduce)")
    ] = None,
    workers: Annotated[
        int, typer.Option(help="worker processes for each preset's runs and tuning grid (default: one per core)")
    ] = max(1, os.cpu_count() or 1),
    no_run: Annotated[
        bool, typer.Option("--no-run", help="run nothing: judge the complete runs already in OUT")
    ] = False,
    json_: Annotated[
        bool,
        typer.Option(
            "--json",
            help='print {"claims": [{"preset", "claim", "role", "measured", "verdict", "fractions", ...}], "counts" '
            '(primary claims), "other_roles"}',
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
    smoke: Annotated[
        bool,
        typer.Option(
            "--smoke",
            help="instead: build and run each preset of --budget (default gpu) for two rounds at its real model and "
            "data shapes on this CPU; exit 3 naming any that fails",
        ),
    ] = False,
    plugins_: PluginsOption = None,
) -> None:
    from fedshuffle.experiments.reproduce import as_json

    if smoke:
        _smoke(presets, budget, json_)
        return
    target, rows = _judge(
        presets, all_, budget, out, workers=workers, run=not no_run, show_progress=not (quiet or json_), json_=json_
    )
    if json_:
        print(json.dumps(as_json(rows), indent=1, ensure_ascii=False))
        return
    _print_claims(rows)
    console.print(f"report: {target / 'report.md'}, {target / 'report.html'}")


def _smoke(presets: list[str] | None, budget: str | None, json_: bool) -> None:
    """``reproduce --smoke``: each preset of ``budget`` (default gpu) built and run for two rounds; the results printed
    (as JSON with ``json_``), exit status 3 naming any that failed."""
    from fedshuffle.experiments.smoke import smoke as run_smoke, summary

    try:
        results = run_smoke(presets or [], budget or "gpu", note=None if json_ else note)
    except ConfigError as exc:
        fail(exc)
    print(json.dumps([vars(r) for r in results], indent=1, ensure_ascii=False) if json_ else summary(results))
    if failed := [r for r in results if r.status != "ok"]:
        err.print(
            f"[red]error:[/red] smoke run failed for {', '.join(r.preset for r in failed)}: {failed[0].error}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(3)


def _judge(
    presets: list[str] | None,
    all_: bool,
    budget: str | None,
    out: str | None,
    *,
    workers: int,
    run: bool,
    show_progress: bool,
    json_: bool,
) -> tuple[Path, list]:
    """The presets (or every one, ``all_``) run where runs are missing and their claims judged
    (:func:`fedshuffle.experiments.reproduce.reproduce`): (the folder, the verdict rows); an error, or an
    interruption, ends the command with its exit status."""
    from fedshuffle.experiments.reproduce import reproduce as run_all
    from fedshuffle.experiments.schema import preset_names
    from fedshuffle.experiments.session import check_out

    target = Path("results") / "reproduce"
    try:
        if all_ and presets:
            raise ConfigError("--all", "give preset names or --all, not both")
        target = check_out(out) or target
        names = preset_names() if all_ else list(presets or [])
        rows = run_all(
            names,
            target,
            budget=budget,
            run=run,
            show_progress=show_progress,
            note=None if json_ else note,
            workers=workers,
        )
    except ConfigError as exc:
        fail(exc)
    except ResultsError as exc:
        fail_results(exc, "run the same command again to continue: finished runs are kept")
    except ClusterError as exc:
        fail_cluster(exc, "run the same command again to continue: finished runs are kept")
    except KeyboardInterrupt:
        interrupted("run the same command again to continue: finished runs are kept")
    return target, rows


def _print_claims(rows: list) -> None:
    """The verdict of every claim, as a table (a verdict coloured by what it says)."""
    colour = {"holds": "green", "partly": "yellow", "does not hold": "red"}
    print_table(
        "claims",
        ("preset", "role", "figure", "claim", "measured", "verdict"),
        [
            (
                r.preset,
                r.role,
                r.figure,
                r.claim,
                r.measured,
                Text.assemble((r.verdict, colour.get(r.verdict, "dim")), f": {r.why}"),
            )
            for r in rows
        ],
    )
