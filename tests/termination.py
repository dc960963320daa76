"""SIGTERM stops the test suite as Ctrl-C does: every ``finally`` and fixture teardown runs, so the processes the
tests started in their own process groups (Flower's SuperLink and SuperNodes, Ray, ``fedshuffle`` commands) are
stopped rather than left running.

Python ends at SIGTERM without unwinding, and a process started with ``start_new_session=True`` is outside
pytest's process group: nothing else would stop it. The handler turns SIGTERM into :class:`KeyboardInterrupt`
once; pytest-xdist's controller first passes it on to its workers (its direct children), each of which
unwinds its own test the same way. Loaded by tests/conftest.py, or as a plugin: ``pytest -p termination``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def children() -> list[int]:
    """The direct children of this process (Linux: /proc; elsewhere none)."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids += [int(pid) for pid in task.read_text().split()]
    return pids


def signals_by_default() -> None:
    """For ``preexec_fn``: a child started to receive Ctrl-C or SIGTERM gets both at their defaults, as a terminal's
    foreground command has them, also when the suite runs in a script's background (which ignores Ctrl-C)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM does not interrupt the unwinding
    if "PYTEST_XDIST_WORKER" not in os.environ:
        for pid in children():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
    raise KeyboardInterrupt("SIGTERM")


def stop_on_sigterm() -> None:
    """SIGTERM raises :class:`KeyboardInterrupt` in this process (the main thread only can install it)."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_configure(config: object) -> None:
    stop_on_sigterm()
