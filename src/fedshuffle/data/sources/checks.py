"""Checks every loader applies to what it read: shapes, dtypes, label values, and sizes before reading.

Errors are :class:`~fedshuffle.core.errors.DataError` whose field names the file and the record
(``"<path>, y[17]"``, ``"<path>, user 'f0001'"``), and whose message says what is accepted.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import IO

import numpy as np

from fedshuffle.core import limits
from fedshuffle.core.errors import DataError


def class_labels(y: object, where: str, record: str = "y") -> np.ndarray:
    """Class labels as int64: one per sample (1-D), integers ≥ 0 — integral floats (``1.0``) are
    accepted, fractional ones refused rather than truncated; booleans, strings, complex refused."""
    try:
        arr = np.asarray(y)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise DataError(where, f"{record}: labels must be a flat list of integers ({exc})") from None
    if arr.ndim != 1:
        raise DataError(where, f"{record}: labels must be one integer per sample (a 1-D list), got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise DataError(where, f"{record}: labels must be integers, got {_kind(arr.dtype)}")
    if np.issubdtype(arr.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            raise DataError(
                where,
                f"{record}[{int(bad[0])}] = {float(arr[bad[0]]):g}: labels must be integers (class indices 0..C−1), "
                "not fractions",
            )
        if np.abs(arr).max() >= 2**62:
            raise DataError(where, f"{record}: labels must be class indices 0..C−1, found {arr.max():.3g}")
    negative = np.flatnonzero(arr < 0)
    if negative.size:
        raise DataError(
            where, f"{record}[{int(negative[0])}] = {arr[negative[0]]:g}: labels must be class indices 0..C−1 (>= 0)"
        )
    return arr.astype(np.int64)


def features(x: object, where: str, record: str = "x", *, samples: int | None = None) -> np.ndarray:
    """Real features, one row per sample, at least one finite value per sample (float64)."""
    arr = np.asarray(x)
    if arr.ndim == 0:
        raise DataError(where, f"{record}: features must have one row per sample, got a scalar")
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating) or arr.dtype == np.bool_):
        raise DataError(where, f"{record}: features must be real numbers, got {_kind(arr.dtype)}")
    if samples is not None and arr.shape[0] != samples:
        raise DataError(where, f"{record}: {arr.shape[0]} rows of features but {samples} labels")
    if arr.shape[0] and int(np.prod(arr.shape[1:])) == 0:
        raise DataError(where, f"{record}: every sample needs at least one feature, got shape {arr.shape}")
    arr = arr.astype(np.float64, copy=False)
    if not np.isfinite(arr).all():
        row = int(np.flatnonzero(~np.isfinite(arr.reshape(arr.shape[0], -1)).all(axis=1))[0])
        raise DataError(where, f"{record}[{row}]: features must be finite (found NaN or inf)")
    return arr


def _kind(dtype: np.dtype) -> str:
    if np.issubdtype(dtype, np.complexfloating):
        return f"complex numbers ({dtype}); use the real part explicitly if that is meant"
    if dtype == np.bool_:
        return "booleans"
    return str(dtype)


def npy_header(fh: IO[bytes], where: str, available: int | None) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from an ``.npy`` header, checked before any data is read: no object arrays, and
    no more data than the file holds (``available`` bytes after the header) nor than memory allows."""
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as exc:
        raise DataError(where, f"not a .npy array ({exc or type(exc).__name__})") from None
    if dtype.hasobject:
        raise DataError(where, "holds Python objects (pickled data is never loaded); save a numeric array")
    needed = limits.array_bytes(*shape, itemsize=dtype.itemsize)
    if available is not None and needed > available - fh.tell():
        raise DataError(
            where,
            f"the header claims {shape} × {dtype} ({limits.human(needed)}) but the file holds "
            f"{limits.human(max(available - fh.tell(), 0))}: truncated or corrupt",
        )
    limits.check_fits(limits.DATASET_COPIES * needed, where, f"the array {shape} of {dtype}", DataError)
    return tuple(shape), dtype


def check_npy_file(path: Path, where: str) -> None:
    """:func:`npy_header` of an ``.npy`` file."""
    with open(path, "rb") as fh:
        npy_header(fh, where, path.stat().st_size)


def check_npz_members(path: Path | IO[bytes], where: str, names: tuple[str, ...]) -> None:
    """:func:`npy_header` of each of ``names`` in an ``.npz`` archive (a path or an open file; sizes from its
    directory)."""
    with zipfile.ZipFile(path) as archive:
        for name in names:
            try:
                info = archive.getinfo(f"{name}.npy")
            except KeyError:
                continue
            with archive.open(info) as fh:
                npy_header(fh, f"{where}, {name}", info.file_size)
