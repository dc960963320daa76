"""CIFAR-10 and CIFAR-100 (Krizhevsky, 2009) from the official python archives, and TFF's federated CIFAR-100.

The official ``cifar-10-python.tar.gz`` holds ``data_batch_1..5`` and ``test_batch``; the CIFAR-100
archive holds ``train`` and ``test``. Each member is a pickled dict with ``data`` (N × 3072 bytes, the
red, green and blue 32×32 planes of each image) and ``labels`` (CIFAR-10) or ``fine_labels`` and
``coarse_labels`` (CIFAR-100). Members are read straight from the archive with an unpickler that
accepts only NumPy arrays and builtins, so a tampered archive cannot run code even with
``verify = false``; sizes are checked before anything is allocated (a member no larger than
:data:`MAX_MEMBER_BYTES`, no array larger than the pickle that carries it). Images are returned as
float32 in [0, 1], shape (N, 3, 32, 32).

TensorFlow Federated's ``fed_cifar100`` (500 training clients of 100 images, made by the Pachinko
allocation of Reddi et al., ICLR 2021) ships as HDF5 files inside ``fed_cifar100.tar.bz2``:
``/examples/<client>/{image (n, 32, 32, 3) uint8, label, coarse_label}``.
"""

from __future__ import annotations

import io
import math
import pickle
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedshuffle.core import limits
from fedshuffle.core.errors import DataError
from fedshuffle.data.sources import checks
from fedshuffle.data.sources.fetch import DECOMPRESSION_ERRORS, RemoteFile, locate, locate_derived, tar_member

OFFICIAL_URL = "https://www.cs.toronto.edu/~kriz/"
TFF_URL = "https://storage.googleapis.com/tff-datasets-public/"

#: dataset → (archive, SHA-256, training members, test member, label key, classes)
CIFAR_ARCHIVES: dict[str, tuple[str, str, tuple[str, ...], str, str, int]] = {
    "cifar10": (
        "cifar-10-python.tar.gz",
        "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
        tuple(f"data_batch_{k}" for k in range(1, 6)),
        "test_batch",
        "labels",
        10,
    ),
    "cifar100": (
        "cifar-100-python.tar.gz",
        "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
        ("train",),
        "test",
        "fine_labels",
        100,
    ),
}

#: archive → bytes of the official file (the download's size cap, with a margin)
CIFAR_BYTES: dict[str, int] = {"cifar-10-python.tar.gz": 170498071, "cifar-100-python.tar.gz": 169001437}

#: TFF's archive and its SHA-256 (as TFF's ``cifar100.load_data`` checks it); TFF publishes no checksum of the HDF5
#: files inside
TFF_CIFAR100 = ("fed_cifar100.tar.bz2", "e8575e22c038ecef1ce6c7d492d7abee7da13b1e1ba9b70a7fc18531ba7590de")

_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
}
#: the largest archive member read (the official ones: 31 MB per CIFAR-10 batch, 155 MB for CIFAR-100's train)
MAX_MEMBER_BYTES = 512 << 20
#: what a damaged pickle raises while it is read (MemoryError: a shape whose size overflows, never allocated)
_PICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
    KeyError,
    MemoryError,
    OverflowError,
    RecursionError,
)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, numbers, strings and NumPy arrays; refuses every other global, and every
    array larger than ``limit`` bytes (the pickle's own size: a genuine array carries its data)."""

    def __init__(self, raw: bytes, limit: int) -> None:
        super().__init__(io.BytesIO(raw), encoding="latin1")
        self.limit = limit

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        found = super().find_class(module, name)
        return self._checked(found) if name == "_reconstruct" else found

    def _checked(self, reconstruct):
        def checked_reconstruct(subtype, shape, dtype):
            """numpy's ``_reconstruct`` allocates ``shape`` at once: refuse it unless it fits the pickle."""
            if subtype is not np.ndarray:
                raise pickle.UnpicklingError(
                    f"refusing to build a {getattr(subtype, '__name__', subtype)!r}, only plain NumPy arrays"
                )
            dims = shape if isinstance(shape, tuple) else (shape,)
            if not all(isinstance(n, int) and n >= 0 for n in dims):
                raise pickle.UnpicklingError(f"an array of shape {shape!r}")
            size = math.prod(dims) * np.dtype(dtype).itemsize
            if size > self.limit:
                raise pickle.UnpicklingError(
                    f"an array of {limits.human(size)} in a pickle of {limits.human(self.limit)}; refusing to "
                    "allocate it"
                )
            return reconstruct(subtype, shape, dtype)

        return checked_reconstruct


def _unpickle(raw: bytes, where: str) -> dict:
    try:
        content = _ArrayUnpickler(raw, len(raw)).load()
    except _PICKLE_ERRORS as exc:
        raise DataError(where, f"not a CIFAR pickle ({' '.join(str(exc).split()) or type(exc).__name__})") from None
    if not isinstance(content, dict):
        raise DataError(where, f"not a CIFAR pickle (a {type(content).__name__}, expected a dict)")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in content.items()}


def _members(path: Path, names: Sequence[str]) -> dict[str, tuple[str, dict]]:
    """The unpickled members ``names`` (matched by file name) of a tar archive, read in one pass: name → (where,
    content)."""
    found: dict[str, tuple[str, dict]] = {}
    try:
        with tarfile.open(path) as archive:
            for info in archive:
                name = Path(info.name).name
                if info.isfile() and name in names and name not in found:
                    where = f"{path}:{info.name}"
                    if info.size > MAX_MEMBER_BYTES:
                        raise DataError(
                            where,
                            f"the archive declares {limits.human(info.size)}, more than any CIFAR member "
                            f"({limits.human(MAX_MEMBER_BYTES)} at most)",
                        )
                    limits.check_fits(2 * info.size, where, "the archive member", DataError)
                    found[name] = (where, _unpickle(archive.extractfile(info).read(), where))
    except DataError:
        raise
    except (tarfile.TarError, *DECOMPRESSION_ERRORS) as exc:
        raise DataError(
            str(path), f"not a readable tar.gz archive ({' '.join(str(exc).split()) or type(exc).__name__})"
        ) from None
    if missing := [n for n in names if n not in found]:
        raise DataError(str(path), f"the archive has no member {missing[0]!r} (is it the official python version?)")
    return found


def _images(batch: dict, where: str, keys: Sequence[str], classes: int) -> tuple[np.ndarray, list[np.ndarray]]:
    missing = [k for k in ("data", *keys) if k not in batch]
    if missing:
        raise DataError(where, f"the pickle has no {missing[0]!r} entry (it has {', '.join(map(str, batch))})")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(
            where,
            f"'data' must be a uint8 array of shape (N, 3072), got {getattr(data, 'dtype', type(data).__name__)} "
            f"{getattr(data, 'shape', '')}",
        )
    labels = []
    for key, bound in zip(keys, (classes, 20)):
        y = checks.class_labels(batch[key], where, key)
        if y.shape != (len(data),):
            raise DataError(where, f"{len(y)} {key} for {len(data)} images")
        if (bad := np.flatnonzero((y < 0) | (y >= bound))).size:
            raise DataError(f"{where}, record {int(bad[0])}", f"{key[:-1]} {int(y[bad[0]])} outside 0–{bound - 1}")
        labels.append(y)
    return data, labels


def _groups(fine: np.ndarray, coarse: np.ndarray, where: str) -> np.ndarray:
    """The coarse label of each fine label, checked to be one per fine label."""
    groups = np.full(100, -1, dtype=np.int64)
    for i, (f, c) in enumerate(zip(fine, coarse)):
        if groups[f] == -1:
            groups[f] = c
        elif groups[f] != c:
            raise DataError(
                f"{where}, record {i}", f"fine label {f} has coarse label {c}, earlier records give {groups[f]}"
            )
    return groups


def read_cifar_archive(
    path: str | Path, name: str
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], np.ndarray | None]:
    """``(train, test, label_groups)`` of an official CIFAR python archive: images (N, 3, 32, 32) float32 in [0, 1]
    with int64 labels, and for CIFAR-100 the coarse label (0–19) of each of the 100 fine labels."""
    path = Path(path)
    _, _, train_members, test_member, label_key, classes = CIFAR_ARCHIVES[name]
    keys = [label_key] + (["coarse_labels"] if name == "cifar100" else [])
    members = _members(path, (*train_members, test_member))
    parts = [
        (members[m][0], *_images(members[m][1], members[m][0], keys, classes)) for m in (*train_members, test_member)
    ]

    def join(members: list) -> tuple[np.ndarray, np.ndarray]:
        data = np.concatenate([d for _, d, _ in members])
        return (data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0), np.concatenate([ys[0] for _, _, ys in members])

    groups = None
    if name == "cifar100":
        where, _, (fine, coarse) = parts[0]
        groups = _groups(fine, coarse, where)
        if (missing := np.flatnonzero(groups < 0)).size:
            raise DataError(where, f"fine label {int(missing[0])} never occurs in the training set")
    return join(parts[:-1]), join(parts[-1:]), groups


def remote_archive(name: str) -> RemoteFile:
    archive, sha, *_ = CIFAR_ARCHIVES[name]
    return RemoteFile(name, archive, OFFICIAL_URL + archive, sha, CIFAR_BYTES.get(archive, 0))


def load_cifar(
    name: str,
    *,
    data_dirs: Sequence[str | Path] = (),
    download: bool = True,
    verify: bool = True,
    mirror: str | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], np.ndarray | None]:
    """CIFAR-10 or CIFAR-100 (``name`` = ``"cifar10"``/``"cifar100"``): official train and test splits (see
    :func:`read_cifar_archive`)."""
    return read_cifar_archive(
        locate(remote_archive(name), extra_dirs=data_dirs, download=download, verify=verify, mirror=mirror), name
    )


def _tff_h5(split: str, data_dirs: Sequence[str | Path], download: bool, verify: bool, mirror: str | None) -> Path:
    archive, sha = TFF_CIFAR100
    member = f"fed_cifar100_{split}.h5"
    return locate_derived(
        RemoteFile("cifar100/tff", member, "", ""),
        [(RemoteFile("cifar100/tff", archive, TFF_URL + archive, sha), tar_member(member))],
        extra_dirs=data_dirs,
        download=download,
        verify=verify,
        mirror=mirror,
    )


#: what h5py raises on a file whose structure is not what was expected (a dataset where a group should be, ...)
H5_ERRORS = (KeyError, RuntimeError, AttributeError, TypeError, ValueError)


def _tff_record(record, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One TFF client's images, fine and coarse labels, their shapes and types checked before they are read."""
    import h5py

    if not isinstance(record, h5py.Group):
        raise DataError(
            where, f"expected a group with image, label and coarse_label datasets, got a {type(record).__name__}"
        )
    found = {k: record.get(k) for k in ("image", "label", "coarse_label")}
    for key, dataset in found.items():
        if not isinstance(dataset, h5py.Dataset):
            raise DataError(
                where,
                f"no {key!r} dataset" if dataset is None else f"{key!r} is a {type(dataset).__name__}, not a dataset",
            )
    image, label, parent = found["image"], found["label"], found["coarse_label"]
    if image.dtype != np.uint8 or image.ndim != 4 or image.shape[1:] != (32, 32, 3):
        raise DataError(where, f"expected uint8 images (n, 32, 32, 3), got {image.dtype} {image.shape}")
    n = image.shape[0]
    if n == 0:
        raise DataError(where, "the client has no images (every client needs at least one)")
    for key, dataset in (("label", label), ("coarse_label", parent)):
        if dataset.dtype.kind not in "iu" or dataset.shape != (n,):
            raise DataError(
                where, f"{key} must be {n} integers (one per image, shape ({n},)), got {dataset.dtype} {dataset.shape}"
            )
    limits.check_fits(limits.DATASET_COPIES * limits.array_bytes(n, 3072, itemsize=4), where, f"{n} images", DataError)
    return image[()], label[()].astype(np.int64), parent[()].astype(np.int64)


def read_tff_cifar100(path: str | Path) -> tuple[list[str], list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Client ids (in TFF's numeric order), each client's images (n, 3, 32, 32) float32 in [0, 1] and fine labels,
    and the coarse label of each fine label, from one of TFF's ``fed_cifar100_{train,test}.h5``.

    TFF publishes no checksum of these files (only of the archive they ship in), so their structure is
    checked strictly: ``/examples/<client>/{image (n, 32, 32, 3) uint8, label (n,), coarse_label (n,)}``
    with integer labels, n ≥ 1, fine labels 0–99 and coarse labels 0–19, one coarse label per fine one.
    """
    import h5py

    path = Path(path)
    try:
        with h5py.File(path, "r") as h5:
            group = h5.get("examples")
            if not isinstance(group, h5py.Group):
                raise DataError(str(path), "not TFF's federated CIFAR-100: no /examples group")
            ids = sorted(group, key=lambda c: (len(c), c))
            clients, fine, coarse = [], [], []
            for cid in ids:
                where = f"{path}, client {cid!r}"
                image, label, parent = _tff_record(group[cid], where)
                if (bad := np.flatnonzero((label < 0) | (label > 99) | (parent < 0) | (parent > 19))).size:
                    raise DataError(
                        f"{where}, record {int(bad[0])}",
                        f"label {int(label[bad[0]])} / coarse label {int(parent[bad[0]])} outside 0–99 / 0–19",
                    )
                clients.append((image.transpose(0, 3, 1, 2).astype(np.float32) / 255.0, label))
                fine.append(label)
                coarse.append(parent)
    except DataError:
        raise
    except OSError as exc:
        raise DataError(str(path), f"not a readable HDF5 file ({exc})") from None
    except H5_ERRORS as exc:  # h5py on objects of another kind than expected
        raise DataError(
            str(path), f"not TFF's federated CIFAR-100 layout ({' '.join(str(exc).split()) or type(exc).__name__})"
        ) from None
    if not clients:
        raise DataError(str(path), "no clients under /examples")
    groups = _groups(np.concatenate(fine), np.concatenate(coarse), str(path))
    return ids, clients, groups


def load_tff_cifar100(
    *, data_dirs: Sequence[str | Path] = (), download: bool = True, verify: bool = True, mirror: str | None = None
) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray], np.ndarray]:
    """TFF's 500 training clients (100 images each), the pooled test clients, and the coarse label of each fine
    label."""
    _, train, groups = read_tff_cifar100(_tff_h5("train", data_dirs, download, verify, mirror))
    test_path = _tff_h5("test", data_dirs, download, verify, mirror)
    _, test, test_groups = read_tff_cifar100(test_path)
    if (clash := np.flatnonzero((groups >= 0) & (test_groups >= 0) & (groups != test_groups))).size:
        raise DataError(
            str(test_path),
            f"fine label {int(clash[0])} has coarse label {int(test_groups[clash[0]])} here but "
            f"{int(groups[clash[0]])} in the training file",
        )
    groups = np.where(groups >= 0, groups, test_groups)
    return train, (np.concatenate([x for x, _ in test]), np.concatenate([y for _, y in test])), groups
