"""Atomic file writes (temporary file, fsync, rename), through which every file the project writes goes,
and reads of results files that refuse what a results folder never holds (links, FIFOs, devices).

Files are created with mode ``0o666`` less the process's umask, as ``open`` creates them (``0o644``
under the usual umask 022), so that collaborators can read a run where the user lets them.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import numpy as np


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new file ``.<name>.<random>.tmp`` beside ``path``, opened for writing, with the umask's permissions."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free name for a temporary file", str(path.parent))


def check_regular(path: Path) -> None:
    """Refuse (an ``OSError`` saying why) a path that exists and is a symbolic link or not a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, "a symbolic link, which a results folder never holds; remove it", str(path))
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, f"not a regular file ({special_kind(mode)}); remove it", str(path))


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_kind(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file ("a FIFO", "a folder", ...), else ``None``."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """A file descriptor of ``path`` opened with ``flags``, refusing a symbolic link or a special file before
    anything is read or written (never blocking on a FIFO)."""
    check_regular(path)
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        found = os.fstat(fd).st_mode
        if not stat.S_ISREG(found):
            raise OSError(errno.EINVAL, f"not a regular file ({special_kind(found)}); remove it", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file; a link, FIFO, device or folder is an ``OSError`` (see :func:`open_regular`)."""
    with os.fdopen(open_regular(path), "rb") as fh:
        return fh.read()


def read_text(path: Path) -> str:
    """:func:`read_regular`, decoded as UTF-8."""
    return read_regular(path).decode()


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
