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

Every download is bounded (:data:`LIMITS`): a time-out to connect and one for each read, a total
deadline after which the connection is shut down whatever the server does, a size cap (the file's
known size plus a margin, or :attr:`DownloadLimits.max_bytes`), and a few tries of what may be
transient (time-outs, resets, truncated or garbled replies, HTTP 5xx). Whatever fails ends in one
:class:`~fedshuffle.core.errors.DataError` naming the URL and where to put the file by hand.

A file that also ships inside another one (TFF's HDF5 files inside their ``.tar.bz2``, a gzip copy)
is found by :func:`locate_derived`: the file itself first, then any of its sources, which is unpacked
into the cache and checked against the file's own SHA-256.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import lzma
import os
import socket
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fedshuffle.core.errors import ConfigError, DataError
from fedshuffle.core.limits import human

CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    """One file of a dataset: where it lives officially (``url``; empty when there is no official
    download) and what it must hash to. ``dataset`` is its folder, e.g. ``"mnist"`` or ``"shakespeare/tff"``."""

    dataset: str
    name: str
    url: str
    sha256: str  #: empty when only the archive the file ships in has a published checksum
    size: int = 0  #: bytes of the official file; 0 when unknown (then the cap is DownloadLimits.max_bytes)


@dataclass(frozen=True)
class DownloadLimits:
    """The bounds of every download and unpacking (module-wide :data:`LIMITS`; tests shrink them)."""

    connect_timeout: float = 30.0  #: seconds to open the connection (and the TLS handshake)
    read_timeout: float = 60.0  #: seconds one read may wait for data
    deadline: float = 1800.0  #: seconds the whole download (every try) may take, at least ...
    min_rate: float = 256 << 10  #: ... or size / min_rate for a file of known size, when that is longer
    attempts: int = 3  #: tries of a transient failure (time-out, reset, truncated or garbled reply, HTTP 5xx)
    backoff: float = 2.0  #: seconds before the second try, doubled before each next one
    max_bytes: int = 1 << 30  #: cap of a file whose size is not known (every registered file is smaller)
    margin: float = (
        0.05  #: a file of known size may be this much larger (a mirror's other copy; the checksum decides) ...
    )
    slack: int = 1 << 20  #: ... plus this many bytes

    def cap(self, remote: RemoteFile) -> int:
        """The most bytes ``remote`` may have, downloaded or unpacked."""
        return int(remote.size * (1 + self.margin)) + self.slack if remote.size else self.max_bytes

    def total_seconds(self, remote: RemoteFile) -> float:
        return max(self.deadline, remote.size / self.min_rate)


LIMITS = DownloadLimits()


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
    hint = (
        ""
        if os.environ.get("FEDSHUFFLE_DATA")
        else "; $FEDSHUFFLE_DATA is not set (export FEDSHUFFLE_DATA=<the folder holding it>)"
    )
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
            "The file is truncated, corrupted or not the official copy; delete it to download again, or set "
            "data.verify = false to use it anyway.",
        )
    return path


def _find_local(remote: RemoteFile, extra_dirs: Sequence[str | Path], verify: bool) -> Path | None:
    """``remote`` in a data folder or the cache (checked), or ``None``."""
    cached = cache_dir() / remote.dataset / remote.name
    for candidate in [
        p for folder in data_dirs(extra_dirs) for p in (folder / remote.dataset / remote.name, folder / remote.name)
    ] + [cached]:
        if candidate.is_file():
            return _check(candidate, remote) if verify else candidate
    return None


def _url_problem(url: str) -> str | None:
    """Why ``url`` cannot be downloaded from (not http(s)://host/...), or ``None``."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number in 0-65535)
    except ValueError as exc:
        return f"not a valid URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http:// or https:// URL with a host"
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        return "the URL holds spaces or control characters"
    return None


def _url(remote: RemoteFile, mirror: str | None) -> str:
    """Where ``remote`` is downloaded from: the mirror's ``<dataset>/<file>``, else its official URL ('' if none)."""
    if mirror := mirror or os.environ.get("FEDSHUFFLE_MIRROR"):
        if problem := _url_problem(mirror):
            raise ConfigError(
                "data.mirror",
                f"{mirror!r} is {problem}; give the base URL of a server holding <dataset>/<file>, e.g. "
                "https://host/fedshuffle (also $FEDSHUFFLE_MIRROR)",
            )
        return f"{mirror.rstrip('/')}/{remote.dataset}/{remote.name}"
    return remote.url


def _nowhere(names: Sequence[RemoteFile], extra_dirs: Sequence[str | Path], why: str) -> DataError:
    first = names[0]
    alternatives = f" (or {', '.join(r.name for r in names[1:])})" if len(names) > 1 else ""
    remedy = (
        "set data.download = true"
        if why == "downloading is off"
        else "set data.mirror to a server holding <dataset>/<file>"
    )
    return DataError(
        first.name,
        f"{first.dataset}/{first.name}{alternatives} is not in "
        f"{', '.join(map(str, data_dirs(extra_dirs))) or 'any data folder'} nor in the cache "
        f"{cache_dir()}, and {why}. Put the file in a folder named by data.data_dirs or $FEDSHUFFLE_DATA (as "
        f"<folder>/{first.dataset}/<file>), or {remedy}",
    )


def locate(
    remote: RemoteFile,
    *,
    extra_dirs: Sequence[str | Path] = (),
    download: bool = True,
    verify: bool = True,
    timeout: float | None = None,
    mirror: str | None = None,
) -> Path:
    """The local path of ``remote``: found in a data folder or the cache, or downloaded into the cache
    (``timeout``: seconds each read may wait, default :data:`LIMITS`'s)."""
    if found := _find_local(remote, extra_dirs, verify):
        return found
    if not download:
        raise _nowhere([remote], extra_dirs, "downloading is off")
    url = _url(remote, mirror)
    if not url:
        raise _nowhere([remote], extra_dirs, "it has no official download")
    return _download(remote, cache_dir() / remote.dataset / remote.name, verify, timeout, url)


#: makes a wanted file from a source file: ``derive(source, out, limit)`` writes ``out``, at most ``limit`` bytes
Derive = Callable[[Path, Path, int], None]

#: what a damaged compressed file raises while it is read
DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError, ValueError)


def copy_bounded(src: IO[bytes], dst: IO[bytes], limit: int, where: str) -> int:
    """Copy ``src`` to ``dst`` in chunks, refusing (naming ``where``) more than ``limit`` bytes: a
    decompression bomb stops at the limit instead of filling the disk. Returns the bytes copied."""
    copied = 0
    while chunk := src.read(min(CHUNK, limit + 1 - copied)):
        copied += len(chunk)
        if copied > limit:
            raise DataError(
                where,
                f"unpacks to more than {human(limit)}, more than the file it should hold; a damaged or hostile file",
            )
        dst.write(chunk)
    return copied


def gunzip(source: Path, out: Path, limit: int = LIMITS.max_bytes) -> None:
    """The content of a gzip file (at most ``limit`` bytes)."""
    try:
        with gzip.open(source, "rb") as src, open(out, "wb") as dst:
            copy_bounded(src, dst, limit, str(source))
    except DataError:
        raise
    except DECOMPRESSION_ERRORS as exc:
        raise DataError(str(source), f"not a valid gzip file ({exc})") from None


def tar_member(member: str) -> Derive:
    """A :data:`Derive` that extracts the archive member named ``member`` (any compression tarfile reads)."""

    def extract(source: Path, out: Path, limit: int = LIMITS.max_bytes) -> None:
        try:
            with tarfile.open(source) as archive:
                for info in archive:  # one pass: compressed archives cannot seek back cheaply
                    if info.isfile() and Path(info.name).name == member:
                        if info.size > limit:
                            raise DataError(
                                f"{source}:{info.name}",
                                f"the archive declares {human(info.size)}, more than the {human(limit)} the file may "
                                "have",
                            )
                        with archive.extractfile(info) as src, open(out, "wb") as dst:
                            copy_bounded(src, dst, limit, f"{source}:{info.name}")
                        return
        except DataError:
            raise
        except (tarfile.TarError, *DECOMPRESSION_ERRORS) as exc:
            raise DataError(
                str(source), f"not a readable archive ({' '.join(str(exc).split()) or type(exc).__name__})"
            ) from None
        raise DataError(str(source), f"the archive has no member {member!r}")

    return extract


def _derive(source: Path, derive: Derive, target: RemoteFile, verify: bool) -> Path:
    out = cache_dir() / target.dataset / target.name
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        derive(source, tmp, LIMITS.cap(target))
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
    target: RemoteFile,
    sources: Sequence[tuple[RemoteFile, Derive]],
    *,
    extra_dirs: Sequence[str | Path] = (),
    download: bool = True,
    verify: bool = True,
    timeout: float | None = None,
    mirror: str | None = None,
) -> Path:
    """The local path of ``target``, a file that can also be made from one of ``sources`` (e.g. unpacked from an
    archive).

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
    raise _nowhere(
        [target, *(r for r, _ in sources)],
        extra_dirs,
        "no download succeeded" + (f" ({'; '.join(failures)})" if failures else ""),
    )


class _Watchdog:
    """Shuts the sockets of a download down once its deadline passes, so that no read (a server sending
    one byte a second, headers that never end) waits beyond it; ``expired`` says it did."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _opener(watchdog: _Watchdog, read_timeout: float) -> urllib.request.OpenerDirector:
    """urllib's opener (redirects, proxies) whose connections time out and are watched by ``watchdog``."""

    def watched(base: type[http.client.HTTPConnection]) -> type[http.client.HTTPConnection]:
        class Connection(base):  # type: ignore[valid-type,misc]
            def connect(self) -> None:
                self.timeout = LIMITS.connect_timeout
                super().connect()
                self.sock.settimeout(read_timeout)
                watchdog.watch(self.sock)

        return Connection

    plain, secure = watched(http.client.HTTPConnection), watched(http.client.HTTPSConnection)

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(plain, req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(secure, req, context=self._context)

    return urllib.request.build_opener(Http, Https)


class _Failure(Exception):
    """One try failed: ``reason`` (one line); ``transient`` failures are tried again."""

    def __init__(self, reason: str, transient: bool) -> None:
        super().__init__(reason)
        self.reason, self.transient = reason, transient


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _fetch(url: str, out: IO[bytes], cap: int, watchdog: _Watchdog, read_timeout: float) -> None:
    """One try: the body of ``url`` into ``out`` (at most ``cap`` bytes), or :class:`_Failure`."""
    try:
        with _opener(watchdog, read_timeout).open(url, timeout=read_timeout) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.strip().isdigit() and int(declared) > cap:
                raise _Failure(
                    f"the server announces {human(int(declared))}, more than the {human(cap)} the file may have", False
                )
            read = getattr(response, "read1", response.read)
            received = 0
            while chunk := read(CHUNK):
                received += len(chunk)
                if received > cap:
                    raise _Failure(f"the server sent more than the {human(cap)} the file may have", False)
                out.write(chunk)
            if declared.strip().isdigit() and received != int(declared):
                raise _Failure(f"incomplete: {received} of the {int(declared)} bytes announced", True)
    except urllib.error.HTTPError as exc:
        exc.close()
        raise _Failure(
            f"HTTP {exc.code} {' '.join(str(exc.reason).split())}", exc.code >= 500 or exc.code in (408, 429)
        ) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        permanent = isinstance(reason, (ConnectionRefusedError, socket.gaierror)) or not isinstance(reason, OSError)
        raise _Failure(
            _one_line(reason) if isinstance(reason, BaseException) else " ".join(str(reason).split()), not permanent
        ) from None
    except (
        http.client.HTTPException,
        OSError,
    ) as exc:  # garbled status line, too many or too long headers, truncated, reset, time-out
        raise _Failure(_one_line(exc), not isinstance(exc, ConnectionRefusedError)) from None
    except ValueError as exc:  # a URL urllib cannot use
        raise _Failure(_one_line(exc), False) from None
    if watchdog.expired:
        raise _Failure("the deadline passed", False)


def _download(remote: RemoteFile, target: Path, verify: bool, timeout: float | None, url: str | None = None) -> Path:
    """``url`` (default: the official one) into ``target`` through a temporary file, verified; every try
    bounded by :data:`LIMITS`. Any failure is one :class:`DataError` naming the URL and where to put the file."""
    url = url or remote.url
    where_by_hand = (
        f"download {url} by hand and put it at {target}, or in a folder named by data.data_dirs or $FEDSHUFFLE_DATA "
        f"(as <folder>/{remote.dataset}/{remote.name})"
    )
    if problem := _url_problem(url):
        raise DataError(url, f"could not download {remote.dataset}/{remote.name}: {problem}; {where_by_hand}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    seconds, tries = LIMITS.total_seconds(remote), 0
    start = time.monotonic()
    try:
        with os.fdopen(fd, "wb") as out, _Watchdog(seconds) as watchdog:
            while True:
                tries += 1
                out.seek(0)
                out.truncate()
                try:
                    _fetch(url, out, LIMITS.cap(remote), watchdog, LIMITS.read_timeout if timeout is None else timeout)
                    break
                except _Failure as failure:
                    if watchdog.expired:
                        failure = _Failure(
                            f"no complete file within the {seconds:g} s deadline ({failure.reason})", False
                        )
                    pause = LIMITS.backoff * 2 ** (tries - 1)
                    if not failure.transient or tries >= LIMITS.attempts or time.monotonic() + pause - start >= seconds:
                        tried = f" after {tries} tries" if tries > 1 else ""
                        raise DataError(
                            url,
                            f"could not download {remote.dataset}/{remote.name}{tried} ({failure.reason}); "
                            f"{where_by_hand}",
                        ) from None
                    time.sleep(pause)
        if verify:
            _check(tmp, remote)
        os.replace(tmp, target)
    except OSError as exc:  # the cache cannot be written
        raise DataError(
            str(target), f"could not save {remote.dataset}/{remote.name} ({_one_line(exc)}); {where_by_hand}"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target
