"""Loaded first by the fork server that worker processes are forked from
(:func:`fedshuffle.experiments.sweep.worker_context`), before anything else: Ctrl-C goes to the whole process
group, and the process that started the fork server stops the workers itself; the fork server ignores Ctrl-C
once it has loaded what the workers need, and while it loads it would end with a traceback. Its workers inherit
the ignored Ctrl-C, as :func:`fedshuffle.experiments.sweep._start_worker` wants. Nothing else imports this."""

from __future__ import annotations

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
