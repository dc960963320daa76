"""Finding a dataset file: local data folders first, then the cache, then the official source.

A file is looked up, in order, in

1. the folders of ``data_dirs`` (a setting) and of the environment variable ``FEDSHUFFLE_DATA``
   (``os.pathsep``-separated), as ``<dir>/<dataset>/<file>`` or ``<dir>/<file>``;
2. the cache, ``$FEDSHUFFLE_CACHE`` or ``$XDG_CACHE_HOME/fedshuffle`` or ``~/.cache/fedshuffle``;
3. the official URL, downloaded into the cache (write to a temporary file, verify, rename).

Every file found or downloaded is checked against its SHA-256; a mismatch (a truncated download, a
different copy) is an error that names the file, unless the caller turns verification off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedshuffle.core.errors import DataError

CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    """One file of a dataset: where it lives officially and what it must hash to."""

    dataset: str
    name: str
    url: str
    sha256: str


def cache_dir() -> Path:
    if env := os.environ.get("FEDSHUFFLE_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedshuffle"


def data_dirs(extra: Sequence[str | Path] = ()) -> list[Path]:
    env = [p for p in os.environ.get("FEDSHUFFLE_DATA", "").split(os.pathsep) if p]
    return [Path(p).expanduser() for p in [*extra, *env]]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check(path: Path, remote: RemoteFile) -> Path:
    actual = sha256_of(path)
    if actual != remote.sha256:
        raise DataError(
            str(path),
            f"checksum mismatch for {remote.dataset}/{remote.name}: expected sha256 {remote.sha256}, got {actual}. "
            "The file is truncated, corrupted or not the official copy; delete it to download again, or set data.verify = false to use it anyway.",
        )
    return path


def locate(remote: RemoteFile, *, extra_dirs: Sequence[str | Path] = (), download: bool = True, verify: bool = True, timeout: float = 60.0) -> Path:
    """The local path of ``remote``: found in a data folder or the cache, or downloaded into the cache."""
    for folder in data_dirs(extra_dirs):
        for candidate in (folder / remote.dataset / remote.name, folder / remote.name):
            if candidate.is_file():
                return _check(candidate, remote) if verify else candidate
    cached = cache_dir() / remote.dataset / remote.name
    if cached.is_file():
        return _check(cached, remote) if verify else cached
    if not download:
        raise DataError(remote.name, f"{remote.dataset}/{remote.name} is not in {', '.join(map(str, data_dirs(extra_dirs))) or 'any data folder'} nor in the cache {cache_dir()}, and downloading is off")
    return _download(remote, cached, verify, timeout)


def _download(remote: RemoteFile, target: Path, verify: bool, timeout: float) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(remote.url, timeout=timeout) as response:  # noqa: S310 (official https URL or a user-set mirror)
            shutil.copyfileobj(response, out, CHUNK)
        if verify:
            _check(tmp, remote)
        os.replace(tmp, target)
    except (urllib.error.URLError, OSError) as exc:
        raise DataError(
            remote.url,
            f"could not download {remote.dataset}/{remote.name} ({getattr(exc, 'reason', exc)}). "
            f"If this machine is offline, copy the file to {target} or to a folder named in FEDSHUFFLE_DATA.",
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target
