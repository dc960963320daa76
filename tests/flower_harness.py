"""Helpers of the Flower tests: an in-process grid, the Flower simulation engine in a child process, a local
SuperLink with SuperNodes, and the check that nothing listens outside 127.0.0.0/8.

Run as a script, it runs an experiment on Flower's simulation engine (Ray bound to 127.0.0.1)::

    python tests/flower_harness.py simulate EXPERIMENT OUT NUM_SUPERNODES

and writes OUT/<variant>/seed-<s>/… as the ServerApp does, plus OUT/listening.txt (sockets seen while it ran).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

#: environment of every Flower process the tests start: no telemetry, no update check, private home
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.5",
    "RAY_DEDUP_LOGS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


# -- an in-process grid -------------------------------------------------------------------------------


class FakeGrid:
    """A Grid whose nodes are ClientApps called in this process, one Context (state) per node.

    ``hosts[k]`` names node k's clients (node config ``clients``; None: the clients of its ``data-path`` folder;
    default: node k is ``partition-id=k``).
    ``lose(client)`` drops every reply of that client's node (a node that never answers); ``forget(node)`` wipes
    a node's state (a SuperNode restarted); ``leave(node)`` takes a node offline and ``join(config)`` brings one
    (back) under a new node id; ``sent`` keeps every message pushed. An exception of the
    ClientApp becomes an error reply, as a SuperNode sends it.
    """

    def __init__(
        self,
        client_app,
        num_nodes: int,
        run_config: dict | None = None,
        node_config: Callable[[int], dict] | None = None,
        hosts: list[str] | None = None,
    ) -> None:
        from flwr.app import Context, RecordDict
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = (
            1,
            1,
            1,
        )  # what a ServerApp process is told by its runtime
        self.app = client_app
        self.hosts = hosts

        def config(k: int) -> dict:
            own = (
                ({"clients": hosts[k]} if hosts[k] is not None else {})
                if hosts
                else {"partition-id": k, "num-partitions": num_nodes}
            )
            return {**own, **(node_config(k) if node_config else {})}

        self.contexts = {
            1000 + k: Context(
                run_id=1, node_id=1000 + k, node_config=config(k), state=RecordDict(), run_config=dict(run_config or {})
            )
            for k in range(num_nodes)
        }
        self.run_config = dict(run_config or {})
        self._last_id = max(self.contexts)
        self.sent: list = []
        self.silent: set[int] = set()
        self._replies: dict[str, object] = {}
        self._count = 0

    def node_of(self, client: int) -> int:
        """The node hosting ``client`` (``hosts``: node k hosts the clients its entry names; else node k hosts
        client k)."""
        if not self.hosts:
            return 1000 + client
        from fedshuffle.integrations.flower.common import parse_clients
        from fedshuffle.integrations.flower.nodedata import folder_clients

        def hosted(k: int) -> tuple[int, ...]:
            named = self.hosts[k]
            return (
                parse_clients(named)
                if named is not None
                else folder_clients(Path(self.contexts[1000 + k].node_config["data-path"]))
            )

        return next(1000 + k for k in range(len(self.hosts)) if client in hosted(k))

    def lose(self, partition: int) -> None:
        self.silent.add(self.node_of(partition))

    def forget(self, partition: int) -> None:
        from flwr.app import RecordDict

        self.contexts[self.node_of(partition)].state = RecordDict()

    def leave(self, node: int) -> dict:
        """Node ``node`` goes offline (the SuperLink no longer lists it); returns its node config."""
        return dict(self.contexts.pop(node).node_config)

    def join(self, node_config: dict) -> int:
        """A node (a restarted SuperNode: fresh context) joins with ``node_config`` under a new node id; returns it."""
        from flwr.app import Context, RecordDict

        node = self._last_id = self._last_id + 1
        self.contexts[node] = Context(
            run_id=1, node_id=node, node_config=dict(node_config), state=RecordDict(), run_config=dict(self.run_config)
        )
        return node

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages) -> list[str]:
        from flwr.app import Error, Message

        ids = []
        for message in messages:
            self._count += 1
            message.metadata.__dict__["_message_id"] = f"m{self._count}"
            self.sent.append(message)
            node = message.metadata.dst_node_id
            if node not in self.contexts:  # gone: no reply
                ids.append(message.metadata.message_id)
                continue
            try:
                reply = self.app(message, self.contexts[node])
            except Exception as exc:  # as a SuperNode's runtime answers (flwr.supernode.runtime.run_clientapp)
                reply = Message(Error(2, f"{type(exc)}:<'{exc}'>"), reply_to=message)
            if node not in self.silent:
                self._replies[message.metadata.message_id] = reply
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids) -> list:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages, *, timeout=None) -> list:
        return self.pull_messages(self.push_messages(list(messages)))


# -- processes and sockets ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(root: int) -> set[int]:
    """``root`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def listening(pids: set[int]) -> list[tuple[str, int, str]]:
    """(address, pid, process) of every TCP/UDP socket listening or bound that one of ``pids`` owns (``ss -ltunpH``)."""
    text = subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or "pid=" not in line:
            continue
        local = fields[4]
        for owner in line.split("users:((", 1)[1].split("),("):
            name, pid = owner.split(",")[0].strip('"'), int(owner.split("pid=")[1].split(",")[0])
            if pid in pids:
                out.append((local, pid, name))
    return out


def outside_loopback(sockets: Iterable[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The sockets whose address is not in 127.0.0.0/8 (IPv4-mapped included)."""
    bad = []
    for address, pid, name in sockets:
        host = address.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
        if not host.startswith("127."):
            bad.append((address, pid, name))
    return bad


class SocketWatch:
    """Collects the listening sockets of a process tree, sampled while it runs."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: set[tuple[str, int, str]] = set()

    def sample(self) -> None:
        self.seen.update(listening(descendants(self.root)))

    def sample_until(self, stop: threading.Event, every: float = 1.0) -> None:
        while not stop.wait(every):
            self.sample()
        self.sample()


def run_child(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``argv`` in its own process group for at most ``timeout`` seconds (the group is stopped in any case):
    its exit status and its output (stdout and stderr together)."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        stop_group(process)
    return process.returncode, out.decode(errors="replace")


def stop_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the process's own group, then SIGKILL after ``grace`` seconds."""
    if process.poll() is not None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(5)


def flower_env(home: Path) -> dict[str, str]:
    """This environment with Flower's settings, a private home, and Flower's commands on PATH (the SuperLink
    starts ``flower-superexec`` by name, as from an activated environment)."""
    return {
        **os.environ,
        **FLOWER_ENV,
        "FLWR_HOME": str(home),
        "PATH": os.pathsep.join([str(scripts_dir()), os.environ.get("PATH", "")]),
    }


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A process in its own process group, output to ``log``."""
    with open(log, "ab") as fh:
        return subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def scripts_dir() -> Path:
    return Path(sys.executable).parent


# -- a local SuperLink with SuperNodes ----------------------------------------------------------------


class Federation:
    """A running local federation: the SuperLink's connection name, the environment of Flower commands, and its nodes.

    Node k is a ``flower-supernode`` with node config ``node_configs[k]``; with ``persistent``, it runs with
    ``--isolation process`` beside a long-lived ClientApp process (``python -m fedshuffle.integrations.flower.worker``)
    instead of a ClientApp process per message. Every process has its own process group; :meth:`kill` stops node k's
    processes (SIGKILL: a node that dies without leaving), :meth:`start_node` starts it again (it gets a new node id).
    Unpacks as ``(connection, env, watch, watches)``."""

    def __init__(self, work: Path, port: int, env: dict[str, str], node_configs: list[str], persistent: bool) -> None:
        self.work, self.port, self.env, self.node_configs, self.persistent = work, port, env, node_configs, persistent
        self.connection = "test"
        self.processes: list[subprocess.Popen] = []  # every process started, stopped at the end
        self.nodes: dict[int, list[subprocess.Popen]] = {}
        self.watches: list[SocketWatch] = []

    def __iter__(self):
        return iter((self.connection, self.env, self.watch, self.watches))

    def watch(self) -> None:
        for w in self.watches:
            w.sample()

    def add(self, command: list[str], log: Path) -> subprocess.Popen:
        process = start(command, log, self.env)
        self.processes.append(process)
        self.watches.append(SocketWatch(process.pid))
        return process

    def start_node(self, k: int) -> None:
        bin_dir, runtime_port = scripts_dir(), free_port()
        command = [
            str(bin_dir / "flower-supernode"),
            "--insecure",
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(runtime_port),
            "--node-config",
            self.node_configs[k],
        ]
        if self.persistent:
            command += ["--isolation", "process"]
        self.nodes[k] = [self.add(command, self.work / f"supernode-{k}.log")]
        if self.persistent:
            worker = [
                sys.executable,
                "-m",
                "fedshuffle.integrations.flower.worker",
                "--runtime-api-address",
                f"127.0.0.1:{runtime_port}",
                "--insecure",
                "--supernode-pid",
                str(self.nodes[k][0].pid),
            ]
            self.nodes[k].append(self.add(worker, self.work / f"worker-{k}.log"))

    def kill(self, k: int) -> None:
        for process in self.nodes.pop(k):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(10)

    def stop(self) -> None:
        for p in reversed(self.processes):
            stop_group(p)


@contextmanager
def local_federation(
    work: Path, num_nodes: int, deadline: float, node_configs: list[str] | None = None, persistent: bool = False
):
    """A ``flower-superlink`` and ``num_nodes`` ``flower-supernode`` on free 127.0.0.1 ports, each in its own
    process group, stopped on exit; node k's ``--node-config`` is ``node_configs[k]`` (default: ``partition-id=k``);
    yields the :class:`Federation` (``persistent``: each node with one long-lived ClientApp process)."""
    bin_dir = scripts_dir()
    home = work / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    env = flower_env(home)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    configs = node_configs or [f"partition-id={k} num-partitions={num_nodes}" for k in range(num_nodes)]
    federation = Federation(work, port, env, configs, persistent)
    try:
        link = federation.add(
            [
                str(bin_dir / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
                "--database",
                str(work / "state.db"),
            ],
            work / "superlink.log",
        )
        _wait_port(port, deadline, link, work / "superlink.log")
        for k in range(num_nodes):
            federation.start_node(k)
        yield federation
    finally:
        federation.stop()


def _wait_port(port: int, deadline: float, process: subprocess.Popen, log: Path) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"flower-superlink exited ({process.returncode}): {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError("flower-superlink did not open its port in time")


def server_log(run_id: int, connection: str, env: dict[str, str], timeout: float) -> str:
    """The ServerApp's log of run ``run_id`` (``flwr log --show``)."""
    return flwr(["log", str(run_id), connection, "--show"], env, timeout).stdout


def flwr(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(scripts_dir() / "flwr"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=max(timeout, 1.0),
        start_new_session=True,
    )


def run_app(
    app_dir: Path,
    connection: str,
    env: dict[str, str],
    run_config: str,
    done: Callable[[], bool],
    deadline: float,
    watch: Callable[[], None],
    run_ids: list[int] | None = None,
) -> tuple[str, float]:
    """``flwr run APP CONNECTION -c …``, then wait until ``done()`` (the ServerApp's results are written; files are
    cheaper to poll than ``flwr ls``, which is asked every 15 s so that a failed run ends the wait) and return the
    run's status as ``flwr ls`` gives it, and the seconds until ``done()``; the run's id is appended to ``run_ids``."""
    started = time.monotonic()
    submitted = flwr(
        ["run", str(app_dir), connection, "--run-config", run_config, "--format", "json"],
        env,
        deadline - time.monotonic(),
    )
    if submitted.returncode != 0:
        raise RuntimeError(f"flwr run failed: {submitted.stdout}\n{submitted.stderr}")
    run_id = json.loads(submitted.stdout)["run-id"]
    if run_ids is not None:
        run_ids.append(run_id)

    def status() -> str:
        listed = flwr(["ls", connection, "--run-id", str(run_id), "--format", "json"], env, deadline - time.monotonic())
        return str(json.loads(listed.stdout)["runs"][0].get("status", "")) if listed.returncode == 0 else ""

    asked, elapsed = time.monotonic(), None
    while time.monotonic() < deadline:
        watch()
        if elapsed is None and done():
            elapsed = time.monotonic() - started
        if elapsed is not None or time.monotonic() - asked > 15:
            asked, current = time.monotonic(), status()
            if current.startswith("finished"):
                return current, elapsed if elapsed is not None else time.monotonic() - started
        time.sleep(0.5 if elapsed is None else 2.0)
    raise TimeoutError(f"run {run_id} did not finish in time")


# -- the Flower simulation engine, as a child process -------------------------------------------------


def simulate(experiment: str, out: str, num_supernodes: int) -> None:
    """Run ``experiment`` on Flower's simulation engine as the README says (``fedshuffle.integrations.flower.simulate``:
    Ray on 127.0.0.1, here with two CPUs), results into ``out``; no Ray setting comes from the environment."""
    os.environ.update(FLOWER_ENV)
    for key in [k for k in os.environ if k.startswith("RAY_") and k not in FLOWER_ENV]:
        del os.environ[key]
    from fedshuffle.integrations.flower import simulate as run

    out_dir = Path(out)
    watch = SocketWatch(os.getpid())
    settings = {"out": str(out_dir), "round-timeout": 120.0}
    started, stop = time.monotonic(), threading.Event()
    sampler = threading.Thread(target=watch.sample_until, args=(stop,), daemon=True)
    sampler.start()
    try:
        run(experiment, num_supernodes, settings, cpus=2)
    finally:
        stop.set()
        sampler.join()
    (out_dir / "listening.json").write_text(json.dumps(sorted(watch.seen)))
    (out_dir / "seconds.json").write_text(json.dumps(time.monotonic() - started))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "simulate":
        simulate(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(__doc__)
