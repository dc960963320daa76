"""Ctrl-C and SIGTERM held back over a block of code that must not be interrupted halfway."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held_signals() -> Iterator[None]:
    """Run the block with Ctrl-C and SIGTERM recorded instead of handled (those the process ignores stay ignored);
    the first that arrived is handled as the block ends, by the handler that was in place.

    Recording handlers, not a signal mask: a process-directed signal lands on any thread that does not block it,
    and Python runs the handler in the main thread at its next instruction, so only the handler decides. Outside
    the main thread (an embedding application) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    handlers = {
        signum: signal.signal(signum, lambda number, frame: arrived.append(number))
        for signum in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if arrived:
        handler = handlers[arrived[0]]
        if callable(handler):
            handler(arrived[0], None)
        else:
            signal.raise_signal(arrived[0])
