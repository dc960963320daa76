"""``flower-app``: a fedshuffle experiment as a ready Flower App folder; ``flower-split``: its clients as per-node
data folders."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.cli.common import app, console, fail, fail_results, PluginsOption


@app.command("flower-app")
def flower_app(
    config: Annotated[str, typer.Argument(help="preset name or TOML file")],
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="folder to write the Flower App into")],
    set_: Annotated[
        Optional[list[str]],
        typer.Option("--set", help="override, kept in the app's run config (flwr run -c 'set=\"...\"' changes it)"),
    ] = None,
    variant: Annotated[
        Optional[str], typer.Option(help="run only this variant (default: every variant in turn)")
    ] = None,
    node_data: Annotated[
        bool,
        typer.Option(
            "--node-data",
            help="the nodes bring their own data (data-path); the server builds none and the app carries no data path",
        ),
    ] = False,
    bundle_wheel: Annotated[
        bool,
        typer.Option(
            "--bundle-wheel",
            help="build this fedshuffle's wheel into DIR/wheels and install the app's fedshuffle from it (no index)",
        ),
    ] = False,
    wheel: Annotated[
        Optional[Path],
        typer.Option(
            "--wheel",
            metavar="FILE",
            help="bundle this fedshuffle wheel (of the installed version) instead of building one",
        ),
    ] = None,
    plugins_: PluginsOption = None,
) -> None:
    """Write the experiment as a Flower App pinned to this fedshuffle: `flwr run DIR <connection>` runs it
    (docs/flower.md)."""
    from fedshuffle.integrations.flower.bundle import write_app
    from fedshuffle.integrations.flower.common import AppSettings

    try:
        settings = AppSettings(variant=variant or "", overrides="; ".join(set_ or []), node_data=node_data)
        target = write_app(config, directory, settings, bundle_wheel=bundle_wheel, wheel=wheel)
    except ConfigError as exc:
        fail(exc)
    except OSError as exc:
        fail_results(ResultsError(f"cannot write the app into {directory} ({exc.strerror or exc})"))
    console.print(f"Flower App written to {target}/; run it with: flwr run {target} <connection>")


@app.command("flower-split")
def flower_split(
    config: Annotated[str, typer.Argument(help="preset name or TOML file")],
    nodes: Annotated[int, typer.Option("--nodes", help="how many node folders to write (consecutive clients each)")],
    out: Annotated[Path, typer.Option("--out", help="folder to write node-<k>/client-<id>.npz into")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override, as in fedshuffle run")] = None,
    seed: Annotated[Optional[int], typer.Option(help="split seed (default: the experiment's first seed)")] = None,
    plugins_: PluginsOption = None,
) -> None:
    """Write an experiment's clients as per-node data folders: each Flower node then reads only its own
    (`data-path=DIR/node-<k>`)."""
    from fedshuffle.experiments.schema import load_experiment, parse_overrides
    from fedshuffle.integrations.flower.common import format_clients
    from fedshuffle.integrations.flower.nodedata import write_node_folders

    try:
        written = write_node_folders(load_experiment(config), nodes, out, seed, parse_overrides(set_ or []))
    except ConfigError as exc:
        fail(exc)
    except OSError as exc:
        fail_results(ResultsError(f"cannot write the node folders into {out} ({exc.strerror or exc})"))
    for folder, clients in written:
        console.print(f"{folder}: clients {format_clients(clients)} (--node-config 'data-path=\"{folder.resolve()}\"')")
