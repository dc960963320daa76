"""Progress lines while pytest-xdist runs the suite, which with ``-q`` is otherwise silent while its workers
collect (each imports PyTorch and every test module) and while a long test runs.

The controller says when the workers start collecting and when the first has collected (how many tests, after
how long), then, at most every :data:`EVERY` seconds (the ini option ``progress_seconds``) as tests finish, how
many are done. Loaded by tests/conftest.py, or as a plugin: ``pytest -p progress``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

#: seconds between two progress lines
EVERY = 30.0


class Progress:
    """The controller's progress lines (only where xdist runs workers)."""

    def __init__(self, config: Any, every: float = EVERY) -> None:
        self.config, self.every = config, every
        self.started = self.last = time.monotonic()
        self.total: int | None = None
        self.done = 0

    def write(self, text: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            if getattr(reporter._tw, "width_of_current_line", 0):
                reporter.write("\n")  # after the line of dots
            reporter.write_line(f"[{time.monotonic() - self.started:.0f} s] {text}")

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_setupnodes(self, config: Any, specs: list) -> None:
        self.write(
            f"{len(specs)} workers start and collect the tests (each imports PyTorch and every test module first)"
        )

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if self.total is None:
            self.total = len(ids)
            self.write(f"{self.total} tests collected; running")

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when != "teardown" or self.total is None:  # a run without workers prints its own progress
            return
        self.done += 1
        if time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            self.write(f"{self.done} of {self.total} tests done")


def add_options(parser: Any) -> None:
    parser.addini("progress_seconds", "seconds between two progress lines of an xdist run", default=str(EVERY))


def register(config: Any) -> None:
    """Adds :class:`Progress` to the controller (not to xdist's workers); it speaks only when xdist runs workers."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(Progress(config, float(config.getini("progress_seconds"))), "fedshuffle-progress")


def pytest_addoption(parser: Any) -> None:
    add_options(parser)


@pytest.hookimpl(trylast=True)  # after pytest-xdist has set up its session
def pytest_configure(config: Any) -> None:
    register(config)
