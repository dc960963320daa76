"""The multi-node Ray recipe of docs/deploy/ray.md, as written, listens on loopback only: its head and worker node
are started in the recipe's network namespace, and every socket listening in that namespace is reachable from
127.0.0.1 alone (a loopback address, or a wildcard in a namespace whose only interface is loopback).

The recipe's run and its ``ray stop`` (which would stop every Ray on the machine) are left out: once both nodes
are up the sockets are read, and every process in the namespace is killed."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import listening
import pytest

pytest.importorskip("ray", reason="the recipe starts Ray")
pytestmark = pytest.mark.skipif(not listening.available(), reason="reads listening sockets from /proc (Linux)")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "ray.md"
#: seconds the two nodes may take to start (a loaded machine)
START_SECONDS = 300
WILDCARDS = {"0.0.0.0", "::"}


def recipe() -> tuple[list[str], list[str]]:
    """The page's namespace recipe: the command that makes the namespace (``bash -c`` for its ``bash <<'EOF'``) and
    the lines it runs."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.DOTALL) if "unshare" in b]
    first, *lines, last = block.strip().splitlines()
    assert first.endswith(" bash <<'EOF'") and last == "EOF", block
    return [*shlex.split(first.removesuffix(" <<'EOF'")), "-c"], [line.strip() for line in lines if line.strip()]


def can_unshare(command: list[str]) -> bool:
    if not shutil.which(command[0]):
        return False
    probe = subprocess.run([*command, "ip link set lo up"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def namespace_members(link: str) -> list[int]:
    """The processes in the network namespace ``link`` (``net:[inode]``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") == link:
                    members.append(int(entry.name))
    return members


def listening_in(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in the network namespace of ``pid``, whoever holds it."""
    found = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path(f"/proc/{pid}/net/{name}")
        for line in path.read_text().splitlines()[1:] if path.is_file() else []:
            fields = line.split()
            if fields[3] == "0A":
                address, port = fields[1].split(":")
                found.add((listening._address(address, family), int(port, 16)))
    return found


def interfaces(pid: int) -> set[str]:
    return {line.split(":")[0].strip() for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]}


def test_the_multi_node_ray_recipe_listens_on_loopback_only():
    unshare, lines = recipe()
    assert [line.split(" --")[0] for line in lines if line.startswith("ray start")] == ["ray start", "ray start"]
    assert any("--head" in line for line in lines) and any("--address=127.0.0.1" in line for line in lines)
    if not can_unshare(unshare):
        pytest.skip(f"{' '.join(unshare)} is not allowed here (no network or user namespaces)")
    script = "\n".join(line for line in lines if not line.startswith(("fedshuffle run", "ray stop")))
    temp = tempfile.mkdtemp(prefix="fsrec-", dir="/tmp")  # Ray's sockets live under it: short
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
        "TMPDIR": temp,  # no Ray setting
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    script = f"readlink /proc/$$/ns/net\n{script}\necho started\nread line\n"  # its namespace first: the cleanup
    proc = subprocess.Popen(
        [*unshare, script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    own, link = os.readlink("/proc/self/ns/net"), ""
    try:
        timer = threading.Timer(START_SECONDS, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        output = []
        try:
            for line in proc.stdout:
                output.append(line)
                if not link and line.startswith("net:["):
                    link = line.strip()
                if line.strip() == "started":
                    break
        finally:
            timer.cancel()
        assert output and output[-1].strip() == "started", "".join(output)[-3000:]
        seen, only = listening_in(proc.pid), interfaces(proc.pid)
    finally:
        for pid in namespace_members(link) if link and link != own else []:  # the recipe's processes only
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)
    assert link != own
    assert only == {"lo"}, only
    assert 6379 in {port for _, port in seen} and len(seen) >= 4, seen  # the GCS, the raylets, the agents
    assert [s for s in seen if not (listening.is_loopback(s[0]) or s[0] in WILDCARDS)] == [], seen
