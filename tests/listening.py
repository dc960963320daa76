"""Which TCP sockets a process tree listens on, read from /proc (Linux): no extra dependency.

A listening socket is a row of /proc/net/tcp or /proc/net/tcp6 in state 0A (LISTEN); it belongs to
a process when one of the process's file descriptors links to ``socket:[inode]``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from pathlib import Path

PROC = Path("/proc")


def available() -> bool:
    return (PROC / "net" / "tcp").is_file()


def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    tree, stack = set(), [root]
    while stack:
        pid = stack.pop()
        tree.add(pid)
        stack.extend(children.get(pid, []))
    return tree


def _socket_owners(pids: set[int]) -> dict[int, int]:
    owners = {}
    for pid in pids:
        try:
            fds = os.listdir(PROC / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(PROC / str(pid) / "fd" / fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                owners[int(target[8:-1])] = pid
    return owners


def _address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    if family == socket.AF_INET:
        return socket.inet_ntop(family, raw[::-1])
    return socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening(pids: set[int], namespace_of: int | None = None) -> list[tuple[str, int, int]]:
    """``(address, port, pid)`` of every TCP socket in LISTEN state held by one of ``pids``; the sockets are read
    in this process's network namespace, or in that of process ``namespace_of`` (one started by ``unshare -n``)."""
    owners = _socket_owners(pids)
    found = []
    net = PROC / "net" if namespace_of is None else PROC / str(namespace_of) / "net"
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = net / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or int(fields[9]) not in owners:
                continue
            addr, port = fields[1].split(":")
            found.append((_address(addr, family), int(port, 16), owners[int(fields[9])]))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address (::ffff:127.x.y.z)."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def public_listeners(root: int | None = None) -> list[tuple[str, int, int]]:
    """The listening sockets of ``root``'s process tree (default: this process) outside loopback."""
    return [s for s in listening(process_tree(root or os.getpid())) if not is_loopback(s[0])]


class Watch:
    """Polls :func:`public_listeners` of this process tree every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.seen = interval, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="listening-watch")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.seen.update((a, p) for a, p, _ in public_listeners())
            except (OSError, ValueError):
                continue

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
