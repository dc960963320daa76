"""Commands that show what there is: ``presets``, ``show`` (configs and registered parts) and ``data``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import write_json
from fedshuffle.cli.common import app, console, fail, fail_results, load_config, note, PluginsOption
from fedshuffle.cli.output import print_table


@app.command("data")
def data_command(
    config: Annotated[str, typer.Argument(help="preset name or TOML file")],
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="override, e.g. --set data.labels_per_client=5")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print one JSON object (per client: size and label_counts)")
    ] = False,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="folder for label_heatmap.png and data_summary.json "
            "(default: results/<name>-data); one that holds anything is kept "
            "and NAME-2 used"
        ),
    ] = None,
    plugins_: PluginsOption = None,
) -> None:
    """Summarize the federated training data of a config (its first variant), after partitioning, and draw a
    per-client label heatmap.

    As run does, a folder that already holds anything is left alone: the files go into the first free FOLDER-2,
    FOLDER-3, ... (a note says so)."""
    from fedshuffle.data.summary import plot_label_heatmap, summarize
    from fedshuffle.experiments.schema import load_experiment, parse_overrides
    from fedshuffle.experiments.session import check_out, pick_folder

    try:
        experiment = load_experiment(config)
        spec = experiment.runs(parse_overrides(set_ or []))[0][1]
        requested = check_out(out) or Path("results") / f"{experiment.experiment.name}-data"
        summary = summarize(spec.data.model_dump(), spec.run.seed)
        target, moved = pick_folder(requested, "")
        if moved:
            note(f"{requested} already holds files; writing to {target}")
        summary["heatmap"] = str(plot_label_heatmap(summary, target / "label_heatmap.png"))
        write_json(target / "data_summary.json", summary)
    except ConfigError as exc:
        fail(exc)
    except OSError as exc:
        fail_results(exc)
    if as_json:
        print(json.dumps(summary))
        return
    sizes = summary["sizes"]
    rows = [
        ("source / partition", f"{summary['source']} / {summary['partition']}"),
        ("clients", summary["num_clients"]),
        (
            "training samples",
            f"{summary['num_samples']}"
            + (f" ({summary['left_out']} left out by the partition)" if summary["left_out"] else ""),
        ),
        ("client sizes min / median / max", f"{sizes['min']} / {sizes['median']:g} / {sizes['max']}"),
        ("classes", summary["num_classes"]),
        ("sample shape / target shape", f"{tuple(summary['feature_shape'])} / {tuple(summary['target_shape'])}"),
        ("test samples", summary["test_size"]),
    ]
    print_table(f"{summary['dataset']}: federated training data", ("", "value"), [(k, str(v)) for k, v in rows])
    console.print(f"label heatmap: {summary['heatmap']} (per-client counts: {target / 'data_summary.json'})")


def short_cite(paper: str) -> str:
    """``"Yang, Fang & Liu, Achieving ..., ICLR 2021"`` → ``"Yang et al., ICLR 2021"``; a paper without
    authors keeps its acronym: ``"... Client Reshuffling (FedCDR), ICML submission"`` → ``"FedCDR, ICML
    submission"``."""
    parts = [p.strip() for p in paper.split(",")]
    if len(parts) < 2:
        return paper
    venue = parts[-1]
    for k, part in enumerate(parts[:-1]):  # the authors end at the part with "&" or "et al."
        if "&" in part or part.endswith("et al."):
            two = k == 0 and part.count("&") == 1  # "A & B" stays as it is
            return f"{part if two else parts[0].split(' & ')[0].removesuffix(' et al.') + ' et al.'}, {venue}"
    acronym = re.search(r"\(([^)]+)\)", ", ".join(parts[:-1]))
    return f"{acronym.group(1)}, {venue}" if acronym else paper


@app.command()
def presets() -> None:
    """List the presets: paper (short citation), figure or table, the hardware it is sized for and its expected minutes.

    `fedshuffle show PRESET` prints one in full."""
    from fedshuffle.experiments.schema import load_experiment, preset_names

    rows = []
    for name in preset_names():
        meta = load_experiment(name).experiment
        minutes = f"~{meta.expected_minutes:g}" if meta.expected_minutes else "—"
        rows.append((name, short_cite(meta.paper), meta.figure, meta.budget or "—", minutes))
    print_table("", ("preset", "paper", "figure", "budget", "minutes"), rows, right=("minutes",), no_wrap=("preset",))


def _registries() -> dict:
    """Every registry of parts, by the name ``fedshuffle show KIND`` takes."""
    from fedshuffle.data.catalog import PARTITIONS, SOURCES
    from fedshuffle.executors import EXECUTORS
    from fedshuffle.experiments.sinks import SINKS
    from fedshuffle.methods import METHODS
    from fedshuffle.metrics import METRICS
    from fedshuffle.problems import PROBLEMS
    from fedshuffle.samplers import SAMPLERS
    from fedshuffle.server import SERVER_OPTIMIZERS

    return {
        "methods": METHODS,
        "problems": PROBLEMS,
        "sources": SOURCES,
        "partitions": PARTITIONS,
        "samplers": SAMPLERS,
        "server-optimizers": SERVER_OPTIMIZERS,
        "executors": EXECUTORS,
        "sinks": SINKS,
        "metrics": METRICS,
    }


def _show_parts(kinds: list[str], as_json: bool) -> None:
    registries = _registries()
    listing = {
        kind: [
            {
                "name": e.name,
                "summary": e.summary,
                "citation": e.citation,
                "settings": e.describe_settings(),
                "defaults": dict(e.defaults),
            }
            for e in registries[kind].entries()
        ]
        for kind in kinds
    }
    if as_json:
        print(json.dumps(listing, default=str))
        return
    for kind, entries in listing.items():
        rows = [
            (e["name"], e["summary"], ", ".join(f"{s['name']}={s['default']}" for s in e["settings"]), e["citation"])
            for e in entries
        ]
        print_table(
            f"{kind} ({registries[kind].kind})",
            ("name", "what it is", "settings (default)", "from"),
            rows,
            no_wrap=("name",),
        )


@app.command()
def show(
    config: Annotated[
        Optional[str],
        typer.Argument(
            help="preset name or TOML file; or a kind of part (methods, problems, sources, partitions, samplers, "
            "server-optimizers, executors, sinks, metrics); none: every part"
        ),
    ] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="override, as for run: --set local.lr=0.01")
    ] = None,
    variant: Annotated[Optional[list[str]], typer.Option(help="only these variants (repeat; default all)")] = None,
    diff: Annotated[
        bool,
        typer.Option("--diff", help="only the settings on which the base and the variants differ, one column each"),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="parts, or --diff, as one JSON object")] = False,
    plugins_: PluginsOption = None,
) -> None:
    """Print the resolved configuration of every variant as JSON (every default filled in, --set applied, run.seeds: the
    seeds that will run), only what the variants change (--diff), or the registered parts."""
    from fedshuffle.experiments.resolved import differences, resolved
    from fedshuffle.experiments.schema import parse_overrides
    from fedshuffle.experiments.session import only_variants
    from fedshuffle.experiments.sweep import variant_folders

    kinds = list(_registries())
    if config is None or config in kinds:
        for given, option in ((set_, "--set"), (variant, "--variant"), (diff, "--diff")):
            if given:
                fail(ConfigError(option, "applies to a preset or TOML file, not to a list of parts"))
        _show_parts([config] if config else kinds, as_json)
        return
    try:
        experiment = load_config(config)
        variant_folders(experiment)  # labels `run` would refuse
        experiment = only_variants(experiment, variant)
        overrides = parse_overrides(set_ or [])
        if diff:
            changed = differences(experiment, overrides)
        else:
            runs = resolved(experiment, overrides)
    except ConfigError as exc:
        fail(exc)
    if not diff:
        console.print_json(json.dumps({"experiment": experiment.experiment.model_dump(), "runs": runs}))
        return
    if as_json:
        print(json.dumps(changed))
        return
    columns = list(dict.fromkeys(column for values in changed.values() for column in values))
    rows = [(key, *(json.dumps(values[c]) if c in values else "—" for c in columns)) for key, values in changed.items()]
    title = f"{experiment.experiment.name}: the settings on which the variants differ"
    print_table(title, ("setting", *columns), rows, no_wrap=("setting",))
