"""Checkpoints that know when they were damaged.

A checkpoint file is one header line ``fedshuffle-checkpoint sha256=<hex>`` followed by the ``torch.save``
bytes of the run's state, whose SHA-256 the header holds: a file changed after it was written (a flipped
bit, a truncation, another file copied over it) is refused on load with one line, instead of restoring
state that merely unpickles (a changed byte inside a metric's name loads as a different name).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import write_atomic

#: the first bytes of a checkpoint file, before the hex digest of the rest
MAGIC = b"fedshuffle-checkpoint sha256="


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically, serialized once, behind a header with its SHA-256."""
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    write_atomic(path, MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The state saved by :func:`save_checkpoint`; a file that does not load or whose digest differs is a
    ``ConfigError`` naming it."""
    import torch

    remedy = "the run cannot be continued: start it again in another folder"
    try:
        header, _, payload = Path(path).read_bytes().partition(b"\n")
        if not header.startswith(MAGIC):
            raise ConfigError(str(path), f"damaged checkpoint (no checkpoint header); {remedy}")
        if hashlib.sha256(payload).hexdigest().encode() != header[len(MAGIC):]:
            raise ConfigError(str(path), f"damaged checkpoint (its SHA-256 does not match its contents); {remedy}")
        state = torch.load(io.BytesIO(payload), weights_only=False)
    except ConfigError:
        raise
    except Exception as exc:  # reading or torch.load of a damaged file raises many kinds of errors
        raise ConfigError(str(path), f"damaged checkpoint ({exc.__class__.__name__}); {remedy}") from None
    if not isinstance(state, dict):
        raise ConfigError(str(path), f"damaged checkpoint (holds a {type(state).__name__}, not a run's state); {remedy}")
    return state
