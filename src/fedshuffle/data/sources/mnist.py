"""MNIST (LeCun, Cortes & Burges) from the four official IDX files, read with NumPy.

IDX: a big-endian header — two zero bytes, the element type (0x08 = unsigned byte), the number of
dimensions d — then d uint32 sizes, then the elements in C order. Images are 28×28 bytes, labels one
byte 0–9. Images are returned as float32 in [0, 1], shape (N, 1, 28, 28); the official 60,000/10,000
train/test split is kept.
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedshuffle.core import limits
from fedshuffle.core.errors import DataError
from fedshuffle.data.sources.fetch import RemoteFile, locate

#: torchvision's first mirror; the original page (yann.lecun.com/exdb/mnist) now refuses most downloads
OFFICIAL_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"

#: file → SHA-256 of the official .gz (their MD5s are the ones torchvision checks)
MNIST_FILES: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
#: file → bytes of the official .gz (the download's size cap, with a margin)
MNIST_BYTES: dict[str, int] = {
    "train-images-idx3-ubyte.gz": 9912422,
    "train-labels-idx1-ubyte.gz": 28881,
    "t10k-images-idx3-ubyte.gz": 1648877,
    "t10k-labels-idx1-ubyte.gz": 4542,
}
_PREFIX = {"train": "train", "test": "t10k"}


#: records an IDX file may declare (MNIST has 60,000; a header claiming more is damaged or hostile)
MAX_RECORDS = 10_000_000


def _open_idx(path: Path):
    """The file, decompressed as it is read when it is gzip (magic 1f 8b)."""
    with open(path, "rb") as fh:
        compressed = fh.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if compressed else open(path, "rb")


def read_idx(path: str | Path, ndim: int) -> np.ndarray:
    """The unsigned-byte array of an IDX file (gzip-compressed or not) with ``ndim`` dimensions.

    The header is read first and the payload only up to the size it declares (checked against memory),
    so a gzip bomb stops there. Errors name the file and, for a truncated payload, the first incomplete record.
    """
    path = Path(path)
    try:
        with _open_idx(path) as fh:
            magic = fh.read(4)
            if len(magic) < 4 or magic[:2] != b"\x00\x00":
                raise DataError(str(path), "not an IDX file (the first two bytes must be zero)")
            if magic[2] != 0x08:
                raise DataError(str(path), f"IDX element type 0x{magic[2]:02x} is not unsigned byte (0x08)")
            if magic[3] != ndim:
                raise DataError(str(path), f"IDX file has {magic[3]} dimensions, expected {ndim}")
            dims = fh.read(4 * ndim)
            if len(dims) < 4 * ndim:
                raise DataError(str(path), "the IDX header is truncated")
            shape = tuple(int(v) for v in np.frombuffer(dims, dtype=">u4"))
            record = math.prod(shape[1:])
            if shape[0] > MAX_RECORDS or record > 1 << 20:
                raise DataError(
                    str(path),
                    f"the header declares {shape}, more than any MNIST file ({MAX_RECORDS} records of at most 1 MiB)",
                )
            expected = shape[0] * record
            limits.check_fits(limits.DATASET_COPIES * 4 * expected, str(path), f"the {shape} images", DataError)
            payload = fh.read(expected + 1)  # one byte more: anything after the declared records is an error
    except DataError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(str(path), f"cannot read ({exc})") from None
    if len(payload) != expected:
        complete = len(payload) // record if record else 0
        if complete < shape[0]:
            raise DataError(
                f"{path}, record {complete}",
                f"truncated: the header declares {shape[0]} records of {record} bytes, the file holds {complete} "
                "complete ones",
            )
        raise DataError(str(path), f"more bytes after the {shape[0]} records the header declares")
    return np.frombuffer(payload, dtype=np.uint8).reshape(shape)


def read_mnist_pair(images: str | Path, labels: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 1, 28, 28) float32 in [0, 1] and int64 labels 0–9 of one IDX image/label pair."""
    x, y = read_idx(images, 3), read_idx(labels, 1)
    if x.shape[1:] != (28, 28):
        raise DataError(str(images), f"MNIST images are 28×28, this file holds {x.shape[1]}×{x.shape[2]}")
    if len(x) != len(y):
        raise DataError(str(labels), f"{len(y)} labels for the {len(x)} images of {images}")
    if (bad := np.flatnonzero(y > 9)).size:
        raise DataError(f"{labels}, record {int(bad[0])}", f"label {int(y[bad[0]])} is not a digit 0–9")
    return (x.astype(np.float32) / 255.0)[:, None], y.astype(np.int64)


def remote_files(split: str) -> tuple[RemoteFile, RemoteFile]:
    """The images and labels :class:`RemoteFile` of the ``"train"`` or ``"test"`` split."""
    names = (f"{_PREFIX[split]}-images-idx3-ubyte.gz", f"{_PREFIX[split]}-labels-idx1-ubyte.gz")
    files = tuple(RemoteFile("mnist", n, OFFICIAL_URL + n, MNIST_FILES[n], MNIST_BYTES.get(n, 0)) for n in names)
    return files  # type: ignore[return-value]


def load_mnist(
    split: str = "train",
    *,
    data_dirs: Sequence[str | Path] = (),
    download: bool = True,
    verify: bool = True,
    mirror: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """MNIST's official ``"train"`` (60,000) or ``"test"`` (10,000) images and labels, located by
    :func:`~fedshuffle.data.sources.fetch.locate`."""
    images, labels = (
        locate(r, extra_dirs=data_dirs, download=download, verify=verify, mirror=mirror) for r in remote_files(split)
    )
    return read_mnist_pair(images, labels)
