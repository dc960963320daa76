"""Finding a dataset file: local data folders first, then the cache, then the official source.

A data file or folder named by a config's ``data.path`` is found by :func:`resolve_data_path`: relative to
the config file's folder, then the working directory, the data folders and the cache (it has no
download; registered files below do).

A registered file is looked up, in order, in

1. the folders of ``data_dirs`` (a setting) and of the environment variable ``FEDSHUFFLE_DATA``
   (``os.pathsep``-separated), as ``<dir>/<dataset>/<file>`` or ``<dir>/<file>``;
2. the cache, ``$FEDSHUFFLE_CACHE`` or ``$XDG_CACHE_HOME/fedshuffle`` or ``~/.cache/fedshuffle``;
3. the official URL (or ``<mirror>/<dataset>/<file>`` when a mirror is set, by the ``data.mirror``
   setting or ``$FEDSHUFFLE_MIRROR``), downloaded into the cache (temporary file, verify, rename).

Every file found or downloaded is checked against its SHA-256; a mismatch (a truncated download, a
different copy) is an error that names the file, unless the caller turns verification off.

A file that also ships inside another one (TFF's HDF5 files inside their ``.tar.bz2``, a gzip copy)
is found by :func:`locate_derived`: the file itself first, then any of its sources, which is unpacked
into the cache and checked against the file's own SHA-256.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import gzip
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedshuffle.core.errors import ConfigError, DataError

CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    """One file of a dataset: where it lives officially (``url``; empty when there is no official
    download) and what it must hash to. ``dataset`` is its folder, e.g. ``"mnist"`` or ``"shakespeare/tff"``."""

    dataset: str
    name: str
    url: str
    sha256: str  #: empty when only the archive the file ships in has a published checksum


def cache_dir() -> Path:
    if env := os.environ.get("FEDSHUFFLE_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedshuffle"


def data_dirs(extra: Sequence[str | Path] = ()) -> list[Path]:
    env = [p for p in os.environ.get("FEDSHUFFLE_DATA", "").split(os.pathsep) if p]
    return [Path(p).expanduser() for p in [*extra, *env]]


def data_path_candidates(path: str | Path, extra_dirs: Sequence[str | Path] = ()) -> list[Path]:
    """Where a relative ``data.path`` is looked for, in order: the working directory (a value given on
    the command line or in a dict; :func:`~fedshuffle.experiments.schema.load_experiment` has already
    tried the config file's folder), each data folder (``data.data_dirs``, ``$FEDSHUFFLE_DATA``), the cache."""
    path = Path(path).expanduser()
    if path.is_absolute():
        return [path]
    return [path, *(folder / path for folder in data_dirs(extra_dirs)), cache_dir() / path]


def find_data_path(path: str | Path, extra_dirs: Sequence[str | Path] = ()) -> Path | None:
    """The first of :func:`data_path_candidates` that exists, or ``None``."""
    return next((p for p in data_path_candidates(path, extra_dirs) if p.exists()), None)


def resolve_data_path(path: str | Path, extra_dirs: Sequence[str | Path] = ()) -> Path:
    """``data.path`` as found by :func:`find_data_path`; an error naming every place looked in when it is nowhere
    (an absolute path is left to the loader, whose error names the file)."""
    found = find_data_path(path, extra_dirs)
    if found is not None or Path(path).expanduser().is_absolute():
        return found or Path(path).expanduser()
    cwd, *others = data_path_candidates(path, extra_dirs)
    places = ", ".join([f"the working directory ({Path.cwd() / cwd})", *map(str, others)])
    hint = "" if os.environ.get("FEDSHUFFLE_DATA") else "; $FEDSHUFFLE_DATA is not set (export FEDSHUFFLE_DATA=<the folder holding it>)"
    raise ConfigError("path", f"{path} not found; looked in the config file's folder, then {places}{hint}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check(path: Path, remote: RemoteFile) -> Path:
    if not remote.sha256:  # no published checksum of the file itself (e.g. one shipped inside a checked archive)
        return path
    actual = sha256_of(path)
    if actual != remote.sha256:
        raise DataError(
            str(path),
            f"checksum mismatch for {remote.dataset}/{remote.name}: expected sha256 {remote.sha256}, got {actual}. "
            "The file is truncated, corrupted or not the official copy; delete it to download again, or set data.verify = false to use it anyway.",
        )
    return path


def _find_local(remote: RemoteFile, extra_dirs: Sequence[str | Path], verify: bool) -> Path | None:
    """``remote`` in a data folder or the cache (checked), or ``None``."""
    cached = cache_dir() / remote.dataset / remote.name
    for candidate in [p for folder in data_dirs(extra_dirs) for p in (folder / remote.dataset / remote.name, folder / remote.name)] + [cached]:
        if candidate.is_file():
            return _check(candidate, remote) if verify else candidate
    return None


def _url(remote: RemoteFile, mirror: str | None) -> str:
    """Where ``remote`` is downloaded from: the mirror's ``<dataset>/<file>``, else its official URL ('' if none)."""
    mirror = mirror or os.environ.get("FEDSHUFFLE_MIRROR")
    return f"{mirror.rstrip('/')}/{remote.dataset}/{remote.name}" if mirror else remote.url


def _nowhere(names: Sequence[RemoteFile], extra_dirs: Sequence[str | Path], why: str) -> DataError:
    first = names[0]
    alternatives = f" (or {', '.join(r.name for r in names[1:])})" if len(names) > 1 else ""
    remedy = "set data.download = true" if why == "downloading is off" else "set data.mirror to a server holding <dataset>/<file>"
    return DataError(
        first.name,
        f"{first.dataset}/{first.name}{alternatives} is not in {', '.join(map(str, data_dirs(extra_dirs))) or 'any data folder'} nor in the cache "
        f"{cache_dir()}, and {why}. Put the file in a folder named by data.data_dirs or $FEDSHUFFLE_DATA (as <folder>/{first.dataset}/<file>), or {remedy}",
    )


def locate(
    remote: RemoteFile, *, extra_dirs: Sequence[str | Path] = (), download: bool = True, verify: bool = True, timeout: float = 60.0, mirror: str | None = None
) -> Path:
    """The local path of ``remote``: found in a data folder or the cache, or downloaded into the cache."""
    if found := _find_local(remote, extra_dirs, verify):
        return found
    if not download:
        raise _nowhere([remote], extra_dirs, "downloading is off")
    url = _url(remote, mirror)
    if not url:
        raise _nowhere([remote], extra_dirs, "it has no official download")
    return _download(remote, cache_dir() / remote.dataset / remote.name, verify, timeout, url)


#: makes a wanted file from a source file: ``derive(source, out)`` writes ``out``
Derive = Callable[[Path, Path], None]


def gunzip(source: Path, out: Path) -> None:
    """The content of a gzip file."""
    try:
        with gzip.open(source, "rb") as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(str(source), f"not a valid gzip file ({exc})") from None


def tar_member(member: str) -> Derive:
    """A :data:`Derive` that extracts the archive member named ``member`` (any compression tarfile reads)."""

    def extract(source: Path, out: Path) -> None:
        try:
            with tarfile.open(source) as archive:
                for info in archive:  # one pass: compressed archives cannot seek back cheaply
                    if info.isfile() and Path(info.name).name == member:
                        with archive.extractfile(info) as src, open(out, "wb") as dst:
                            shutil.copyfileobj(src, dst, CHUNK)
                        return
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise DataError(str(source), f"not a readable archive ({exc})") from None
        raise DataError(str(source), f"the archive has no member {member!r}")

    return extract


def _derive(source: Path, derive: Derive, target: RemoteFile, verify: bool) -> Path:
    out = cache_dir() / target.dataset / target.name
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        derive(source, tmp)
        if verify:
            try:
                _check(tmp, target)
            except DataError as exc:
                raise DataError(str(source), f"{target.name} made from it: {exc.message}") from None
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def locate_derived(
    target: RemoteFile, sources: Sequence[tuple[RemoteFile, Derive]], *, extra_dirs: Sequence[str | Path] = (), download: bool = True,
    verify: bool = True, timeout: float = 60.0, mirror: str | None = None,
) -> Path:
    """The local path of ``target``, a file that can also be made from one of ``sources`` (e.g. unpacked from an archive).

    In order: ``target`` in a data folder or the cache; a source in a data folder or the cache,
    unpacked into the cache; then, if downloading is on, ``target`` and each source in turn from its
    URL (the mirror's, or the official one where there is one). What is unpacked is checked against
    ``target``'s SHA-256 before it is kept.
    """
    if found := _find_local(target, extra_dirs, verify):
        return found
    for remote, derive in sources:
        if path := _find_local(remote, extra_dirs, verify):
            return _derive(path, derive, target, verify)
    if not download:
        raise _nowhere([target, *(r for r, _ in sources)], extra_dirs, "downloading is off")
    failures = []
    for remote, derive in [(target, None), *sources]:
        if not (url := _url(remote, mirror)):
            continue
        try:
            path = _download(remote, cache_dir() / remote.dataset / remote.name, verify, timeout, url)
        except DataError as exc:
            if "checksum mismatch" in exc.message:
                raise
            failures.append(exc.message)
            continue
        return path if derive is None else _derive(path, derive, target, verify)
    raise _nowhere([target, *(r for r, _ in sources)], extra_dirs, "no download succeeded" + (f" ({'; '.join(failures)})" if failures else ""))


def _download(remote: RemoteFile, target: Path, verify: bool, timeout: float, url: str | None = None) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url or remote.url, timeout=timeout) as response:  # noqa: S310 (official https URL or a user-set mirror)
            shutil.copyfileobj(response, out, CHUNK)
        if verify:
            _check(tmp, remote)
        os.replace(tmp, target)
    except (urllib.error.URLError, OSError) as exc:
        raise DataError(
            url or remote.url,
            f"could not download {remote.dataset}/{remote.name} ({getattr(exc, 'reason', exc)}). "
            f"If this machine is offline, copy the file to {target} or to a folder named in FEDSHUFFLE_DATA.",
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target
