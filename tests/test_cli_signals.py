"""Early and infrastructure failures of the command: Ctrl-C and SIGTERM at any moment, a TMPDIR too long for the
workers' sockets, Ray not starting, and tracebacks without local variables: one line each."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import toy_config
from termination import signals_by_default
from typer.testing import CliRunner

import fedshuffle.cli.common as common
import fedshuffle.experiments.sweep as sweep_mod
from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError

SRC = str(Path(sweep_mod.__file__).parents[2])


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def _start(*args: object, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m fedshuffle ARGS`` in its own process group (its pid is the group's id)."""
    return subprocess.Popen(
        [sys.executable, "-m", "fedshuffle", *map(str, args)],
        env=env or _env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=signals_by_default,
    )


def _group(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process in process group ``pgid``: not a zombie, and not one whose command
    line is gone (its memory released: it is exiting, as multiprocessing's resource tracker does as the command
    ends)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if command:
                    found.append((int(entry.name), command))
        except (OSError, ValueError):
            continue
    return found


def _catches_sigterm(pid: int) -> bool:
    """Whether ``pid`` has its own SIGTERM handler: the command installs it first thing (fedshuffle/__main__.py)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _wait_for(condition, what: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:.0f} s"
        time.sleep(0.01)


def _finish(proc: subprocess.Popen) -> str:
    """The command's stderr once it has ended (killed with its group if it runs 120 s more)."""
    try:
        return proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*") if p.is_file()}


def _kill_group(pgid: int) -> None:
    for pid, _ in _group(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _one_line(stderr: str, start: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(start), stderr
    assert [line for line in lines if line.startswith("interrupted")] == lines[-1:], stderr


@pytest.mark.parametrize(
    "signum, status, delay",
    [(signal.SIGINT, 130, 0.0), (signal.SIGINT, 130, 1.0), (signal.SIGTERM, 143, 0.0), (signal.SIGTERM, 143, 2.0)],
)
def test_a_signal_while_the_command_starts_is_one_line(tmp_path, signum, status, delay):
    """From the moment the command's handler is in place (then it imports for a second or more; later the run's own
    imports and preflight): one line, the signal's exit status."""
    proc = _start("run", "quickstart", "--out", tmp_path / "out", "--quiet")
    try:
        _wait_for(lambda: _catches_sigterm(proc.pid) or proc.poll() is not None, "the command's signal handler")
        time.sleep(delay)
        os.killpg(proc.pid, signum)  # as a terminal's Ctrl-C: the whole group
        stderr = _finish(proc)
    finally:
        _kill_group(proc.pid)
    assert proc.returncode == status, stderr
    _one_line(stderr, "interrupted")


def test_the_command_handles_signals_before_it_imports_anything():
    """``import fedshuffle.__main__`` loads no module the interpreter had not loaded already, so the handler is in
    place with the package's first instructions: ``signal`` alone (its ``enum``) took 5.3 ms, a window where a
    Ctrl-C printed a traceback from ``fedshuffle/__main__.py``."""
    probe = "import sys\nknown = set(sys.modules)\nimport fedshuffle.__main__\nprint(*sorted(set(sys.modules) - known))"
    loaded = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, check=True)
    assert loaded.stdout.split() == ["fedshuffle", "fedshuffle.__main__"], loaded.stdout


def _run_alone(argv: list, before: Callable[[], object] = signals_by_default) -> subprocess.CompletedProcess:
    """``argv`` run to its end in its own session, ``before`` run in the child first (its signals), output kept."""
    return subprocess.run(
        argv,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        start_new_session=True,
        preexec_fn=before,
    )


def _run_script(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    """``source`` written as a script in ``tmp_path`` and run to its end in its own session (:func:`_run_alone`)."""
    (tmp_path / "script.py").write_text(source)
    return _run_alone([sys.executable, str(tmp_path / "script.py")])


def _show_with_plugin(tmp_path: Path, source: str, ctrl_c_ignored: bool = False) -> subprocess.CompletedProcess:
    """``python -m fedshuffle show`` of a config whose consented plugin module (in ``tmp_path``) is ``source``."""
    (tmp_path / "signal_plugin.py").write_text(source)
    cfg = toy_config(tmp_path, method="fedavg", rounds=4, eval_every=2)
    cfg.write_text(cfg.read_text().replace("[experiment]\n", '[experiment]\nplugins = ["signal_plugin"]\n', 1))
    return _run_alone(
        [sys.executable, "-m", "fedshuffle", "show", cfg, "--plugins", "signal_plugin"],
        (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ctrl_c_ignored else signals_by_default,
    )


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_a_library_runs_generated_source_ends_with_the_signals_status(tmp_path, signum, status):
    """A library making a dataclass or namedtuple ``exec``s source text; CPython records a KeyboardInterrupt that
    leaves it as unhandled even when the command handles it, and ``python -m`` would end by SIGINT (status -2)."""
    proc = _show_with_plugin(
        tmp_path,
        f"exec('import os, time\\nos.kill(os.getpid(), {int(signum)})\\nfor _ in range(500): time.sleep(0.01)')\n",
    )
    assert proc.returncode == status, proc.stderr
    _one_line(proc.stderr, "interrupted")
    assert proc.stderr.rstrip().endswith("; everything written is kept."), proc.stderr


@pytest.mark.parametrize("ctrl_c_ignored", [False, True])
def test_a_sigterm_while_a_finished_command_exits_is_ignored(tmp_path, ctrl_c_ignored):
    """A finished command only exits: a SIGTERM landing then (here from an exit handler) changes neither its status
    nor its output — also when it started with Ctrl-C ignored, as a script's background job does."""
    proc = _show_with_plugin(
        tmp_path,
        "import atexit, os, signal, time\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.5)))\n",
        ctrl_c_ignored,
    )
    assert proc.returncode == 0, proc.stderr
    assert "interrupted" not in proc.stderr, proc.stderr


def test_a_signal_while_the_compiled_libraries_load_waits_until_they_are_loaded(tmp_path, monkeypatch):
    """PyTorch calls Python from C++ while it loads: a KeyboardInterrupt raised there can surface as an ImportError
    or abort the process, so a command holds Ctrl-C and SIGTERM back until the compiled libraries are loaded."""
    (tmp_path / "compiled_stand_in.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.2)\nLOADED = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(common, "COMPILED_LIBRARIES", ("compiled_stand_in",))
    seen: list[bool] = []
    previous = signal.signal(
        signal.SIGTERM, lambda signum, frame: seen.append(hasattr(sys.modules.get("compiled_stand_in"), "LOADED"))
    )
    try:
        common._load_compiled_libraries()
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.modules.pop("compiled_stand_in", None)
    assert seen == [True]


def test_ctrl_c_while_the_fork_server_loads_is_one_line_and_stops_it(tmp_path):
    proc = _start("run", "quickstart", "--seeds", "0..3", "--workers", "2", "--out", tmp_path / "out", "--quiet")
    try:
        _wait_for(
            lambda: any("forkserver" in cmd for _, cmd in _group(proc.pid)) or proc.poll() is not None,
            "the fork server",
        )
        os.killpg(proc.pid, signal.SIGINT)
        stderr = _finish(proc)
        left = _group(proc.pid)
    finally:
        _kill_group(proc.pid)
    assert proc.returncode == 130, stderr
    _one_line(stderr, "interrupted")
    assert not left, left


FORK_SERVER_MASK = """
import signal
from multiprocessing import util
from fedshuffle.experiments import sweep

spawn = util.spawnv_passfds


def recording(path, args, passfds):
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # what the child inherits
    print(args[-1].split()[1], blocked)
    return spawn(path, args, passfds)


util.spawnv_passfds = recording
if __name__ == "__main__":
    sweep._start_fork_server(sweep.worker_context())
    sweep.stop_fork_server()
"""


def test_the_fork_server_starts_with_ctrl_c_blocked_also_when_it_starts_the_resource_tracker(tmp_path):
    """Starting multiprocessing's resource tracker unblocks Ctrl-C on its way out; started inside the fork server's
    start, it let the server's interpreter start unprotected, and a terminal's Ctrl-C then printed Python's fatal
    start-up error (3 of 16 Ctrl-Cs sent as the fork server appeared)."""
    proc = _run_script(tmp_path, FORK_SERVER_MASK)
    assert proc.returncode == 0, proc.stderr
    spawned = dict(line.split() for line in proc.stdout.splitlines())
    assert spawned == {"multiprocessing.resource_tracker": "True", "multiprocessing.forkserver": "True"}, spawned


FORK_SERVER_LEFT = """
import multiprocessing.forkserver
import os
import signal
import time
from multiprocessing import util
from fedshuffle.experiments import sweep

spawn = util.spawnv_passfds
servers = []


def spawn_then_sigterm(path, args, passfds):
    pid = spawn(path, args, passfds)
    if "forkserver" in args[-1]:
        servers.append(pid)
        if len(servers) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # lands before multiprocessing records the server
    return pid


def dead(pid, seconds):
    for _ in range(int(seconds * 10) + 1):
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def terminate(signum, frame):  # as the command's own SIGTERM handler
    raise KeyboardInterrupt("SIGTERM")


util.spawnv_passfds = spawn_then_sigterm
signal.signal(signal.SIGTERM, terminate)
if __name__ == "__main__":
    context = sweep.worker_context()
    try:
        sweep._start_fork_server(context)
    except KeyboardInterrupt:
        pass
    straggler = context.Process(target=time.sleep, args=(60,), daemon=True)
    straggler.start()  # forked by the fork server, as a worker its pool has not recorded yet
    sweep.stop_fork_server()
    print("server", dead(servers[0], 0))  # left alone, it would end once loaded, seconds later
    print("straggler", dead(straggler.pid, 5))  # ended by SIGKILL, then reaped by init
"""


def test_a_sigterm_as_the_fork_server_starts_leaves_nothing_it_forked(tmp_path):
    """SIGTERM right after the fork server was spawned, before multiprocessing recorded it, left it loading for
    seconds after the command; a process the server forked as the interrupt landed (a worker its pool had not
    recorded, the rounds' queue manager) stayed forever. Both are ended with the server."""
    proc = _run_script(tmp_path, FORK_SERVER_LEFT)
    assert proc.returncode == 0, proc.stderr
    assert dict(line.split() for line in proc.stdout.splitlines()) == {"server": "True", "straggler": "True"}


STOPPED_POOL = """
import time
from concurrent.futures import ProcessPoolExecutor
from fedshuffle.experiments import sweep

if __name__ == "__main__":
    context = sweep.worker_context()
    sweep._start_fork_server(context)
    pool = ProcessPoolExecutor(max_workers=2, mp_context=context)
    futures = [pool.submit(time.sleep, 60) for _ in range(3)]
    while sum(future.running() for future in futures) < 2:
        time.sleep(0.01)
    queues = (pool._call_queue, pool._result_queue)  # still alive, as in a pool interrupted while it was built
    sweep._stop(pool)  # as after Ctrl-C or SIGTERM: the pool, then the fork server
    sweep.stop_fork_server()
"""


def test_an_interrupted_pool_whose_queues_are_alive_exits_without_a_traceback(tmp_path):
    """The pool's queues hold semaphores registered with multiprocessing's resource tracker. Stopped while they were
    alive, the tracker unlinked them as leaked and their own finalizers printed a FileNotFoundError traceback as the
    command exited (2 of 400 signal fuzz cases); the tracker now ends with the command, after those finalizers."""
    proc = _run_script(tmp_path, STOPPED_POOL)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr


def test_sigterm_stops_the_workers_and_the_fork_server_and_leaves_the_runs_resumable(tmp_path):
    out = tmp_path / "out"
    proc = _start(
        "run", "quickstart", "--seeds", "0..3", "--workers", "2", "--out", out, "--quiet", "--set", "run.rounds=100000"
    )
    try:
        _wait_for(
            lambda: any(out.glob("*/seed-*/checkpoint.pt")) or proc.poll() is not None, "a worker's first checkpoint"
        )
        os.kill(proc.pid, signal.SIGTERM)  # the command alone, as `timeout` or `docker stop` sends it
        stderr = _finish(proc)
        left = _group(proc.pid)
        before = _snapshot(out)
        time.sleep(5)
        after = _snapshot(out)
    finally:
        _kill_group(proc.pid)
    assert proc.returncode == 143, stderr
    _one_line(stderr, "interrupted (SIGTERM); everything written is kept. continue with: ")
    assert f"--resume {out}" in stderr
    assert not left, left
    assert before == after, "files changed after the command ended"
    assert not list(out.glob("*/seed-*/summary.json")), "a run finished before it could be stopped"
    assert any(out.glob("*/seed-*/checkpoint.pt"))


def test_a_temporary_folder_too_long_for_sockets_falls_back_to_a_short_one(tmp_path):
    long = tmp_path / ("t" * 60) / ("m" * 60)
    long.mkdir(parents=True)
    cfg = toy_config(tmp_path, method="fedavg", rounds=4, seeds=(0, 1), eval_every=2)
    command = [sys.executable, "-m", "fedshuffle", "run", cfg, "--workers", "2", "--out", tmp_path / "out", "--quiet"]
    proc = subprocess.run(command, env=_env(TMPDIR=str(long)), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(list((tmp_path / "out").glob("seed-*/summary.json"))) == 2


def test_no_short_folder_for_the_sockets_is_one_line(tmp_path, monkeypatch):
    long = tmp_path / ("t" * 120)
    long.mkdir()
    config = mp.current_process()._config
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    monkeypatch.setattr(sweep_mod, "SHORT_TEMP_DIRS", (str(tmp_path / "missing"),))
    monkeypatch.setitem(config, "tempdir", None)
    with pytest.raises(ConfigError, match=r"^--workers: the temporary folder .* is too long for the workers' sockets"):
        sweep_mod._socket_folder()
    monkeypatch.setattr(sweep_mod, "SHORT_TEMP_DIRS", (str(tmp_path),))
    sweep_mod._socket_folder()
    assert Path(config["tempdir"]).parent == tmp_path


def test_ray_not_starting_is_one_line_exit_3_with_how_to_continue(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")

    def dead(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the raylet died\nwith a long story after the first line")

    monkeypatch.setattr(ray, "init", dead)
    cfg = toy_config(tmp_path, method="fedavg", rounds=4, eval_every=2, extra="")
    cfg.write_text(cfg.read_text().replace("[run]\n", '[run]\nexecutor = "ray"\n'))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--quiet"], terminal_width=200)
    assert result.exit_code == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "failed: Ray did not start (RuntimeError: the raylet died)", result.stderr
    assert lines[1:] == [f"continue with: fedshuffle run {cfg} --resume {out}"], result.stderr


def test_a_traceback_the_command_prints_shows_no_local_variables(tmp_path):
    assert app.pretty_exceptions_show_locals is False
    script = (
        "import sys\n"
        "import fedshuffle.cli.common as common\n"
        "def load(config):\n"
        "    secret_local = 'LOCAL-VALUE-' + 'SHOWN'\n"
        "    raise RuntimeError('unexpected')\n"
        "common.load_config = load\n"
        "import fedshuffle.cli.runs as runs\n"
        "runs.load_config = load\n"
        "from fedshuffle.__main__ import main\n"
        "sys.argv = ['fedshuffle', 'run', 'quickstart', '--out', sys.argv[1]]\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "out")],
        env=_env(COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1
    assert "RuntimeError" in proc.stderr and "unexpected" in proc.stderr
    assert "LOCAL-VALUE-SHOWN" not in proc.stderr  # the source line shows, the variable's value does not
