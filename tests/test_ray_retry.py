"""Losing a Ray worker node mid-run: its task is retried elsewhere and the run's numbers are those of a run
without failure (the sequential executor's), client state included.

The cluster is a head (the driver's node, which holds the data blocks) and two worker nodes, all on 127.0.0.1
(Ray's local-cluster mode, so every service binds loopback), started by a keeper process in a session of its
own; the test kills one worker node's processes (SIGKILL: the worker process running a share's task first)
and kills the keeper's whole process tree in ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import listening
from fedshuffle import LogisticRegression, Simulation, UniformWithoutReplacement, build_algorithm
from fedshuffle.core.errors import ConfigError
from fedshuffle.data import FederatedDataset, objective_weights
from fedshuffle.executors.local import SequentialExecutor, VectorizedExecutor

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not listening.available(), reason="reads processes and sockets from /proc (Linux)")

from fedshuffle.executors.ray import RayExecutor  # noqa: E402  (after Ray is known to be installed)

#: A head without CPUs (it holds the driver and the data blocks it puts) and two worker nodes of one CPU each,
#: all on 127.0.0.1; node deaths detected within ~1 s. Prints the address and the worker nodes' raylet pids as JSON.
KEEPER = """
import json, os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray._private.utils
from ray.cluster_utils import Cluster
ray._private.utils.write_ray_address = lambda *args, **kwargs: None  # leave /tmp/ray's "current cluster" file to others
node = dict(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=80 << 20, temp_dir=sys.argv[1])
detection = {
    "health_check_period_ms": 200, "health_check_timeout_ms": 200, "health_check_failure_threshold": 5,
    "health_check_initial_delay_ms": 0,
}
head = {**node, "num_cpus": 0, "include_dashboard": False, "_system_config": detection}
cluster = Cluster(initialize_head=True, head_node_args=head)
workers = [cluster.add_node(**node) for _ in range(2)]  # each returns once its node is registered
raylets = [w.all_processes["raylet"][0].process.pid for w in workers]
print(json.dumps({"address": cluster.address, "raylets": raylets}), flush=True)
sys.stdin.read()  # until the test closes it (or kills this process)
"""
#: Waits (≤ 60 s) until a worker process of a worker node (raylet pids in argv) has run a share's task for
#: 10 ms, then SIGKILLs it and every other process of its node and prints its pid ("ready" first, once it watches). A
#: task takes ~0.2 s here,
#: so one seen at 10 ms is still computing when it is killed.
KILLER = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import listening
raylets = [int(pid) for pid in sys.argv[2:]]

def title(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[0].decode(errors="replace")
    except OSError:
        return ""

nodes, since = {raylet: listening.process_tree(raylet) for raylet in raylets}, {}
print("ready", flush=True)
deadline, rescan = time.monotonic() + 60, time.monotonic() + 1
while time.monotonic() < deadline:
    now = time.monotonic()
    if now > rescan:  # the raylet, its agents and its worker processes (reused from task to task)
        nodes, rescan = {raylet: listening.process_tree(raylet) for raylet in raylets}, now + 1
    tasks = [pid for pids in nodes.values() for pid in pids if title(pid).startswith("ray::_run_share")]
    since = {pid: since.get(pid, now) for pid in tasks}
    busy = [pid for pid, start in since.items() if now - start >= 0.01]
    if busy:
        raylet = next(r for r, pids in nodes.items() if busy[0] in pids)
        for pid in [busy[0], *sorted(listening.process_tree(raylet) - {busy[0]})]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(busy[0], flush=True)
        break
    time.sleep(0.0002)
"""
FIRST_KILL_ROUND = 2
ROUNDS = 5


@dataclass
class LoopbackCluster:
    """The keeper process, the cluster's address and the raylets of its worker nodes."""

    keeper: subprocess.Popen
    address: str
    raylets: list[int]

    @contextmanager
    def killer(self, killed: list[int]) -> Iterator[None]:
        """A process (its own session: a thread of this one would wait for the GIL while the driver waits for
        Ray) that kills the first worker node seen computing a task; ``killed`` gets the killed task process's
        pid when the block ends (nothing if none was seen)."""
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLER, str(Path(__file__).parent), *map(str, self.raylets)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            assert _first_line(proc, 60) == "ready", "the killer did not start"
            yield
        finally:
            try:
                out, _ = proc.communicate(timeout=1)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            killed.extend(int(line) for line in out.split())


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line ``proc`` prints, stripped; its session is killed if none comes within ``timeout`` s."""
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        return proc.stdout.readline().strip()
    finally:
        timer.cancel()


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie awaiting its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def loopback_cluster() -> Iterator[LoopbackCluster]:
    folder = tempfile.mkdtemp(prefix="fsrt-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    keeper = subprocess.Popen(
        [sys.executable, "-c", KEEPER, folder],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        line = _first_line(keeper, 90)
        assert line, "the Ray cluster did not start"
        info = json.loads(line)
        yield LoopbackCluster(keeper, info["address"], info["raylets"])
    finally:
        tree = listening.process_tree(
            keeper.pid
        )  # the keeper and every Ray process it started, even one that left its session
        for pid in sorted(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(keeper.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        keeper.wait()
        shutil.rmtree(folder, ignore_errors=True)


def dataset(clients: int = 8, size: int = 40, dim: int = 5) -> FederatedDataset:
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(clients * size, dim)))
    y = torch.tensor(rng.integers(0, 2, clients * size) * 2.0 - 1.0)
    order = rng.permutation(clients * size)
    return FederatedDataset(x, y, np.split(order, clients), objective_weights(np.full(clients, size), "size"))


def simulation(executor, data: FederatedDataset) -> Simulation:
    """SCAFFOLD (client control variates kept by the driver) with long enough local work that a task can be caught
    running."""
    algorithm = build_algorithm("scaffold", {"local": {"lr": 0.02, "epochs": 60, "batch_size": 1}})
    return Simulation(
        LogisticRegression(data.features.shape[1], 1e-2),
        data,
        algorithm,
        UniformWithoutReplacement(data.num_clients, 6),
        seed=5,
        executor=executor,
    )


def run(
    sim: Simulation, beside: Callable[[], AbstractContextManager[None]] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The global model after each round, and the client state at the end; ``beside()`` is entered from round
    :data:`FIRST_KILL_ROUND` to the end of the run."""
    out = []
    with ExitStack() as stack:
        for r in range(ROUNDS):
            if beside and r == FIRST_KILL_ROUND:
                stack.enter_context(beside())
            sim.step()
            out.append(sim.params.clone())
    everyone = np.arange(sim.data.num_clients)
    return torch.stack(out), {name: sim.store.get(name, everyone) for name in sim.store.fields}


def test_a_task_on_a_killed_worker_node_is_retried_and_the_run_keeps_the_sequential_numbers():
    """From round 2 on, the first task seen computing on a worker node gets its node killed; the task runs
    again on the other node, fetching its blocks from the head, and the trajectory and SCAFFOLD's
    control variates equal the sequential executor's (to the tolerance of the other Ray tests)."""
    data = dataset()
    reference, reference_state = run(simulation(SequentialExecutor(), data))
    assert float((reference[-1] - reference[0]).abs().max()) > 1e-3  # the run moves
    killed: list[int] = []
    with loopback_cluster() as cluster:
        executor = RayExecutor(workers=2, address=cluster.address, block_bytes=1024)
        executor.local = VectorizedExecutor(
            compiled=False
        )  # a share's task computes for ~0.1 s (compiled: ~5 ms), long enough to be caught
        try:
            got, state = run(simulation(executor, data), lambda: cluster.killer(killed))
            assert listening.public_listeners(cluster.keeper.pid) == []  # the cluster listens on loopback only
        finally:
            executor.close()
        assert killed, "no task was seen computing on a worker node"
        assert not _running(killed[0])
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-13)
        assert state.keys() == reference_state.keys() and state
        for name in state:  # each client's control variate updated once per round it took part in
            assert float(reference_state[name].abs().max()) > 0
            torch.testing.assert_close(state[name], reference_state[name], rtol=0, atol=1e-13)
    assert not ray.is_initialized()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_max_retries_must_be_a_whole_number_of_at_least_zero(bad):
    with pytest.raises(ConfigError) as info:
        RayExecutor(workers=1, max_retries=bad)
    assert info.value.field == "run.ray_retries" and repr(bad) in str(info.value) and "\n" not in str(info.value)
