"""The test suite itself: SIGTERM stops it with every process its tests started (tests/termination.py), and it
reports progress while its workers collect and run (tests/progress.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from termination import signals_by_default

TESTS = Path(__file__).resolve().parent

HOLDER = """
import os, signal, subprocess, sys, time
from pathlib import Path

def test_holds_a_process_group():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        Path(os.environ["HOLDER_PID"]).write_text(str(child.pid))
        time.sleep(600)
    finally:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(10)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds child processes in /proc (Linux)")
@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigterm_stops_the_suite_and_the_process_groups_its_tests_started(tmp_path, workers):
    """A test holds a process in its own group (as the Flower and Ray tests do) and stops it in ``finally``; the
    suite gets SIGTERM while the test waits: the test unwinds, the process is gone, and the suite exits."""
    (tmp_path / "test_holder.py").write_text(HOLDER)
    mark = tmp_path / "pid"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "HOLDER_PID": str(mark)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "termination",
        "-p",
        "no:cacheprovider",
        "-n",
        workers,
        "test_holder.py",
    ]
    suite = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=signals_by_default,
    )
    held = None
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and suite.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mark.exists(), (
            suite.communicate(timeout=30)[0].decode()[-2000:] if suite.poll() is not None else "the test never started"
        )
        time.sleep(0.2)  # the pid is written; the test sleeps
        held = int(mark.read_text())
        assert alive(held)
        suite.send_signal(signal.SIGTERM)
        output = suite.communicate(timeout=60)[0].decode()
        assert suite.returncode != 0, output  # interrupted, not passed
        assert not alive(held), f"the test's process {held} outlived the suite:\n{output[-2000:]}"
    finally:
        for group in (suite.pid, held):
            if group is not None:
                try:
                    os.killpg(group, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        suite.wait(10)


def test_an_xdist_run_says_when_its_workers_collect_and_how_many_tests_are_done(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import time\n\ndef test_a(): time.sleep(0.2)\n\ndef test_b(): time.sleep(0.2)\n\ndef test_c(): pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "progress",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "-o",
        "progress_seconds=0",
        "test_three.py",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split("] ", 1)[1] for line in result.stdout.splitlines() if line.startswith("[") and " s] " in line]
    assert lines[:2] == [
        "2 workers start and collect the tests (each imports PyTorch and every test module first)",
        "3 tests collected; running",
    ]
    assert lines[2:] == [f"{k} of 3 tests done" for k in (1, 2, 3)], result.stdout
