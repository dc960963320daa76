"""The ``fedshuffle`` command: run experiments and presets, list them, and inspect objectives.

The application and what every command shares are in :mod:`.common`; the commands live by purpose
in :mod:`.runs` (run, sweep), :mod:`.results` (plot, table), :mod:`.catalog` (presets, show, data),
:mod:`.inspection` (inspect), :mod:`.reproduce` (reproduce) and :mod:`.flower` (flower-app).
Nothing here imports PyTorch: commands import what they need when they run. Every command turns Ctrl-C and
SIGTERM into one line and exit status 130 or 143 (:func:`.common.command`); a traceback never shows local
variables."""

from __future__ import annotations

from fedshuffle.cli.common import app, handle_signals, reflow_help

# the commands register themselves on ``app``
from fedshuffle.cli import catalog, flower, inspection, reproduce, results, runs  # noqa: F401

reflow_help(app)
handle_signals(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
