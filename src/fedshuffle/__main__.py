"""``python -m fedshuffle`` and the ``fedshuffle`` command.

Ctrl-C or SIGTERM while the command starts (seconds of imports on a busy machine), before anything is
written, ends it with one line and the exit status of the signal (130, 143); once a command runs, it
handles them itself (:func:`fedshuffle.cli.common.command`).

The handler is installed before this package imports anything: ``_signal`` is the interpreter's built-in
module under :mod:`signal` (whose ``enum`` import took 5.3 ms, a window where Ctrl-C printed a traceback), and
``os`` is loaded by the interpreter's own start. What remains before it is the interpreter's start itself, where
a signal ends Python with its own message (docs/running.md)."""

import _signal
import os


def _stop_starting(signum: int, frame: object) -> None:
    """Nothing is written yet: say so in one line and exit at once with 128 + the signal's number."""
    os.write(2, b"interrupted; nothing was written.\n")
    os._exit(128 + signum)


def _forget_handled_interrupts() -> None:
    """CPython (3.8 to 3.13) records a KeyboardInterrupt that left an ``exec``/``eval`` of source text (as a
    dataclass's or a namedtuple's methods are made while a library loads) as *unhandled*, even when the command then
    handled it, and ``python -m fedshuffle`` would end by SIGINT (status -2) instead of its own exit status. Running
    source text resets that record; an interrupt that does go unhandled is recorded again on the way out."""
    exec("None")


def main() -> None:
    """Install :func:`_stop_starting` for Ctrl-C and SIGTERM (unless the signal is ignored, as for a job started in
    the background of a script), then import and run the command line."""
    for signum in (_signal.SIGINT, _signal.SIGTERM):
        if _signal.getsignal(signum) != _signal.SIG_IGN:
            _signal.signal(signum, _stop_starting)
    from fedshuffle.cli import main as run_command
    from fedshuffle.cli.common import run_as_program

    run_as_program()
    try:
        run_command()
    finally:
        _forget_handled_interrupts()


if __name__ == "__main__":
    main()
