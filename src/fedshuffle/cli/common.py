"""What every command shares: the application, the consoles, error exits and notes.

Nothing here imports PyTorch: commands import what they need when they run."""

from __future__ import annotations

import inspect
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fedshuffle import plugins
from fedshuffle.core.errors import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated optimization with sampling without replacement.")
console = Console(soft_wrap=True)  # lines are never cut at 80 columns in a pipe; tables: .output.print_table
err = Console(stderr=True)


def versions() -> str:
    """One line for a bug report: fedshuffle's version, Python's, the installed PyTorch's and NumPy's (read from the
    packages' metadata: nothing is imported), and the platform."""

    def installed(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"fedshuffle {installed('fedshuffle')} (Python {sys.version.split()[0]}, PyTorch {installed('torch')}, "
            f"NumPy {installed('numpy')}, {platform.platform()})")


def _print_version(value: bool) -> None:
    if value:
        print(versions())
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print the versions of fedshuffle, Python, PyTorch and NumPy, and exit")] = False,
) -> None:
    """Federated optimization with sampling without replacement."""

DEFAULT_PRESET = "quickstart"

EXIT_STATUS = """Exit status: 0 every run complete; 2 bad input (found before any folder is written); 3 a run
    diverged or failed; 4 the results folder cannot be written (unwritable, disk full, or in use by
    another fedshuffle process), what was written is kept; 130 interrupted (Ctrl-C), continue as the
    message says."""


def reflow(text: str) -> str:
    """``text`` (a docstring) with each paragraph on one line: the terminal wraps it to its width, never at the
    docstring's own line ends."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(text).split("\n\n"))


def reflow_help(application: typer.Typer) -> None:
    """Every command's help text of ``application`` reflowed (:func:`reflow`)."""
    for command in application.registered_commands:
        text = command.help or inspect.getdoc(command.callback)
        if text:
            command.help = reflow(text)


def fail(exc: ConfigError) -> None:
    err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def fail_results(exc: OSError, hint: str = "") -> None:
    err.print(f"[red]error:[/red] {exc}" + (f"\n{hint}" if hint else ""), highlight=False, soft_wrap=True)
    raise typer.Exit(4)


def interrupted(hint: str) -> None:
    err.print(f"interrupted; everything written is kept. {hint}", highlight=False, soft_wrap=True)
    raise typer.Exit(130)


def note(text: str) -> None:
    err.print(f"[cyan]note:[/cyan] {text}", highlight=False, soft_wrap=True)


def _consent_to_plugins(values: list[str] | None) -> list[str] | None:
    """``--plugins``: the person running the command consents to importing these modules (:mod:`fedshuffle.plugins`)."""
    try:
        plugins.allow(values or [], "--plugins")
    except ConfigError as exc:
        fail(exc)
    return values


#: ``--plugins``, on every command that reads a config
PluginsOption = Annotated[Optional[list[str]], typer.Option(
    "--plugins", metavar="MODULE", callback=_consent_to_plugins,
    help="allow the config's [experiment] plugins to import these modules (repeat, or a comma list; a plugin is code; "
         "also FEDSHUFFLE_PLUGINS=MODULE)")]


def load_config(config: str):
    """The experiment of a preset name or TOML file (a folder is not one)."""
    from fedshuffle.experiments.schema import load_experiment

    return load_experiment(config)


def resume_command(name: str, config: str, set_: list[str] | None, seeds: str | None, extend_to: int | None, folder: Path | None) -> str:
    """The command line that continues a run: the same config and options, ``--resume FOLDER``."""
    tokens = ["fedshuffle", name, config, *(t for item in set_ or [] for t in ("--set", item))]
    tokens += ["--plugins", ",".join(plugins.consented_by("--plugins"))] if plugins.consented_by("--plugins") else []
    tokens += ["--seeds", seeds] if seeds else []
    tokens += ["--extend-to", str(extend_to)] if extend_to else []
    tokens += ["--resume", str(folder)] if folder is not None else []
    return " ".join(shlex.quote(t) for t in tokens)
