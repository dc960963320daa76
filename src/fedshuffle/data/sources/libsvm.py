"""LIBSVM binary-classification datasets (Chang & Lin 2011), as used by RR-CLI, Nastya and FedShuffle.

Files are read by scikit-learn's svmlight reader into dense float64 arrays; labels are mapped to
{0, 1} (the smaller of the two label values → 0: phishing {0,1}, mushrooms {1,2}, a3a/w3a/a9a
{−1,+1}), which the logistic-regression problem turns into b ∈ {−1, +1}. The arrays read are kept in the
cache folder under the SHA-256 of the file's bytes (``<cache>/svmlight/<sha256>-<features>.npz``), so that a
process reads them back without importing scikit-learn (seconds of start-up) and a changed file is read anew.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedshuffle.core import limits
from fedshuffle.core.errors import DataError
from fedshuffle.core.io import write_atomic
from fedshuffle.data.sources.fetch import RemoteFile, cache_dir, locate

OFFICIAL_URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary/"

#: name → (number of features, {file: sha256}); the test split, where LIBSVM has one, is ``<name>.t``.
LIBSVM_DATASETS: dict[str, tuple[int, dict[str, str]]] = {
    "phishing": (68, {"phishing": "0cf66ef36604c393da9359b2e5d894a2df8aee31fd184633cefa138add2ef08a"}),
    "mushrooms": (112, {"mushrooms": "f39a4eb628dc61a7d43760815b061c9e497aa728ce1ad8bde57a09ef6043b538"}),
    "a3a": (
        123,
        {
            "a3a": "2d513572f103d25e84bebe4b9f2f52ee9445764b5a393caff7db9c482cfc1ee4",
            "a3a.t": "c46c9ea67e06f38e81d59c4883e3d670cbe55de6a5c32564b38fc89dcda3adac",
        },
    ),
    "w3a": (
        300,
        {
            "w3a": "f050c32d3bd2f18eccbe3847cfe8a3ba9dae4de67d73236013c4a7b9afb48cc7",
            "w3a.t": "623e195812435d3c54a0a87120ba9a927ed9771b1d29f9e35fdfa381416b2fb3",
        },
    ),
    "a9a": (
        123,
        {
            "a9a": "f5d5ffd8d865ff41328e7ee043e4b020816914ff6843ff15b98905ddbedce906",
            "a9a.t": "1f448a153f0320399a7e40836eb207655b0bde0f21fc941cc472193daa9f5de9",
        },
    ),
}
#: file → bytes (the download's size cap, with a margin)
LIBSVM_BYTES: dict[str, int] = {
    "phishing": 3620168,
    "mushrooms": 879712,
    "a3a": 227902,
    "a3a.t": 2101973,
    "w3a": 343282,
    "w3a.t": 3134956,
    "a9a": 2329875,
    "a9a.t": 1164628,
}

_PAIR = re.compile(r"^(\d+):(\S+)$")
#: bytes of the reader's buffers per byte of svmlight text (indices and values as int64/float64)
SPARSE_EXPANSION = 8


def remote_file(name: str, split: str = "train", base_url: str | None = None) -> RemoteFile:
    """The :class:`RemoteFile` of a registered dataset's train or test file."""
    if name not in LIBSVM_DATASETS:
        raise DataError(
            "data.dataset",
            f"unknown LIBSVM dataset {name!r}; accepted: {', '.join(LIBSVM_DATASETS)} (or give data.path to any "
            "svmlight file)",
        )
    files = LIBSVM_DATASETS[name][1]
    file = name if split == "train" else f"{name}.t"
    if file not in files:
        raise DataError("data.test", f"LIBSVM has no test split for {name!r}; use data.test_fraction instead")
    base = base_url or os.environ.get("FEDSHUFFLE_LIBSVM_URL") or OFFICIAL_URL
    return RemoteFile(name, file, base.rstrip("/") + "/" + file, files[file], LIBSVM_BYTES.get(file, 0))


def load_libsvm_dataset(
    name: str,
    split: str = "train",
    *,
    data_dirs: Sequence[str | Path] = (),
    download: bool = True,
    verify: bool = True,
    base_url: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Features (N, d) and labels in {0, 1} of a registered LIBSVM dataset, located by
    :func:`~fedshuffle.datasets.fetch.locate`."""
    path = locate(remote_file(name, split, base_url), extra_dirs=data_dirs, download=download, verify=verify)
    return read_svmlight(path, LIBSVM_DATASETS[name][0])


def read_svmlight(path: str | Path, num_features: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Dense features and {0, 1} labels of a binary svmlight file: parsed by :func:`parse_svmlight` once, then read
    back from the cache folder by the file's SHA-256 (an unwritable cache only costs the next read a parse)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(str(path), "file not found" if not path.exists() else "not a file")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    cached = cache_dir() / "svmlight" / f"{digest}-{num_features if num_features is not None else 'any'}.npz"
    if cached.is_file():
        try:
            with np.load(cached, allow_pickle=False) as stored:
                features, labels = stored["features"], stored["labels"]
            typed = features.dtype == np.float64 and labels.dtype == np.int64
            if typed and features.ndim == 2 and labels.shape == (features.shape[0],):
                return features, labels
        except (ValueError, OSError, KeyError):
            pass  # a damaged entry is parsed again and replaced
    features, labels = parse_svmlight(path, num_features)
    buf = io.BytesIO()
    np.savez(buf, features=features, labels=labels)
    try:
        write_atomic(cached, buf.getvalue())
    except OSError:
        pass
    return features, labels


def parse_svmlight(path: str | Path, num_features: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Dense features and {0, 1} labels of a binary svmlight file, parsed by scikit-learn's reader.

    Errors name the file and its first bad line: a malformed line, a non-integer label (classes are
    needed), a third label value, a NaN or infinite feature, or a feature index so large that the dense
    matrix cannot fit in memory (checked on the sparse matrix, before densifying).
    """
    from sklearn.datasets import load_svmlight_file

    path = Path(path)
    if not path.is_file():
        raise DataError(str(path), "file not found" if not path.exists() else "not a file")
    if path.stat().st_size == 0:
        raise DataError(str(path), "the file is empty")
    limits.check_fits(SPARSE_EXPANSION * path.stat().st_size, str(path), "reading this svmlight file", DataError)
    try:
        features, labels = load_svmlight_file(str(path), n_features=num_features, dtype=np.float64)
    except (ValueError, RuntimeError, UnicodeDecodeError, OverflowError) as exc:
        raise DataError(
            _first_bad_line(path, num_features) or str(path), f"not a valid svmlight file ({exc})"
        ) from None
    if features.shape[0] == 0:
        raise DataError(str(path), "the file holds no samples")
    fractional = np.flatnonzero(~np.isfinite(labels) | (labels != np.round(labels)))
    if fractional.size:
        row = int(fractional[0])
        raise DataError(
            f"{path}, line {_line_of_row(path, row)}",
            f"label {float(labels[row]):g} is not an integer; classification needs integer class labels",
        )
    values = np.unique(labels)
    if len(values) != 2:
        raise DataError(
            str(path), f"binary classification needs exactly two label values, found {values[:10].tolist()}"
        )
    bad = np.flatnonzero(~np.isfinite(features.data))
    if bad.size:
        row = int(np.searchsorted(features.indptr, bad[0], side="right") - 1)
        raise DataError(f"{path}, line {_line_of_row(path, row)}", "feature values must be finite (found NaN or inf)")
    if features.nnz == 0:
        raise DataError(str(path), "no sample has a feature: every sample needs at least one (index:value pairs)")
    if num_features is None:
        widest = int(np.searchsorted(features.indptr, int(np.argmax(features.indices)), side="right") - 1)
        where = f"{path}, line {_line_of_row(path, widest)}"
    else:
        where = str(path)
    limits.check_dataset(
        features.shape[0],
        features.shape[1],
        where,
        f"the dense matrix (largest feature index {features.shape[1]})",
        DataError,
    )
    return features.toarray(), (labels == values[1]).astype(np.int64)


def _line_of_row(path: Path, row: int) -> int:
    """The line number of sample ``row`` (blank and comment-only lines hold no sample)."""
    seen = -1
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if raw.split(b"#", 1)[0].strip():
                seen += 1
                if seen == row:
                    return number
    return row + 1


def _first_bad_line(path: Path, num_features: int | None) -> str | None:
    """``"<path>, line k: reason"`` for the first line the svmlight grammar rejects, or ``None``."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            reason = _line_problem(raw, num_features)
            if reason:
                return f"{path}, line {number} ({reason})"
    return None


def _line_problem(raw: bytes, num_features: int | None) -> str | None:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return "non-ASCII bytes"
    tokens = text.split("#", 1)[0].split()
    if not tokens:
        return None
    try:
        float(tokens[0])
    except ValueError:
        return f"label {tokens[0]!r} is not a number"
    last = 0
    for token in tokens[1:]:
        match = _PAIR.match(token)
        if token.startswith("qid:"):
            continue
        if not match:
            return f"{token!r} is not index:value"
        index = int(match.group(1))
        try:
            float(match.group(2))
        except ValueError:
            return f"value {match.group(2)!r} is not a number"
        if index <= last:
            return f"feature indices must increase (index {index} after {last})"
        if num_features is not None and index > num_features:
            return f"feature index {index} exceeds the {num_features} features of this dataset"
        last = index
    return None
