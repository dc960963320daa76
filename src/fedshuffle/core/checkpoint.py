"""Checkpoints that carry no code, know when they were damaged, and know which run they belong to.

A checkpoint file is one header line ``fedshuffle-checkpoint 2 sha256=<hex>`` followed by the
``torch.save`` bytes of the run's state, whose SHA-256 the header holds: a file changed after it was
written (a flipped bit, a truncation) is refused on load with one line, instead of restoring state
that merely loads (a changed byte inside a metric's name loads as a different name).

The state is read back with ``torch.load(weights_only=True)``: PyTorch's restricted unpickler, which
rebuilds tensors, dicts, lists, tuples, numbers, strings and None and refuses every other object, so a
file cannot run code however it was made (the header's digest can be recomputed by anyone, so it
proves nothing about where a file came from). NumPy arrays and scalars in the state are saved as
tensors of their bytes with their dtype and shape (:func:`encode`) and given back as arrays
(:func:`decode`). Files of the first format (``fedshuffle-checkpoint sha256=``, arbitrary pickled
objects) are refused without being unpickled.

:func:`save_checkpoint` records the run a checkpoint belongs to (its config hash, variant, seed and
round); :func:`load_checkpoint` given the run it expects refuses a checkpoint of another run, so a
checkpoint copied from another seed's or variant's folder never continues there.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import read_regular, write_atomic

#: the first bytes of a checkpoint file, before the hex digest of the rest
MAGIC = b"fedshuffle-checkpoint 2 sha256="
#: the header of the first format, whose pickled objects could carry code
OLD_MAGIC = b"fedshuffle-checkpoint sha256="
#: the key under which a NumPy array's bytes are kept (with "dtype" and "shape")
ARRAY = "__numpy_array__"
REMEDY = "the run cannot be continued: start it again in another folder"


def encode(tree: Any) -> Any:
    """``tree`` with NumPy arrays as ``{ARRAY: uint8 tensor, "dtype": str, "shape": list}`` and NumPy scalars as
    Python numbers: what ``torch.load(weights_only=True)`` rebuilds. Other objects are refused (a ``TypeError``)."""
    import torch

    if isinstance(tree, np.ndarray):
        if tree.dtype.hasobject:
            raise TypeError("a checkpoint cannot hold arrays of Python objects")
        raw = np.ascontiguousarray(tree).reshape(-1).view(np.uint8)
        return {ARRAY: torch.from_numpy(raw.copy()), "dtype": tree.dtype.str, "shape": list(tree.shape)}
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, Mapping):
        return {k: encode(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(encode(v) for v in tree)
    if tree is None or isinstance(tree, (bool, int, float, str, torch.Tensor)):
        return tree
    raise TypeError(f"a checkpoint cannot hold a {type(tree).__name__}")


def decode(tree: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(tree, dict):
        if ARRAY in tree:
            dtype = np.dtype(str(tree["dtype"]))
            if dtype.hasobject:
                raise ValueError("an array of Python objects")
            return tree[ARRAY].numpy().view(dtype).reshape([int(n) for n in tree["shape"]]).copy()
        return {k: decode(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(decode(v) for v in tree)
    return tree


def describe(value: Any) -> str:
    """``ndarray (3, 9) of float32``, ``Tensor (4,) of torch.float64``, or the type's name of anything else."""
    import torch

    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"{type(value).__name__} {tuple(value.shape)} of {value.dtype}"
    return type(value).__name__


def other_keys(saved: Mapping[Any, Any], reference: Iterable[Any], at: str) -> str | None:
    """How the keys of ``saved`` differ from ``reference``'s (None: the same)."""
    extra = sorted(map(repr, set(saved) - set(reference)))[:5]
    missing = sorted(map(repr, set(reference) - set(saved)))[:5]
    parts = [f"extra {', '.join(extra)}" if extra else "", f"missing {', '.join(missing)}" if missing else ""]
    return f"{at} has other keys than the run's ({'; '.join(p for p in parts if p)})" if extra or missing else None


def mismatch(saved: Any, reference: Any, at: str = "state") -> str | None:
    """Where and how ``saved`` (a decoded checkpoint's tree) differs in structure from ``reference`` (the run's own
    state): the keys of every dict, the type, dtype and shape of every tensor and array, the type of anything else;
    None where it has the run's structure."""
    import torch

    if isinstance(reference, Mapping):
        if not isinstance(saved, Mapping):
            return f"{at} is a {describe(saved)}, expected a dict"
        return other_keys(saved, reference, at) or next(
            (why for key in reference if (why := mismatch(saved[key], reference[key], f"{at}.{key}"))), None
        )
    if isinstance(reference, (torch.Tensor, np.ndarray)):
        same = type(saved) is type(reference) and saved.dtype == reference.dtype and saved.shape == reference.shape
        return None if same else f"{at} is a {describe(saved)}, the run's is a {describe(reference)}"
    if type(saved) is type(reference):
        return None
    return f"{at} is a {describe(saved)}, the run's is a {describe(reference)}"


def save_checkpoint(path: Path, state: Mapping[str, Any], run: Mapping[str, Any] | None = None) -> None:
    """Write ``state`` atomically, serialized once, behind a header with its SHA-256; ``run`` (config hash,
    variant, seed, round) is recorded beside it for :func:`load_checkpoint` to check."""
    import torch

    buffer = io.BytesIO()
    torch.save({"run": dict(run or {}), "state": encode(dict(state))}, buffer)
    payload = buffer.getvalue()
    write_atomic(path, MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


def load_checkpoint(path: Path, run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The state saved by :func:`save_checkpoint` (see :func:`read_checkpoint`)."""
    return read_checkpoint(path, run)[1]


def read_checkpoint(path: Path, run: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run recorded by :func:`save_checkpoint` and the state. A file that does not load, whose digest
    differs, of the first format, or (given ``run``) recorded for another run is a ``ConfigError`` naming it."""
    import torch

    try:
        header, _, payload = read_regular(path).partition(b"\n")
        if header.startswith(OLD_MAGIC):
            raise ConfigError(
                str(path),
                "a checkpoint of an earlier fedshuffle, whose format can carry code: it is not read; " + REMEDY,
            )
        if not header.startswith(MAGIC):
            raise ConfigError(str(path), f"damaged checkpoint (no checkpoint header); {REMEDY}")
        if hashlib.sha256(payload).hexdigest().encode() != header[len(MAGIC) :]:
            raise ConfigError(str(path), f"damaged checkpoint (its SHA-256 does not match its contents); {REMEDY}")
        saved = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        if (
            not isinstance(saved, dict)
            or not isinstance(saved.get("run"), dict)
            or not isinstance(saved.get("state"), dict)
        ):
            raise ConfigError(str(path), f"damaged checkpoint (not a run's state); {REMEDY}")
        state = decode(saved["state"])
    except ConfigError:
        raise
    except OSError as exc:
        raise ConfigError(str(path), f"unreadable checkpoint ({exc.strerror or exc}); {REMEDY}") from None
    except pickle.UnpicklingError:
        raise ConfigError(
            str(path),
            "refused: it holds objects other than tensors, numbers, strings, lists and dicts, which no checkpoint "
            f"of fedshuffle holds; {REMEDY}",
        ) from None
    except Exception as exc:  # reading or loading a damaged or hostile file raises many kinds of errors
        raise ConfigError(str(path), f"damaged checkpoint ({exc.__class__.__name__}); {REMEDY}") from None
    if run is not None:
        recorded = saved["run"]
        differ = [
            f"{key}: {recorded.get(key, '(none)')!r} there, {value!r} here"
            for key, value in run.items()
            if recorded.get(key, "(none)") != value
        ]
        if differ:
            raise ConfigError(
                str(path),
                f"belongs to another run ({'; '.join(differ)}): a checkpoint copied from another folder is not "
                "continued; "
                "put back this run's checkpoint, or start the run again in another folder",
            )
    return dict(saved["run"]), state
