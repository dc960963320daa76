"""The Ray executor and the network: a local Ray listens on 127.0.0.1 only, keeps to itself when another
Ray runs on the machine, stops every process it started, and a bad ``run.ray_address`` fails fast."""

import gc
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import listening
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.runner import run_single
from fedshuffle.experiments.schema import RunSpec, validate

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not listening.available(), reason="reads listening sockets from /proc (Linux)")

OTHER_RAY = """
import os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
ray.init(
    address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1],
    _node_ip_address="127.0.0.1",
)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


def ray_processes(root: int, besides: int | None = None) -> list[int]:
    """Processes of ``root``'s tree (except itself, and except the tree of ``besides``) that belong to Ray."""
    found = []
    for pid in listening.process_tree(root) - {root} - (listening.process_tree(besides) if besides else set()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (
            "ray" in cmdline and "multiprocessing.forkserver" not in cmdline
        ):  # the sweep workers' fork server (and its forks) carry sys.path, Ray's folders in it
            found.append(pid)
    return found


@pytest.fixture
def other_ray():
    """Another local Ray instance on this machine, in its own process session, named by ``RAY_ADDRESS``; its
    folder is short (Ray's socket paths must fit in 107 bytes, which pytest's nested temporary folders may not)."""
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    proc = subprocess.Popen(
        [sys.executable, "-c", OTHER_RAY, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        address = proc.stdout.readline().strip()
        assert address, "the other Ray instance did not start"
        yield proc, address
    finally:
        try:
            proc.stdin.close()
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            shutil.rmtree(folder, ignore_errors=True)


def ray_spec(**run):
    return validate(
        RunSpec,
        {
            "method": {"name": "fedavg"},
            "local": {"lr": 0.1, "epochs": 1, "batch_size": 2},
            "sampler": {"name": "uniform", "cohort": 4},
            "problem": {"name": "logistic", "l2": 1e-2},
            "data": {
                "source": "synthetic",
                "samples": 80,
                "features": 3,
                "classes": 2,
                "clients": 6,
                "partition": "iid",
            },
            "run": {"rounds": 3, "eval_every": 1, **run},
        },
    )


def test_a_local_ray_run_listens_on_loopback_only_beside_another_ray_and_stops_everything(
    tmp_path, monkeypatch, other_ray
):
    """A whole run on run.executor = "ray" while another Ray runs and RAY_ADDRESS names it: the run starts
    its own Ray (not the other), every socket of this process tree listens on 127.0.0.0/8 or ::1 while
    it runs, the numbers are the sequential executor's, and afterwards no Ray process of ours is left
    while the other instance still runs."""
    other, other_address = other_ray
    monkeypatch.setenv("RAY_ADDRESS", other_address)
    assert not ray.is_initialized()
    seen: list[tuple[str, int, int]] = []
    sessions = set()

    def during_round(_):
        if ray.is_initialized():
            seen.extend(listening.listening(listening.process_tree(os.getpid())))
            sessions.add(ray.get_runtime_context().gcs_address)

    outcome = run_single(ray_spec(executor="ray", ray_workers=2), tmp_path / "ray", seed=0, on_round=during_round)
    reference = run_single(ray_spec(executor="sequential"), tmp_path / "seq", seed=0)
    assert outcome.status == reference.status == "complete"
    np.testing.assert_allclose(
        np.load(tmp_path / "ray" / "final_params.npy"),
        np.load(tmp_path / "seq" / "final_params.npy"),
        rtol=1e-12,
        atol=1e-14,
    )
    assert sessions and other_address not in sessions, "the run joined the other Ray instead of starting its own"
    ours = [s for s in seen if s[2] != other.pid]
    assert len({s[2] for s in ours}) >= 3, f"expected sockets of the driver, GCS and raylet, saw {ours}"
    assert not [s for s in ours if not listening.is_loopback(s[0])], (
        f"listening beyond loopback: {[s for s in ours if not listening.is_loopback(s[0])]}"
    )
    gc.collect()  # the run's executor is unreachable now: its finalizer shuts its Ray down
    deadline = time.monotonic() + 30
    while ray_processes(os.getpid(), besides=other.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray.is_initialized() and ray_processes(os.getpid(), besides=other.pid) == []
    assert other.poll() is None and ray_processes(other.pid), "stopping our Ray must leave the other instance running"
    assert not list(Path("/tmp").glob(f"fsray-*/session_*_{os.getpid()}"))  # our temporary folder is removed


def test_the_executor_as_a_context_manager_stops_its_ray():
    from fedshuffle.executors.ray import RayExecutor
    from test_executors import trajectory

    with RayExecutor(workers=1) as executor:
        trajectory("fedavg", executor)
        assert ray.is_initialized() and ray_processes(os.getpid())
        assert listening.public_listeners() == []
    assert not ray.is_initialized()
    deadline = time.monotonic() + 30
    while ray_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes(os.getpid()) == []


@pytest.fixture
def silent_port():
    """A port on 127.0.0.1 that accepts connections and never answers (not a Ray cluster)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["refused", "silent", "malformed"])
def test_an_unreachable_ray_address_fails_within_30_s_with_one_line(kind, silent_port):
    from fedshuffle.experiments.build import build_executor

    address = {"refused": "127.0.0.1:1", "silent": f"127.0.0.1:{silent_port}", "malformed": "127.0.0.1"}[kind]
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        build_executor(ray_spec(executor="ray", ray_address=address).run)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed
    assert info.value.field == "run.ray_address" and "\n" not in str(info.value) and address in str(info.value)
    assert not ray.is_initialized() and ray_processes(os.getpid()) == []


def test_the_cli_refuses_an_unreachable_ray_address_with_exit_status_2(tmp_path):
    from typer.testing import CliRunner

    from fedshuffle.cli import app

    config = tmp_path / "c.toml"
    config.write_text(
        '[local]\nlr = 0.1\n[problem]\nname = "logistic"\n[data]\nsource = "synthetic"\nsamples = 40\nfeatures = '
        '2\nclients = 2\npartition = "iid"\n'
        '[run]\nrounds = 2\nexecutor = "ray"\nray_address = "127.0.0.1:1"\n'
    )
    start = time.monotonic()
    result = CliRunner().invoke(app, ["run", str(config), "--out", str(tmp_path / "out"), "--quiet"])
    assert time.monotonic() - start < 30
    assert result.exit_code == 2 and "run.ray_address" in result.output and "Traceback" not in result.output


def test_closing_the_simulation_stops_the_ray_it_started():
    from fedshuffle.experiments.runner import build_simulation

    sim, _ = build_simulation(ray_spec(executor="ray", ray_workers=1), 0)
    sim.step()
    assert ray.is_initialized()
    sim.close()
    sim.close()
    assert not ray.is_initialized()
