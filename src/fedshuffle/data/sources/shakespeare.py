"""Shakespeare next-character prediction (Caldas et al., LEAF, arXiv:1812.01097): TFF's HDF5 and LEAF's JSON.

Two forms, each with the vocabulary of its reference implementation:

* **TFF** (``shakespeare_{train,test}.h5``, 715 speaking roles, as in the FedShuffle paper, Horváth et
  al., TMLR 2022): ``/examples/<role>/snippets`` holds contiguous blocks of one role's lines. Encoded
  as the FedShuffle reference code (SamuelHorvath/FedShuffle, ``fl_datasets/shakespeare.py``) does: the
  86-character vocabulary of TFF's text-generation tutorial at ids 1–86, padding 0, out-of-vocabulary
  87, beginning 88, end 89 (:data:`TFF_VOCAB_SIZE` = 90). A snippet becomes
  ``[BOS] + chars + [EOS]`` padded with 0 to 80·k + 1 tokens, cut into k rows of 80 inputs whose
  **targets are the inputs shifted by one** (per-position next characters; labels have shape (k, 80)).
* **LEAF** (``all_data_*.json``): each sample is an 80-character window and the single next character,
  encoded with LEAF's 80-character vocabulary (``ALL_LETTERS`` of LEAF's ``language_utils.py``, index =
  position in it); labels have shape (N,). A character outside it is an error naming the file, user
  and record (LEAF's own code would silently map it to −1).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedshuffle.core.errors import DataError
from fedshuffle.data.sources.fetch import RemoteFile, gunzip, locate, locate_derived, tar_member

SEQUENCE_LENGTH = 80

#: TFF's character vocabulary (tutorial "Federated Learning for Text Generation"), as FedShuffle's code uses it
TFF_VOCAB = "dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\naeimquyAEIMQUY]!%)-159\r"
PAD, OOV, BOS, EOS = 0, len(TFF_VOCAB) + 1, len(TFF_VOCAB) + 2, len(TFF_VOCAB) + 3
TFF_VOCAB_SIZE = len(TFF_VOCAB) + 4

#: LEAF's ``ALL_LETTERS``
LEAF_VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"

TFF_URL = "https://storage.googleapis.com/tff-datasets-public/"
#: TFF's archive (SHA-256 as TFF's ``shakespeare.load_data`` checks it), the HDF5 files in it, and gzip copies of those
TFF_ARCHIVE = ("shakespeare.tar.bz2", "0285be9906cb5f268092eee4edeeacfc2af4574f2941f7cc2f08a321d7f5c707")
TFF_FILES: dict[str, str] = {
    "shakespeare_train.h5": "67100f52adfb6d5ece73c1a942b6863731a477bf09421a3c79c9937612895344",
    "shakespeare_test.h5": "55d3a635bffe5c4f71610a8d0cf86c1b369bfd7793e0635b5a83cde1f195689e",
    "shakespeare_train.h5.gz": "a4ad479294af5f453ce22fbb8a5ce52e7b9df95be1cebf338e9f22bd46988183",
    "shakespeare_test.h5.gz": "2a4f1b0a19a96f2d75d5b14062efcb2637c16df44531d723101fe5a6d3cdfc8d",
}
#: bytes of those files (the size cap of their download or unpacking, with a margin)
TFF_BYTES: dict[str, int] = {
    "shakespeare_train.h5": 4035752,
    "shakespeare_test.h5": 2745814,
    "shakespeare_train.h5.gz": 1612057,
    "shakespeare_test.h5.gz": 298420,
}
#: a genuine LEAF output (``preprocess.sh -s niid --sf 0.023 -k 64 -t sample --tf 0.9``, 10 users); LEAF publishes no
#: JSON to download
LEAF_FILES: dict[str, str] = {
    "train/all_data_niid_023_keep_64_train_9.json.gz": (
        "315e08b509c100007ba3f5873edcd3bb8563fa1f8fbb7d274eb84883a7ff2ac6"
    ),
    "test/all_data_niid_023_keep_64_test_9.json.gz": "3dc91843684e7fc9d8f509584a948acf6618a646a0c0745793e04b21cb7aa3be",
}


def _table(vocab: str, first: int, missing: int) -> np.ndarray:
    table = np.full(max(map(ord, vocab)) + 1, missing, dtype=np.int64)
    table[[ord(c) for c in vocab]] = np.arange(first, first + len(vocab))
    return table


_TFF_TABLE = _table(TFF_VOCAB, 1, OOV)
_LEAF_TABLE = _table(LEAF_VOCAB, 0, -1)


def _codes(text: str, table: np.ndarray, missing: int) -> np.ndarray:
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    return np.where(points < len(table), table[np.minimum(points, len(table) - 1)], missing)


def encode_snippets(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs and per-position targets (k, 80) of snippets, as FedShuffle's reference code frames them, and the
    number of rows of each snippet: snippet s of n characters gives ⌈(n + 1)/80⌉ rows."""
    lengths = np.array([len(t) for t in texts], dtype=np.int64)
    rows = -(-(lengths + 1) // SEQUENCE_LENGTH)
    starts = np.concatenate([[0], np.cumsum(rows * SEQUENCE_LENGTH + 1)])
    tokens = np.zeros(starts[-1], dtype=np.int64)
    tokens[starts[:-1]] = BOS
    tokens[starts[:-1] + 1 + lengths] = EOS
    within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    tokens[np.repeat(starts[:-1] + 1, lengths) + within] = _codes("".join(texts), _TFF_TABLE, OOV)
    row_starts = np.repeat(starts[:-1], rows) + SEQUENCE_LENGTH * (
        np.arange(rows.sum()) - np.repeat(np.cumsum(rows) - rows, rows)
    )
    window = row_starts[:, None] + np.arange(SEQUENCE_LENGTH)
    return tokens[window], tokens[window + 1], rows


def decode(ids: Sequence[int]) -> str:
    """The text of TFF-vocabulary ids (padding dropped; out-of-vocabulary, BOS and EOS as ``�``, ``⟨``, ``⟩``)."""
    special = {OOV: "\ufffd", BOS: "⟨", EOS: "⟩"}
    return "".join(special.get(int(i), TFF_VOCAB[int(i) - 1] if 0 < int(i) <= len(TFF_VOCAB) else "") for i in ids)


def encode_leaf(windows: Sequence[str], targets: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """LEAF Shakespeare records: (N, 80) character ids of the windows and the (N,) ids of the next characters.

    Raises ``ValueError`` naming the record for a window that is not 80 characters, a target that is
    not one character, or a character outside LEAF's vocabulary.
    """
    if len(windows) != len(targets):
        raise ValueError(f"{len(windows)} windows x but {len(targets)} targets y")
    for i, (w, t) in enumerate(zip(windows, targets)):
        if not isinstance(w, str) or len(w) != SEQUENCE_LENGTH:
            raise ValueError(
                f"record {i}: x must be a string of {SEQUENCE_LENGTH} characters, got {type(w).__name__} of length "
                f"{len(w)}"
            )
        if not isinstance(t, str) or len(t) != 1:
            raise ValueError(f"record {i}: y must be one character, got {t!r}")
    x = _codes("".join(windows), _LEAF_TABLE, -1).reshape(len(windows), SEQUENCE_LENGTH)
    y = _codes("".join(targets), _LEAF_TABLE, -1)
    for name, ids, text in (("x", x.reshape(len(windows), -1), windows), ("y", y.reshape(len(targets), 1), targets)):
        if (bad := np.argwhere(ids < 0)).size:
            row, col = (int(v) for v in bad[0])
            raise ValueError(
                f"record {row}: {name} has the character {text[row][col]!r}, which is not in LEAF's 80-character "
                "vocabulary"
            )
    return x, y


def _tff_snippets(record, where: str) -> np.ndarray:
    """One role's ``snippets``: a non-empty 1-D dataset of strings, checked before it is read."""
    import h5py

    if not isinstance(record, h5py.Group):
        raise DataError(where, f"expected a group with a 'snippets' dataset, got a {type(record).__name__}")
    snippets = record.get("snippets")
    if not isinstance(snippets, h5py.Dataset):
        raise DataError(
            where,
            "no 'snippets' dataset"
            if snippets is None
            else f"'snippets' is a {type(snippets).__name__}, not a dataset",
        )
    if (
        snippets.ndim != 1
        or not len(snippets)
        or (snippets.dtype.kind not in "SU" and h5py.check_string_dtype(snippets.dtype) is None)
    ):
        raise DataError(where, f"snippets must be a non-empty list of strings, got {snippets.dtype} {snippets.shape}")
    return snippets[()]


def read_tff_shakespeare(
    path: str | Path, clients: int | None = None
) -> tuple[list[str], list[tuple[np.ndarray, np.ndarray]]]:
    """Role names (sorted; the first ``clients``) and each role's encoded (inputs, targets) from a TFF ``.h5``."""
    import h5py

    path = Path(path)
    try:
        with h5py.File(path, "r") as h5:
            examples = h5.get("examples")
            if not isinstance(examples, h5py.Group):
                raise DataError(str(path), "not TFF's Shakespeare: no /examples group")
            roles = sorted(examples)[:clients]
            texts, counts = [], []
            for role in roles:
                where = f"{path}, client {role!r}"
                snippets = _tff_snippets(examples[role], where)
                for k, s in enumerate(snippets):
                    try:
                        texts.append(s.decode("utf-8") if isinstance(s, bytes) else str(s))
                    except UnicodeDecodeError as exc:
                        raise DataError(f"{where}, record {k}", f"not UTF-8 text ({exc})") from None
                counts.append(len(snippets))
    except DataError:
        raise
    except OSError as exc:
        raise DataError(str(path), f"not a readable HDF5 file ({exc})") from None
    except (
        KeyError,
        RuntimeError,
        AttributeError,
        TypeError,
        ValueError,
    ) as exc:  # h5py on objects of another kind than expected
        raise DataError(
            str(path), f"not TFF's Shakespeare layout ({' '.join(str(exc).split()) or type(exc).__name__})"
        ) from None
    if not roles:
        raise DataError(str(path), "no clients under /examples")
    x, y, rows = encode_snippets(texts)
    bounds = np.cumsum([0, *np.add.reduceat(rows, np.cumsum([0, *counts[:-1]]))])
    return roles, [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def tff_file(
    split: str,
    *,
    data_dirs: Sequence[str | Path] = (),
    download: bool = True,
    verify: bool = True,
    mirror: str | None = None,
) -> Path:
    """TFF's ``shakespeare_{split}.h5``: itself, its ``.h5.gz`` copy, or unpacked from TFF's archive (downloaded if
    needed)."""
    name, folder = f"shakespeare_{split}.h5", "shakespeare/tff"
    archive, archive_sha = TFF_ARCHIVE
    return locate_derived(
        RemoteFile(folder, name, "", TFF_FILES[name], TFF_BYTES[name]),
        [
            (RemoteFile(folder, name + ".gz", "", TFF_FILES[name + ".gz"], TFF_BYTES[name + ".gz"]), gunzip),
            (RemoteFile(folder, archive, TFF_URL + archive, archive_sha), tar_member(name)),
        ],
        extra_dirs=data_dirs,
        download=download,
        verify=verify,
        mirror=mirror,
    )


def load_tff_shakespeare(
    clients: int | None = None,
    *,
    data_dirs: Sequence[str | Path] = (),
    download: bool = True,
    verify: bool = True,
    mirror: str | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray]]:
    """TFF's roles as clients (the first ``clients`` by name) and the pooled test sequences of those roles."""
    paths = {
        s: tff_file(s, data_dirs=data_dirs, download=download, verify=verify, mirror=mirror) for s in ("train", "test")
    }
    roles, train = read_tff_shakespeare(paths["train"], clients)
    test_roles, test = read_tff_shakespeare(paths["test"])
    kept = set(roles)
    held = [part for role, part in zip(test_roles, test) if role in kept]
    test_x = np.concatenate([x for x, _ in held]) if held else np.zeros((0, SEQUENCE_LENGTH), dtype=np.int64)
    test_y = np.concatenate([y for _, y in held]) if held else np.zeros((0, SEQUENCE_LENGTH), dtype=np.int64)
    return train, (test_x, test_y)


def leaf_files(
    *, data_dirs: Sequence[str | Path] = (), download: bool = True, verify: bool = True, mirror: str | None = None
) -> tuple[list[Path], list[Path]]:
    """The registered LEAF Shakespeare ``(train, test)`` files, located and checked (downloadable from a mirror
    only)."""
    paths = {
        name: locate(
            RemoteFile("shakespeare/leaf", name, "", sha),
            extra_dirs=data_dirs,
            download=download,
            verify=verify,
            mirror=mirror,
        )
        for name, sha in LEAF_FILES.items()
    }
    return [p for n, p in paths.items() if n.startswith("train/")], [
        p for n, p in paths.items() if n.startswith("test/")
    ]
