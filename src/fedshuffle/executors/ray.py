"""The Ray executor: a cohort split across Ray workers, each share run by the vectorized executor.

Network exposure. An unauthenticated Ray cluster executes any code sent to it, so a *local* Ray (no
``run.ray_address``) is started listening on the loopback interface only: ``address="local"`` (never
joins a cluster named by ``RAY_ADDRESS`` or started by ``ray start``), its own temporary folder, no
dashboard, and Ray's "local cluster" mode, in which every Ray service (GCS, raylet, object manager,
agents, workers) binds 127.0.0.1 instead of every interface. Ray has no public switch for that mode: it
is the ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` environment variable, read when Ray is imported, so it
is set for the services Ray spawns and Ray's constant is set for this process; the started node's
address is checked afterwards and anything but 127.0.0.1 stops Ray with an error.

Joining a cluster (``run.ray_address``): the address is checked when the executor is built — a TCP connection (5 s),
then a
throw-away Ray driver in a child process (at most :data:`CONNECT_TIMEOUT` s, killed after) — so an
unreachable or non-Ray address fails in seconds with one line instead of Ray's minutes of retries.

Data. A dataset held in memory is put in Ray's object store once, in blocks of consecutive clients
(:class:`ClientBlocks`, at most :data:`BLOCK_BYTES` each unless one client is larger); each round, a
task receives the blocks of its own share's clients only, with its plans' rows renumbered into them, so
what a round moves grows with the share, not with the dataset. A dataset generated on demand
(:class:`~fedshuffle.data.LazyFederatedDataset`, a few arrays and a generator) is put whole.

Losing a worker or a node. A task whose worker process or node dies is run again, on any node left, up to
``max_retries`` times (Ray's task retries; an exception raised by the local work itself is not retried:
it would be raised again). A retry gives the same numbers, because a task is a pure function of what it
is sent (the plans carry every random choice, the start and step chain are the broadcast, the blocks are
the clients' samples) and changes nothing: it returns the share's updates Δ_i, and the driver alone
applies them to the model and to the clients' state, once, after every task of the round has answered.
The data blocks survive the loss of any node but the driver's: objects made by ``ray.put`` cannot be
rebuilt by lineage, but their primary copy lives in the object store of the driver's node and is owned
by the driver, so a node that dies loses only the copies it had fetched, and a retried task fetches
the blocks again from the driver's node. Losing the driver's node (or the head's, which holds the
cluster's control store) ends the run.

Workers and the driver. A Ray started or joined here gets a ``runtime_env`` with the driver's ``FEDSHUFFLE_*``
environment variables (data folders, caches, limits: :func:`runtime_env`); nothing is installed on the nodes. Every
task carries the driver's fedshuffle, NumPy and PyTorch versions, and a worker whose versions differ refuses it
in one line naming the package and both versions (:func:`check_versions`): another NumPy or PyTorch computes
other numbers.

Every Ray instance this executor starts (or connects) is shut down by :meth:`RayExecutor.close`, at
garbage collection, or at exit; a Ray that was already initialized in the process is left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fedshuffle.core.errors import ClusterError, ConfigError
from fedshuffle.data import FederatedDataset, LazyFederatedDataset
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.local.loop import LocalWork
from fedshuffle.local.plan import ClientPlan
from fedshuffle.problems import Problem

LOOPBACK = "127.0.0.1"
LOCAL_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: bytes of samples per block of consecutive clients in Ray's object store (a larger client is a block of its own)
BLOCK_BYTES = 1 << 18
#: times a task is run again when its worker process or node dies (Ray's default)
MAX_RETRIES = 3
#: seconds an address may take to answer as a Ray cluster (TCP check plus a probe driver)
CONNECT_TIMEOUT = 25.0
#: packages whose versions a Ray worker must share with the driver
PINNED = ("fedshuffle", "numpy", "torch")
#: the driver's environment variables a Ray worker gets (by this prefix)
CARRIED_ENV = "FEDSHUFFLE_"
_ADDRESS = re.compile(r"^(?:ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-_]+):(\d{1,5})$")
#: addresses that answered as a Ray cluster in this process (probed once)
_ANSWERED: set[str] = set()
_PROBE = (
    "import sys, ray\n"
    "ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False, configure_logging=False)\n"
    "ray.shutdown()\n"
)


class RayExecutor:
    """The cohort split into ``workers`` shares, each run by the vectorized executor in a Ray task.

    The dataset is put in Ray's object store once, by blocks of clients (module docstring); each round
    ships the local work (plans, starts, step chain) and each task gets the blocks of its own clients.
    Because plans carry every random choice, the result is the vectorized (and sequential) result
    whatever the number of workers or nodes.
    ``address`` joins a running cluster (``ray start --head`` on one node, ``ray start
    --address=HEAD:6379`` on the others, then ``address = "auto"`` or ``"HEAD:6379"``); ``None`` starts
    a local Ray bound to 127.0.0.1 (module docstring). Full local gradients (FedShuffleMVR's broadcast)
    are computed in the driver, vectorized. ``block_bytes`` sizes the blocks of clients the data is put in.
    ``max_retries``: how many times a task whose worker or node dies is run again (module docstring:
    the numbers are those of a run without failure); 0 makes such a loss fail the run.
    Use as a context manager or call :meth:`close`.
    """

    name = "ray"

    def __init__(
        self,
        workers: int = 2,
        address: str | None = None,
        chunk_size: int | None = None,
        memory_budget: int = 1 << 30,
        block_bytes: int = BLOCK_BYTES,
        max_retries: int = MAX_RETRIES,
    ) -> None:
        if workers < 1:
            raise ConfigError("run.ray_workers", f"must be >= 1, got {workers}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigError(
                "run.ray_retries", f"expected a whole number >= 0 of times a task is run again, got {max_retries!r}"
            )
        self.address = _check_address(address)
        try:
            import ray
        except ImportError:
            raise ConfigError("run.executor", "the Ray executor needs Ray: pip install 'fedshuffle[ray]'") from None
        if self.address is not None and not ray.is_initialized():
            probe_cluster(self.address)  # a bad address is bad input: found while building, before any run
        self._ray = ray
        self.workers, self.block_bytes, self.max_retries = workers, block_bytes, max_retries
        self.versions = package_versions()
        self.local = VectorizedExecutor(chunk_size, memory_budget)
        self._data: tuple[weakref.ref, ClientBlocks | Any] | None = None
        self._task = None
        self._finalizer: weakref.finalize | None = None

    def _start(self):
        ray = self._ray
        if not ray.is_initialized():
            try:
                if self.address is None:
                    temp_dir = start_local_ray(ray, self.workers)
                else:
                    with _loopback_only(ray) if _is_loopback(self.address) else nullcontext():
                        ray.init(
                            address=self.address,
                            include_dashboard=False,
                            log_to_driver=False,
                            configure_logging=False,
                            runtime_env=runtime_env() or None,
                        )
                    temp_dir = None
            except Exception as exc:  # noqa: BLE001  (Ray's errors are many: a raylet that died, a timeout...)
                raise ClusterError(f"Ray did not start ({_first_line(exc)})") from None
            self._finalizer = weakref.finalize(self, stop_local_ray, ray, temp_dir)
            self._data, self._task = None, None
        if self._task is None:
            self._task = ray.remote(max_retries=self.max_retries, retry_exceptions=False)(_run_share)
        return self._task

    def close(self) -> None:
        """Shut down the Ray this executor started (and remove its temporary folder); idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self._data, self._task = None, None

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stored(self, data: FederatedDataset | LazyFederatedDataset) -> ClientBlocks | Any:
        """The dataset in the object store (put on first use): its client blocks, or a reference to a lazy dataset."""
        if (
            self._data is None or self._data[0]() is not data
        ):  # the object itself: an id can be reused once a dataset is freed
            stored = (
                self._ray.put(data)
                if isinstance(data, LazyFederatedDataset)
                else ClientBlocks.put(self._ray, data, self.block_bytes)
            )
            self._data = (weakref.ref(data), stored)
        return self._data[1]

    def run(self, problem, data, work, weights=None):
        if weights is not None:  # the shares come back stacked; summed here
            return weights @ self.run(problem, data, work) if work.plans else work.start.new_zeros(work.start.shape[-1])
        if not work.plans:
            return work.start.new_zeros((0, work.start.shape[-1]))
        task = self._start()
        stored = self._stored(data)
        shares = [s for s in np.array_split(np.arange(len(work)), min(self.workers, len(work))) if len(s)]
        if isinstance(stored, ClientBlocks):
            futures = []
            for share in shares:
                blocks, plans = stored.share([work.plans[i] for i in share])
                futures.append(
                    task.remote(
                        self.local, problem, work.subset(share, plans), self.versions, *[stored.refs[b] for b in blocks]
                    )
                )
        else:
            futures = [task.remote(self.local, problem, work.subset(share), self.versions, stored) for share in shares]
        try:
            return torch.cat(self._ray.get(futures))
        except self._ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ClusterError):  # a worker refused: its one line, not the worker's traceback
                raise ClusterError(str(cause)) from None
            raise

    def client_gradients(self, problem, data, params, clients):
        return self.local.client_gradients(problem, data, params, clients)


@dataclass(frozen=True)
class ClientBlocks:
    """A dataset's samples in Ray's object store, put once, by blocks of consecutive clients.

    ``refs[b]`` holds block b's ``(features, labels)`` as NumPy arrays (read without a copy by the tasks on the
    node), its clients' rows one client after another; dataset row j is row ``position[j]`` of block
    ``block_of_row[j]``; ``rows[b]`` is block b's number of rows.
    """

    refs: list
    rows: np.ndarray
    block_of_client: np.ndarray
    block_of_row: np.ndarray
    position: np.ndarray

    @classmethod
    def put(cls, ray: Any, data: FederatedDataset, block_bytes: int = BLOCK_BYTES) -> ClientBlocks:
        """Cut ``data`` into blocks of consecutive clients of at most ``block_bytes`` (or one client) and put each."""
        row_bytes = data.features[:1].nbytes + data.labels[:1].nbytes
        block_of_client = np.empty(data.num_clients, dtype=np.int64)
        block, filled = 0, 0
        for i, size in enumerate(data.sizes.tolist()):
            if filled and filled + size * row_bytes > block_bytes:
                block, filled = block + 1, 0
            block_of_client[i], filled = block, filled + size * row_bytes
        block_of_row = np.full(len(data.features), -1, dtype=np.int64)  # −1: a row no client owns
        position = np.full(len(data.features), -1, dtype=np.int64)
        refs, rows = [], np.zeros(block + 1, dtype=np.int64)
        for b, clients in enumerate(
            np.split(np.arange(data.num_clients), np.flatnonzero(np.diff(block_of_client)) + 1)
        ):
            own = np.concatenate([data.client_indices[i] for i in clients])
            block_of_row[own], position[own], rows[b] = b, np.arange(len(own)), len(own)
            index = torch.from_numpy(own).to(data.features.device)
            refs.append(ray.put((data.features[index].cpu().numpy(), data.labels[index].cpu().numpy())))
        return cls(refs, rows, block_of_client, block_of_row, position)

    def share(self, plans: Sequence[ClientPlan]) -> tuple[np.ndarray, list[ClientPlan]]:
        """The blocks holding the clients of ``plans``, and the plans with their rows numbered in those blocks
        laid end to end (padding −1 kept)."""
        blocks = np.unique(self.block_of_client[[p.client for p in plans]])
        start = np.zeros(len(self.refs), dtype=np.int64)
        start[blocks] = np.cumsum(self.rows[blocks]) - self.rows[blocks]
        renumbered = []
        for plan in plans:
            rows = plan.batches.clip(min=0)
            renumbered.append(
                replace(
                    plan, batches=np.where(plan.batches >= 0, start[self.block_of_row[rows]] + self.position[rows], -1)
                )
            )
        return blocks, renumbered


@dataclass(frozen=True)
class ShareSamples:
    """The samples of a share's blocks, laid end to end: all a vectorized executor's ``run`` reads of its data."""

    features: torch.Tensor
    labels: torch.Tensor


def runtime_env() -> dict[str, Any]:
    """The ``runtime_env`` of a Ray this executor starts or joins: the driver's ``FEDSHUFFLE_*`` environment
    variables (empty when there are none); no packages (every node has its own, :func:`check_versions`)."""
    carried = {name: value for name, value in os.environ.items() if name.startswith(CARRIED_ENV)}
    return {"env_vars": carried} if carried else {}


def package_versions() -> dict[str, str]:
    """The versions of :data:`PINNED` in this process (fedshuffle's as installed; "unknown" from a bare source tree)."""
    from importlib import metadata

    try:
        own = metadata.version("fedshuffle")
    except metadata.PackageNotFoundError:
        own = "unknown"
    return {"fedshuffle": own, "numpy": np.__version__, "torch": torch.__version__}


def check_versions(driver: Mapping[str, str], worker: Mapping[str, str] | None = None, node: str = "") -> None:
    """Refuse in one line (:class:`ClusterError`) a worker whose fedshuffle, NumPy or PyTorch (``worker``; default
    this process') differs from the ``driver``'s, naming the package and both versions."""
    worker = package_versions() if worker is None else worker
    for name in PINNED:
        if worker.get(name) != driver.get(name):
            where = f" on {node}" if node else ""
            raise ClusterError(
                f"a Ray worker{where} has {name} {worker.get(name)}, the driver {name} "
                f"{driver.get(name)}: install the driver's {name} on every node"
            )


def _run_share(
    executor: VectorizedExecutor, problem: Problem, work: LocalWork, versions: Mapping[str, str], *stored: Any
) -> torch.Tensor:
    """A share's local work on its own clients' blocks (or on the lazy dataset, generated where it runs), once the
    worker's versions are found equal to the driver's ``versions``."""
    check_versions(versions, node=socket.gethostname())
    if len(stored) == 1 and isinstance(stored[0], LazyFederatedDataset):
        return executor.run(problem, stored[0], work)
    device = work.start.device
    features = torch.from_numpy(np.concatenate([block[0] for block in stored])).to(device)
    labels = torch.from_numpy(np.concatenate([block[1] for block in stored])).to(device)
    return executor.run(problem, ShareSamples(features, labels), work)


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc`` with its type (at most 300 characters): what one line can say of Ray's errors."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def _check_address(address: str | None) -> str | None:
    """``None`` (local Ray), ``"auto"``, ``HOST:PORT`` or ``ray://HOST:PORT``; anything else is refused."""
    if address is None:
        return None
    if not isinstance(address, str) or not address.strip():
        raise ConfigError(
            "run.ray_address",
            f"expected 'auto', HOST:PORT or ray://HOST:PORT (or leave it unset for a local Ray), got {address!r}",
        )
    address = address.strip()
    if address == "auto":
        return address
    match = _ADDRESS.match(address)
    if not match or not 1 <= int(match.group(2)) <= 65535:
        raise ConfigError(
            "run.ray_address", f"expected 'auto', HOST:PORT or ray://HOST:PORT with a port in 1..65535, got {address!r}"
        )
    return address


def _is_loopback(address: str) -> bool:
    """Whether ``HOST:PORT`` names this machine's loopback interface (then the driver binds it too)."""
    match = _ADDRESS.match(address)
    host = match.group(1).strip("[]") if match else ""
    return host == "localhost" or host == "::1" or host.startswith("127.")


@contextmanager
def _loopback_only(ray: Any) -> Iterator[None]:
    """Ray's local-cluster mode while a local Ray starts: every service binds 127.0.0.1."""
    from ray._private import ray_constants  # no public switch exists; see the module docstring

    saved_env, saved_flag = os.environ.get(LOCAL_CLUSTER_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOCAL_CLUSTER_ENV] = "0"  # inherited by the services and workers Ray spawns
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOCAL_CLUSTER_ENV, None)
        else:
            os.environ[LOCAL_CLUSTER_ENV] = saved_env


def _short_temp_dir() -> str:
    """A fresh folder for Ray's session files; short, since Ray's Unix sockets live under it (≤ 107 bytes)."""
    base = tempfile.gettempdir()
    if len(base) > 40 and os.path.isdir("/tmp"):
        base = "/tmp"
    return tempfile.mkdtemp(prefix="fsray-", dir=base)


def start_local_ray(ray: Any, workers: int) -> str:
    """Start a new local Ray with ``workers`` CPUs, listening on 127.0.0.1 only; returns its temporary folder."""
    temp_dir = _short_temp_dir()
    try:
        with _loopback_only(ray):
            ray.init(
                address="local",
                num_cpus=workers,
                _node_ip_address=LOOPBACK,
                _temp_dir=temp_dir,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                runtime_env=runtime_env() or None,
            )
        node_ip = ray.util.get_node_ip_address()
    except BaseException:
        stop_local_ray(ray, temp_dir)
        raise
    if node_ip != LOOPBACK:
        stop_local_ray(ray, temp_dir)
        raise RuntimeError(
            f"the local Ray started on {node_ip}, not on {LOOPBACK}; refusing to run a Ray reachable from the network"
        )
    return temp_dir


def stop_local_ray(ray: Any, temp_dir: str | None) -> None:
    """Shut Ray down in this process and remove the temporary folder :func:`start_local_ray` made (if any)."""
    try:
        ray.shutdown()
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def probe_cluster(address: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Fail within ``timeout`` seconds, with one line, unless a Ray cluster answers at ``address``.

    ``HOST:PORT`` must accept a TCP connection (5 s); then a throw-away driver (a child process in its
    own session, killed on timeout) must connect and disconnect. ``auto`` skips the TCP check (Ray finds
    the address of the cluster started on this machine).
    """
    if address in _ANSWERED:
        return
    if address != "auto":
        host, port = _ADDRESS.match(address).groups()  # type: ignore[union-attr]
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout)):
                pass
        except OSError as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
            raise ConfigError(
                "run.ray_address",
                f"cannot reach a Ray cluster at {address} ({reason}); start one with `ray start --head`, or leave "
                "ray_address unset for a local Ray",
            ) from None
    env = {
        **os.environ,
        "RAY_gcs_server_port_wait_time_s": "1",
        "RAY_gcs_rpc_server_connect_timeout_s": "5",
        "RAY_gcs_rpc_server_reconnect_timeout_s": "5",
    }
    if _is_loopback(address):
        env[LOCAL_CLUSTER_ENV] = "0"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROBE, address],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ConfigError("run.ray_address", f"no Ray cluster answered at {address} within {timeout:.0f} s") from None
    finally:
        _kill_group(proc)
    if proc.returncode != 0:
        lines = [line.strip() for line in (err or "").splitlines() if line.strip()]
        reason = next(
            (line for line in reversed(lines) if re.match(r"^[\w.]+(Error|Exception): ", line)),
            "it does not answer as a Ray cluster (GCS)",
        )
        raise ConfigError("run.ray_address", f"no Ray cluster at {address}: {reason[:300]}")
    _ANSWERED.add(address)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the probe and everything it started (its own session), then reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    proc.wait()
