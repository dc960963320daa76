"""Results folders that know what they hold: folder names, config hashes, the manifest, the lock.

A results folder ``OUT`` written by ``fedshuffle run`` or ``fedshuffle sweep``::

    OUT/
      manifest.json        kind (run | sweep), the experiment, its variants' settings, every run with its config hash
      .lock                held (fcntl.flock) by the one process writing the folder
      [<point>/][<variant>/]seed-<s>/config.json    the run's settings, config hash and data-file hashes

A run's *identity* is its resolved settings without those that cannot change its numbers
(:data:`NEUTRAL`: plot, sinks, where Ray runs, how often to checkpoint, the bandwidth of the simulated
wall-clock) and without ``run.rounds`` (a run may be extended, see :func:`check_run_folder`); the
file or folder named by ``data.path`` enters by the SHA-256 of its content, not by its name.
Continuing a run with another identity is refused with the settings that differ.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.core.io import open_regular, read_text, write_json
from fedshuffle.data.sources.fetch import find_data_path

MANIFEST, LOCK = "manifest.json", ".lock"
#: files of a results folder that a variant or grid-point folder must not shadow
RESERVED = frozenset({MANIFEST, LOCK, "summary.json", "sweep.json", "plot.png", "plot.pdf"})
#: settings that do not change a run's numbers, by section ("*": the whole section)
NEUTRAL: dict[str, set[str] | str] = {
    "plot": "*",
    "run": {
        "sinks",  # where the metrics also go (and each sink's own settings: _neutral)
        "checkpoint_every",
        "checkpoint_seconds",
        "ray_address",
        "ray_retries",
        "bandwidth_mib_s",
    },
    "data": {"data_dirs", "download", "verify"},
}
#: settings that name files, compared by content
FILE_SETTINGS = (("data", "path"),)
MAX_NAME = 96
#: folders below a results folder deeper than this are not searched for runs (a results folder nests 4 at most)
MAX_DEPTH = 16


# -- folder names -----------------------------------------------------------------------------------


def folder_name(text: str) -> str:
    """A folder name for a label or grid point: lower case, letters (any script), digits, ``_ . -``.

    ``"Fed Avg"`` → ``fed-avg``; a name with nothing left (``".."``, ``"+++"``) becomes ``v-<hash>``,
    and one longer than :data:`MAX_NAME` keeps its start and a hash of the whole text.
    """
    name = re.sub(r"[^\w.-]+", "-", unicodedata.normalize("NFKC", text)).strip("-.").lower()
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    if not name:
        return f"v-{digest}"
    return name if len(name) <= MAX_NAME else f"{name[: MAX_NAME - 9]}-{digest}"


def unique_folders(texts: Sequence[str], what: str, field: str) -> dict[str, str]:
    """text → :func:`folder_name`, refusing a text given twice, two texts sharing a folder, and reserved names."""
    names: dict[str, str] = {}
    owner: dict[str, str] = {}
    for text in texts:
        if text in names:
            raise ConfigError(field, f"{what} {text!r} is given twice; every {what} needs its own name")
        name = folder_name(text)
        if name in owner:
            raise ConfigError(
                field,
                f"{what}s {owner[name]!r} and {text!r} would share the results folder {name!r}; rename one of them",
            )
        if name in RESERVED or re.fullmatch(r"seed-\d+", name):
            raise ConfigError(
                field, f"{what} {text!r} would use the folder name {name!r}, which results files use; rename it"
            )
        names[text], owner[name] = name, text
    return names


# -- identity -----------------------------------------------------------------------------------------

_FILE_HASHES: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _FILE_HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        _FILE_HASHES[key] = digest.hexdigest()
    return _FILE_HASHES[key]


def content_hash(path: Path) -> str | None:
    """SHA-256 of a file, or of a folder's files (relative names and contents); None if absent or unreadable."""
    try:
        if path.is_file():
            return _file_sha256(path)
        if path.is_dir():
            digest = hashlib.sha256()
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                digest.update(f"{file.relative_to(path).as_posix()}\0{_file_sha256(file)}\n".encode())
            return digest.hexdigest()
    except OSError:
        return None
    return None


def data_hashes(spec: Mapping[str, Any]) -> dict[str, str]:
    """``{"data.path": sha256, ...}`` for the files the settings name (missing files are left to the loader)."""
    out = {}
    for section, key in FILE_SETTINGS:
        value = spec.get(section, {}).get(key)
        found = (
            find_data_path(value, spec.get("data", {}).get("data_dirs", ()))
            if isinstance(value, str) and value
            else None
        )
        if found is not None:  # where the loader finds it (working directory, data folders, cache)
            digest = content_hash(found)
            if digest is not None:
                out[f"{section}.{key}"] = digest
    return out


def experiment_root(run_dir: Path) -> Path:
    """The results folder a run belongs to: the nearest folder above it with a manifest, else its parent."""
    run_dir = Path(run_dir).resolve()
    return next((p for p in run_dir.parents if (p / MANIFEST).is_file()), run_dir.parent)


def _neutral(section: str) -> set[str] | str:
    """The settings of ``section`` that do not change a run's numbers: :data:`NEUTRAL`'s and, in ``run``, every metric
    sink's own settings (:data:`~fedshuffle.experiments.sinks.SINKS`)."""
    neutral = NEUTRAL.get(section, set())
    if section != "run" or neutral == "*":
        return neutral
    from fedshuffle.experiments.sinks import SINKS

    return {*neutral, *(s for entry in SINKS.entries() for s in entry.setting_names())}


def identity(spec: Mapping[str, Any], hashes: Mapping[str, str] | None = None, *, seed: bool = True) -> dict[str, Any]:
    """The settings that decide a run's numbers, flat (``"local.lr": 0.1``), with file contents by hash."""
    flat: dict[str, Any] = {}
    for section, settings in spec.items():
        neutral = _neutral(section)
        if neutral == "*" or not isinstance(settings, Mapping):
            continue
        for key, value in settings.items():
            if (
                key in neutral
                or (section, key) == ("run", "rounds")
                or (not seed and (section, key) == ("run", "seed"))
            ):
                continue
            flat[f"{section}.{key}"] = value
    for name, digest in (hashes or {}).items():
        flat[name] = f"sha256:{digest}"
    return flat


def config_hash(flat: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def _not_taken(flat: Mapping[str, Any]) -> set[str]:
    """``run.<setting>`` for the executors' settings that the run's executor does not take: identities written before
    each executor declared its own settings hold them all, at their defaults; they are compared as absent."""
    from fedshuffle.executors import EXECUTORS

    name = flat.get("run.executor")
    if not isinstance(name, str) or name not in EXECUTORS:
        return set()
    every = {s for e in EXECUTORS.entries() for s in e.setting_names()}
    return {f"run.{s}" for s in every - set(EXECUTORS[name].setting_names())}


def differences(stored: Mapping[str, Any], wanted: Mapping[str, Any], limit: int = 6) -> list[str]:
    """``["local.lr: 0.01 there, 0.02 now", ...]`` for the settings that differ (at most ``limit``, then a count)."""
    stored, wanted = ({k: v for k, v in flat.items() if k not in _not_taken(flat)} for flat in (stored, wanted))
    keys = sorted(k for k in set(stored) | set(wanted) if stored.get(k, "(unset)") != wanted.get(k, "(unset)"))

    def show(value: Any) -> str:
        text = json.dumps(value, default=str) if not isinstance(value, str) or value == "(unset)" else repr(value)
        return text if len(text) <= 40 else text[:37] + "..."

    lines = [f"{k}: {show(stored.get(k, '(unset)'))} there, {show(wanted.get(k, '(unset)'))} now" for k in keys[:limit]]
    if len(keys) > limit:
        lines.append(f"and {len(keys) - limit} more")
    return lines


# -- one run folder -----------------------------------------------------------------------------------

#: a finished run's files, whose SHA-256 its ``summary.json`` keeps
OUTPUTS = ("metrics.csv", "metrics.parquet", "final_params.npy")


def file_sha256(path: Path) -> str | None:
    """SHA-256 of a file as it is now (never cached); None when it cannot be read."""
    try:
        digest = hashlib.sha256()
        with os.fdopen(open_regular(path), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    except OSError:
        return None


def _plain(obj: Any) -> Any:
    item = getattr(obj, "item", None)
    return item() if callable(item) else str(obj)


def _check(doc: Mapping[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps({k: v for k, v in doc.items() if k != "check"}, sort_keys=True).encode()
    ).hexdigest()


def sealed(summary: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    """``summary`` as ``summary.json`` holds it: with the SHA-256 of the run's files (:data:`OUTPUTS`) and a
    ``check`` of everything else, so that a finished run whose files changed is never taken as finished."""
    doc = json.loads(
        json.dumps({**summary, "files": {name: file_sha256(Path(run_dir) / name) for name in OUTPUTS}}, default=_plain)
    )
    doc["check"] = _check(doc)
    return doc


def seal_problem(run_dir: Path, summary: Mapping[str, Any]) -> tuple[Path, str] | None:
    """None when a finished run's ``metrics.csv`` matches the seal in its ``summary`` (as read from ``summary.json``),
    else the file to blame and what is wrong with it."""
    if intact(run_dir, ("metrics.csv",)) is not None:
        return None
    if "check" in summary:
        return (
            Path(run_dir) / "metrics.csv",
            "changed after the run finished (the SHA-256 in summary.json no longer matches it or the summary)",
        )
    return (
        Path(run_dir) / "summary.json",
        "not sealed (it holds no SHA-256 of the run's files), so the run's metrics.csv may have been changed",
    )


def intact(run_dir: Path, names: Sequence[str] = OUTPUTS) -> dict[str, Any] | None:
    """The summary of a finished run if it and its files ``names`` are as the run wrote them, else None
    (missing, damaged, changed, or written before summaries were sealed)."""
    try:
        doc = json.loads(read_text(Path(run_dir) / "summary.json"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if (
        not isinstance(doc, dict)
        or doc.get("check") != _check(doc)
        or not isinstance(doc.get("files"), dict)
        or not isinstance(doc.get("final"), dict)
    ):
        return None
    if any(doc["files"].get(name) is None or file_sha256(Path(run_dir) / name) != doc["files"][name] for name in names):
        return None
    return doc


def read_json(path: Path, what: str) -> Any:
    """A JSON file of a results folder; damage (or a link, FIFO or device in its place) is a one-line error naming
    the file."""
    try:
        return json.loads(read_text(path))
    except OSError as exc:
        raise ConfigError(
            str(path), f"unreadable {what} ({exc.strerror or exc}); restore it or start the run again in another folder"
        ) from None
    except (ValueError, RecursionError) as exc:  # undecodable bytes, bad JSON, a number past Python's 4,300-digit limit
        raise ConfigError(
            str(path),
            f"unreadable {what} ({exc.__class__.__name__}: {exc}); restore it or start the run again in another folder",
        ) from None


def read_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` where there is none to read (missing, unreadable, not JSON, not an
    object, a number past Python's 4,300-digit limit): for what is read only to describe a folder."""
    try:
        value = json.loads(read_text(path))
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def find_files(root: Path, name: str, max_depth: int = MAX_DEPTH) -> list[Path]:
    """The files called ``name`` below ``root`` (itself included), sorted; links are not followed.

    Searched level by level without recursion; a folder nested deeper than ``max_depth`` below ``root``,
    and the root of the filesystem, are refused with one line (no results folder is either)."""
    root = Path(root)
    if root.resolve() == Path(root.resolve().anchor):
        raise ConfigError(
            str(root), "the root of the filesystem is not a results folder; give the folder that --out named"
        )
    found, level = [], [root]
    for depth in range(max_depth + 1):
        below = []
        for folder in level:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue  # unreadable or vanished: holds no runs we can read
            for entry in entries:
                if entry.name == name and not entry.is_dir(follow_symlinks=False):
                    found.append(Path(entry.path))
                elif entry.is_dir(follow_symlinks=False):
                    below.append(Path(entry.path))
        if not below:
            return sorted(found)
        level = below
    raise ConfigError(
        str(level[0]),
        f"folders nested more than {max_depth} levels below {root}, deeper than any results folder; remove them or "
        "give the results folder itself",
    )


def stored_run(run_dir: Path) -> dict[str, Any] | None:
    """A run folder's ``config.json`` (None when the run has not started)."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return None
    saved = read_json(path, "run config")
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("spec"), dict)
        or not isinstance(saved["spec"].get("run"), dict)
    ):
        raise ConfigError(
            str(path),
            "not a run config (expected an object with 'spec'); restore it or start the run again in another folder",
        )
    rounds = saved["spec"]["run"].get("rounds", 0)
    if type(rounds) is not int or rounds < 0:
        raise ConfigError(
            str(path),
            f"run.rounds is {rounds!r}, not a whole number of rounds; restore the file or start the run again in "
            "another folder",
        )
    return saved


def check_run_folder(run_dir: Path, spec: Mapping[str, Any], hashes: Mapping[str, str], *, extend: bool) -> int | None:
    """Whether ``spec`` may continue the run in ``run_dir``: returns the rounds it was asked for (None: a new run).

    Refuses another identity (listing the settings that differ), and another ``run.rounds`` unless
    ``extend`` and more rounds than before — and not even then with a step schedule, whose milestones
    are fractions of the run: a run extended to N rounds would not be the run asked for N rounds.
    """
    saved = stored_run(run_dir)
    if saved is None:
        return None
    if isinstance(saved.get("data_hashes"), dict):
        there, now = identity(saved["spec"], saved["data_hashes"]), identity(spec, hashes)
    else:  # written before data hashes were kept: the settings only
        there, now = identity(saved["spec"]), identity(spec)
    diff = differences(there, now)
    if diff:
        raise ConfigError(
            "--resume",
            f"{run_dir} holds a run with other settings ({'; '.join(diff)}); give the same config to continue it, or "
            "another --out for the new one",
        )
    before, wanted = int(saved["spec"]["run"].get("rounds", 0)), int(spec["run"]["rounds"])
    if wanted == before:
        return before
    if not extend:
        raise ConfigError(
            "run.rounds",
            f"{run_dir} was asked for {before} rounds, the config asks for {wanted}; to continue it to {wanted} "
            f"rounds give --extend-to {wanted}",
        )
    if wanted < before:
        raise ConfigError(
            "--extend-to",
            f"{run_dir} already has {before} rounds; a run cannot be shortened (its files hold every round so far)",
        )
    if spec.get("schedule", {}).get("name") == "step":
        raise ConfigError(
            "--extend-to",
            f"schedule.name = 'step' puts its milestones at fractions of run.rounds, so {run_dir} extended to "
            f"{wanted} rounds "
            f"would not be the run asked for {wanted} rounds from the start; run it again with another --out",
        )
    return before


# -- the whole folder -----------------------------------------------------------------------------------


def read_manifest(out: Path) -> dict[str, Any] | None:
    path = Path(out) / MANIFEST
    if not path.exists():
        return None
    manifest = read_json(path, "manifest")
    variants = manifest.get("variants", {}) if isinstance(manifest, dict) else None
    runs = manifest.get("runs") if isinstance(manifest, dict) else None
    if (
        not isinstance(runs, dict)
        or not isinstance(variants, dict)
        or not all(isinstance(v, dict) for v in variants.values())
    ):
        raise ConfigError(
            str(path),
            "not a fedshuffle manifest (expected an object with 'variants' and 'runs'); restore it or give another "
            "folder",
        )
    return manifest


def check_no_links(out: Path, run_dir: Path) -> None:
    """Refuse a symbolic link among the folders from ``out`` down to ``run_dir``: fedshuffle makes them all,
    never as links, and one would let a run write outside ``out``."""
    path = Path(out)
    for part in Path(run_dir).relative_to(out).parts:
        path = path / part
        if path.is_symlink():
            raise ConfigError(
                str(path),
                "a symbolic link, which a results folder never holds (the run would be written where it points); "
                "remove it",
            )


def existing_runs(out: Path) -> list[str]:
    """Run folders under ``out`` (holding ``config.json``), relative, as POSIX paths."""
    return sorted(p.parent.relative_to(out).as_posix() for p in find_files(Path(out), "config.json"))


def check_folder(
    out: Path, *, kind: str, variants: Mapping[str, Mapping[str, Any]], runs: Iterable[str], resume: bool
) -> dict[str, Any] | None:
    """Whether ``out`` may take these runs; returns its manifest (None for a new folder).

    * a folder written by the other command (``run`` vs ``sweep``) is refused;
    * the experiment's variants (labels and settings apart from the grid, seeds and rounds) must be
      those recorded, so one folder never holds two experiments;
    * ``run --resume`` also refuses a folder holding runs this config does not ask for (a sweep
      started again may leave out points or seeds it ran before).
    """
    manifest = read_manifest(out)
    if manifest is not None:
        if manifest.get("kind") != kind:
            other = "fedshuffle sweep" if manifest.get("kind") == "sweep" else "fedshuffle run"
            raise ConfigError(
                "--out" if kind == "sweep" else "--resume", f"{out} holds the results of `{other}`; give another folder"
            )
        stored = manifest.get("variants") or {}
        if set(stored) != set(variants):
            there, now = [v for v in stored if v not in variants], [v for v in variants if v not in stored]
            parts = ([f"variants only there: {', '.join(map(repr, there))}"] if there else []) + (
                [f"variants only in the config: {', '.join(map(repr, now))}"] if now else []
            )
            raise ConfigError(
                "--resume" if kind == "run" else "--out",
                f"{out} holds another experiment ({'; '.join(parts)}); give the same config, or another folder",
            )
        for label, flat in variants.items():
            diff = differences(stored[label], flat)
            if diff:
                where = f"variant {label!r}: " if label else ""
                raise ConfigError(
                    "--resume" if kind == "run" else "--out",
                    f"{out} holds another experiment ({where}{'; '.join(diff)}); give the same config, or another "
                    "folder",
                )
    if resume and kind == "run":
        foreign = sorted(set(existing_runs(out)) - set(runs))
        if foreign:
            shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
            raise ConfigError(
                "--resume",
                f"{out} holds runs this config does not ask for ({shown}); give the config, seeds and options it was "
                "run with",
            )
    return manifest


def write_manifest(
    out: Path,
    previous: Mapping[str, Any] | None,
    *,
    kind: str,
    experiment: str,
    variants: Mapping[str, Any],
    runs: Mapping[str, Mapping[str, Any]],
) -> None:
    """The manifest, keeping the runs recorded before (a sweep started again with other points)."""
    recorded = dict((previous or {}).get("runs", {}))
    recorded.update(runs)
    write_json(
        Path(out) / MANIFEST,
        {"format": 1, "kind": kind, "experiment": experiment, "variants": dict(variants), "runs": recorded},
    )


# -- lock and leftovers -------------------------------------------------------------------------------


class FolderLock:
    """An exclusive ``flock`` on ``folder/.lock`` (created with the folder): one writer per folder.

    A second process gets :class:`ResultsError` naming the holder's pid. The lock ends with the
    process, however it ends; the file stays (removing it would let two processes lock two files).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.fd: int | None = None

    def __enter__(self) -> FolderLock:
        path = self.folder / LOCK
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = open_regular(path, os.O_RDWR | os.O_CREAT)  # never through a link, never a FIFO
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EINVAL):
                raise ResultsError(f"cannot lock {path}: {exc.strerror}") from None
            raise ResultsError(f"cannot write to {self.folder} ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise ResultsError(
                    f"{self.folder} is being written by another fedshuffle "
                    f"process{f' (pid {holder})' if holder else ''}; "
                    "wait for it to finish, or give another folder"
                ) from None
            raise ResultsError(f"cannot lock {path} ({exc.strerror or exc})") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is only for the message of a second process
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def remove_leftovers(folder: Path) -> list[Path]:
    """Temporary files of writes cut short (``.<name>.<random>.tmp`` of :func:`~fedshuffle.core.io.write_atomic`,
    the ``.write-test`` probe) in ``folder``; call it holding the folder's lock. Nothing is removed through a link."""
    removed: list[Path] = []
    if Path(folder).is_symlink():
        return removed
    for path in [*Path(folder).glob(".*.tmp"), Path(folder) / ".write-test"]:
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink()
                removed.append(path)
        except OSError:
            pass
    return removed
