"""LEAF's per-user JSON (Caldas et al. 2018): FEMNIST, Shakespeare and the other LEAF datasets.

A LEAF folder holds ``train/`` and ``test/`` subfolders of ``*.json`` (or ``*.json.gz``) files, each
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``. Users are
the natural clients (FEMNIST: one writer each); a user's test samples join the global test set.
Point ``data.path`` at the output folder of LEAF's ``preprocess.sh`` (any sampling) to use the full data.

What is read is checked, with errors naming the file and the user: user names are strings listed
once per split; ``x`` is a list of equally long rows of finite numbers (at least one per sample, as
wide as every other user's, train and test alike); ``y`` is one class index ≥ 0 per sample (integral
floats accepted, fractions refused, never truncated); ``num_samples``, where given, matches (except for
text, whose LEAF test files overcount it).
Text samples (Shakespeare) are encoded by :func:`fedshuffle.data.sources.shakespeare.encode_leaf`.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedshuffle.core import limits
from fedshuffle.core.errors import DataError
from fedshuffle.data.sources import checks
from fedshuffle.data.sources.shakespeare import encode_leaf

#: bytes of Python objects per byte of JSON text, for the memory estimate of reading a file
JSON_EXPANSION = 8


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz")) and p.is_file())


def _read(path: Path) -> dict:
    size = path.stat().st_size * (20 if path.suffix == ".gz" else 1)  # gzip: FEMNIST's JSON compresses ~10×
    limits.check_fits(JSON_EXPANSION * size, str(path), "reading this JSON file", DataError)
    room, source = limits.available_bytes()
    cap = int(limits.HEADROOM * room / JSON_EXPANSION)  # the text whose objects still fit: a gzip bomb stops here
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
            text = fh.read(cap + 1)
        if len(text) > cap:
            raise DataError(
                str(path), f"decompresses to more than {limits.human(cap)} of JSON, more than memory allows ({source})"
            )
        data = json.loads(text)
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
        raise DataError(str(path), f"cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}, line {exc.lineno}", f"not valid JSON ({exc.msg})") from None
    except ValueError as exc:  # a number of more than 4,300 digits
        if isinstance(exc, DataError):
            raise
        raise DataError(str(path), f"not valid JSON ({' '.join(str(exc).split(':')[0].split())})") from None
    except RecursionError:
        raise DataError(str(path), "JSON nested too deeply to be a LEAF file") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("users"), list)
        or not isinstance(data.get("user_data"), dict)
    ):
        raise DataError(
            str(path), "not a LEAF file: expected an object with 'users' (a list) and 'user_data' (an object)"
        )
    return data


def _user(path: Path, user: str, record: object, expected: object) -> tuple[np.ndarray, np.ndarray]:
    where = f"{path}, user {user!r}"
    if not isinstance(record, dict) or "x" not in record or "y" not in record:
        raise DataError(where, f"user {user!r} is listed but has no x/y data in 'user_data'")
    if isinstance(record["x"], list) and record["x"] and isinstance(record["x"][0], str):
        try:
            x, labels = encode_leaf(record["x"], record["y"])
        except (ValueError, TypeError) as exc:
            raise DataError(where, str(exc)) from None
        # num_samples is not checked for text: LEAF's Shakespeare test files overcount it by 79 (= 80 − 1) per user
        return x, labels
    labels = checks.class_labels(record["y"], where, "y")
    if not isinstance(record["x"], list):
        raise DataError(where, f"x must be a list of samples, got {type(record['x']).__name__}")
    try:
        raw = np.asarray(record["x"])
    except (ValueError, TypeError, OverflowError) as exc:
        raise DataError(where, f"x must be a list of equally long rows of numbers ({str(exc)[:120]})") from None
    if raw.size == 0 and raw.ndim == 1:
        raw = raw.reshape(0, 0)
    if raw.ndim != 2 or (raw.size and raw.dtype.kind not in "iuf"):
        raise DataError(
            where,
            f"x must be a list of equally long rows of numbers (one row per sample), got shape {raw.shape} of "
            f"{raw.dtype}",
        )
    with np.errstate(over="ignore"):
        x = raw.astype(np.float32)
    if x.shape[0] != labels.shape[0]:
        raise DataError(where, f"{x.shape[0]} samples of x but {labels.shape[0]} labels")
    if x.shape[0] and x.shape[1] == 0:
        raise DataError(where, "every sample needs at least one feature, got empty rows")
    if not np.isfinite(x).all():
        row = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
        raise DataError(where, f"x[{row}]: features must be finite (NaN, inf, or beyond float32's range)")
    if expected is not None and expected != len(labels):
        raise DataError(where, f"num_samples says {expected} but the user has {len(labels)} samples")
    return x, labels


def _split(folder: Path, files: Sequence[Path] | None = None) -> dict[str, tuple[np.ndarray, np.ndarray, Path]]:
    if files is None:
        if not folder.is_dir():
            raise DataError(str(folder), "missing: a LEAF dataset folder needs train/ and test/ subfolders")
        files = _files(folder)
    users: dict[str, tuple[np.ndarray, np.ndarray, Path]] = {}
    if not files:
        raise DataError(str(folder), "no *.json or *.json.gz files")
    for path in files:
        data = _read(path)
        counts = data.get("num_samples")
        counts = (
            counts if isinstance(counts, list) and len(counts) == len(data["users"]) else [None] * len(data["users"])
        )
        for user, expected in zip(data["users"], counts):
            if not isinstance(user, str):
                raise DataError(str(path), f"user names must be strings, got {json.dumps(user)[:60]}")
            if user in users:
                first = users[user][2]
                raise DataError(
                    f"{path}, user {user!r}",
                    "listed twice"
                    + (f" (also in {first})" if first != path else " in 'users'")
                    + "; each user must appear once per split",
                )
            x, y = _user(path, user, data["user_data"].get(user), expected)
            users[user] = (x, y, path)
    return users


def load_leaf(
    folder: str | Path, max_users: int | None = None, files: tuple[Sequence[Path], Sequence[Path]] | None = None
) -> tuple[list[str], list[tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray]]:
    """Users (sorted, at most ``max_users``), each one's training ``(x, y)``, and their pooled test set;
    from ``folder``'s ``train/`` and ``test/``, or from the given ``(train, test)`` files."""
    folder = Path(folder)
    if files is None and not folder.is_dir():
        raise DataError(str(folder), "not a folder: data.path must be a LEAF dataset folder with train/ and test/")
    train, test = _split(folder / "train", files and files[0]), _split(folder / "test", files and files[1])
    names = sorted(u for u in train if len(train[u][1]))[:max_users]
    if not names:
        raise DataError(str(folder), "no user has training samples")
    widths = {train[u][0].shape[1]: u for u in names}
    if len(widths) > 1:
        (w1, u1), (w2, u2) = list(widths.items())[:2]
        raise DataError(str(folder), f"users disagree on the feature size: {u1!r} has {w1} features, {u2!r} has {w2}")
    width = next(iter(widths))
    held_out = [u for u in names if u in test and len(test[u][1])]
    for u in held_out:
        if test[u][0].shape[1] != width:
            raise DataError(
                f"{test[u][2]}, user {u!r}",
                f"test samples have {test[u][0].shape[1]} features but training samples have {width}",
            )
    test_x = np.concatenate([test[u][0] for u in held_out]) if held_out else np.zeros((0, width), dtype=np.float32)
    test_y = np.concatenate([test[u][1] for u in held_out]) if held_out else np.zeros(0, dtype=np.int64)
    return names, [train[u][:2] for u in names], (test_x, test_y)
