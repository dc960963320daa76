"""What every command shares: the application, the consoles, error exits, signals and notes.

Nothing here imports PyTorch at import time: a command loads it when it runs."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import platform
import shlex
import signal
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fedshuffle import plugins
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.signals import held_signals

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Federated optimization with sampling without replacement.",
)
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

    return (
        f"fedshuffle {installed('fedshuffle')} (Python {sys.version.split()[0]}, PyTorch {installed('torch')}, "
        f"NumPy {installed('numpy')}, {platform.platform()})"
    )


def _print_version(value: bool) -> None:
    if value:
        print(versions())
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="print the versions of fedshuffle, Python, PyTorch and NumPy, and exit",
        ),
    ] = False,
) -> None:
    """Federated optimization with sampling without replacement."""


DEFAULT_PRESET = "quickstart"

EXIT_STATUS = """Exit status: 0 every run complete; 2 bad input (found before any folder is written); 3 a run
    diverged or failed; 4 the results folder cannot be written (unwritable, disk full, or in use by
    another fedshuffle process), what was written is kept; 130 interrupted (Ctrl-C), 143 stopped by
    SIGTERM: continue as the message says."""


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


def fail_cluster(exc: Exception, hint: str = "") -> None:
    """A failure of the machinery a run needs (e.g. Ray not starting): one line, the hint, exit status 3."""
    err.print(f"[red]failed:[/red] {exc}" + (f"\n{hint}" if hint else ""), highlight=False, soft_wrap=True)
    raise typer.Exit(3)


#: the signals that stopped this command (SIGTERM raises KeyboardInterrupt like Ctrl-C: :func:`command`)
_received: list[int] = []
#: whether the command runs as the ``fedshuffle`` program (:func:`run_as_program`), not in a notebook or a test: once
#: the command is over or interrupted the program only exits, and ignores further signals (the interpreter's shutdown
#: would reset a Python handler to the default, ending the process by the signal instead of its exit status)
_program = False


def run_as_program() -> None:
    """The commands run as the ``fedshuffle`` program (:mod:`fedshuffle.__main__`), which only exits after one."""
    global _program
    _program = True


def interrupted(hint: str, written: bool = True) -> None:
    """One line after Ctrl-C (exit status 130) or SIGTERM (143): what is kept and how to continue (``written``:
    whether the command had written anything)."""
    signum = _received[-1] if _received else signal.SIGINT
    sweep = sys.modules.get("fedshuffle.experiments.sweep")
    if sweep is not None:
        sweep.stop_fork_server()  # started early for worker processes: it would finish loading before it ends
    which = " (SIGTERM)" if signum == signal.SIGTERM else ""
    kept = f"everything written is kept. {hint}" if written else "nothing was written."
    err.print(f"interrupted{which}; {kept}".rstrip(), highlight=False, soft_wrap=True)
    if _program:
        for ignored in (signal.SIGINT, signal.SIGTERM):  # from here the program only exits: a repeated Ctrl-C or
            signal.signal(ignored, signal.SIG_IGN)  # SIGTERM is ignored, also while the interpreter shuts down
    raise typer.Exit(128 + signum)


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (``timeout``, a batch scheduler, ``docker stop``) unwinds the command as Ctrl-C does: its workers
    stop and what was written stays resumable. Once: a second SIGTERM does not interrupt the unwinding."""
    _received.append(signum)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt("SIGTERM")


#: compiled libraries every command loads, which call Python from C++ while they load: a KeyboardInterrupt raised
#: there can surface as an ImportError or end the process in ``std::terminate``
COMPILED_LIBRARIES = ("torch", "numba")


def _load_compiled_libraries() -> None:
    """Import :data:`COMPILED_LIBRARIES` (those installed) with Ctrl-C and SIGTERM held back: the first signal
    arriving meanwhile is handled once they are loaded (at most a second or two later)."""
    with held_signals():
        for name in COMPILED_LIBRARIES:
            if importlib.util.find_spec(name) is not None:
                importlib.import_module(name)


def command(callback: Callable[..., None]) -> Callable[..., None]:
    """``callback`` (a command) run with Ctrl-C raising KeyboardInterrupt and SIGTERM handled alike (a signal the
    process ignores stays ignored); an interruption the command does not handle itself is one line
    (:func:`interrupted`). The compiled libraries load first, in one piece (:func:`_load_compiled_libraries`). The
    signal handlers in place before are restored afterwards (the ``fedshuffle`` program ignores signals from then on:
    it only exits)."""

    @functools.wraps(callback)
    def run(*args: object, **kwargs: object) -> None:
        handlers = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _terminate}
        try:
            saved = {
                signum: signal.signal(signum, handler)
                for signum, handler in handlers.items()
                if signal.getsignal(signum) is not signal.SIG_IGN
            }
        except ValueError:  # not the main thread (an embedding application): its handlers stay
            saved = {}
        _received.clear()
        try:
            if saved:
                _load_compiled_libraries()
            callback(*args, **kwargs)
        except KeyboardInterrupt:
            interrupted("")
        finally:
            for signum, handler in saved.items():  # the program's command is over: it only exits, and ignores signals
                signal.signal(signum, signal.SIG_IGN if _program else handler)

    return run


def handle_signals(application: typer.Typer) -> None:
    """Every command of ``application`` run through :func:`command`."""
    for registered in application.registered_commands:
        registered.callback = command(registered.callback)


def note(text: str) -> None:
    err.print(f"[cyan]note:[/cyan] {text}", highlight=False, soft_wrap=True)


def _consent_to_plugins(values: list[str] | None) -> list[str] | None:
    """``--plugins``: the person running the command consents to importing these modules (:mod:`fedshuffle.plugins`),
    for this command only (an earlier command in the same process, e.g. a notebook's, consented for itself)."""
    try:
        plugins.withdraw("--plugins")
        plugins.allow(values or [], "--plugins")
    except ConfigError as exc:
        fail(exc)
    return values


#: ``--plugins``, on every command that reads a config
PluginsOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--plugins",
        metavar="MODULE",
        callback=_consent_to_plugins,
        help="allow the config's [experiment] plugins to import these modules (repeat, or a comma list; a plugin is "
        "code; "
        "also FEDSHUFFLE_PLUGINS=MODULE)",
    ),
]


def load_config(config: str):
    """The experiment of a preset name or TOML file (a folder is not one)."""
    from fedshuffle.experiments.schema import load_experiment

    return load_experiment(config)


def resume_command(
    name: str, config: str, set_: list[str] | None, seeds: str | None, extend_to: int | None, folder: Path | None
) -> str:
    """The command line that continues a run: the same config and options, ``--resume FOLDER``."""
    tokens = ["fedshuffle", name, config, *(t for item in set_ or [] for t in ("--set", item))]
    consented = plugins.consented_by("--plugins")
    tokens += ["--plugins", ",".join(consented)] if consented else []
    tokens += ["--seeds", seeds] if seeds else []
    tokens += ["--extend-to", str(extend_to)] if extend_to else []
    tokens += ["--resume", str(folder)] if folder is not None else []
    return " ".join(shlex.quote(t) for t in tokens)
