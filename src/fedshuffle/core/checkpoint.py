"""Checkpoints that know when they were damaged.

A checkpoint is the ``torch.save`` bytes of the run's state, wrapped with their SHA-256: a file changed
after it was written (a flipped bit, a truncation, another file copied over it) is refused on load with
one line, instead of restoring state that merely unpickles (a changed byte inside a metric's name
loads as a different name).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import write_atomic


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically as ``{"payload": torch.save bytes, "sha256": their digest}``."""
    import torch

    inner = io.BytesIO()
    torch.save(state, inner)
    payload = inner.getvalue()
    outer = io.BytesIO()
    torch.save({"payload": payload, "sha256": hashlib.sha256(payload).hexdigest()}, outer)
    write_atomic(path, outer.getvalue())


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The state saved by :func:`save_checkpoint`; a file that does not load or whose digest differs is a
    ``ConfigError`` naming it."""
    import torch

    remedy = "the run cannot be continued: start it again in another folder"
    try:
        sealed = torch.load(path, weights_only=False)
        payload, digest = sealed["payload"], sealed["sha256"]
        if hashlib.sha256(payload).hexdigest() != digest:
            raise ConfigError(str(path), f"damaged checkpoint (its SHA-256 does not match its contents); {remedy}")
        state = torch.load(io.BytesIO(payload), weights_only=False)
    except ConfigError:
        raise
    except Exception as exc:  # torch.load raises many kinds of errors on a damaged file
        raise ConfigError(str(path), f"damaged checkpoint ({exc.__class__.__name__}); {remedy}") from None
    if not isinstance(state, dict):
        raise ConfigError(str(path), f"damaged checkpoint (holds a {type(state).__name__}, not a run's state); {remedy}")
    return state
