"""Reading a file named by the user without blocking or reading without end.

A FIFO named as a config file would block ``open`` until a writer comes; ``/dev/zero`` would be read
forever. :func:`read_regular_file` refuses anything but a regular file before reading it (checked
with ``stat`` before opening, and again with ``fstat`` on what was opened, which is opened
non-blocking, so a file swapped in between cannot block either), and reads at most ``max_bytes``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import special_kind
from fedshuffle.core.limits import human


def read_regular_file(path: str | Path, field: str, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``; anything else is a
    :class:`ConfigError` on ``field`` naming the file and what it is."""
    path = Path(path)
    try:
        kind = special_kind(os.stat(path).st_mode)
        if kind is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
            with os.fdopen(fd, "rb") as fh:
                kind = special_kind(os.fstat(fh.fileno()).st_mode)
                data = b"" if kind else fh.read(max_bytes + 1)
    except FileNotFoundError:
        raise ConfigError(field, f"file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path} ({exc.strerror or exc})") from None
    if kind is not None:
        raise ConfigError(field, f"{path} is {kind}, not a regular file; give a {what}")
    if len(data) > max_bytes:
        raise ConfigError(field, f"{path} is larger than {human(max_bytes)}, more than any {what} needs")
    return data


def usable_path_name(v: str | None) -> str | None:
    """A path the file system can take: no NUL byte, no name over 255 bytes, at most 4096 bytes in all."""
    if v is None:
        return v
    if "\0" in v:
        raise ValueError("a path cannot hold a NUL byte")
    if len(v.encode("utf-8", "surrogateescape")) > 4096 or any(
        len(part.encode("utf-8", "surrogateescape")) > 255 for part in Path(v).parts
    ):
        raise ValueError("too long for a path (each name at most 255 bytes, the whole path 4096)")
    return v


def summable(v: Any) -> Any:
    """Per-client values whose sum is a finite float (1e308 twice overflows to inf, and ω = w̃/Σw̃ to 0)."""
    if isinstance(v, list) and not math.isfinite(sum(v)):
        raise ValueError("the values sum to more than the largest float (about 1.8e308); scale them down")
    return v


#: a data file or folder named in a configuration
DataPath = Annotated[
    str | None,
    AfterValidator(usable_path_name),
    Field(description="a data file or folder; relative to the config file"),
]
#: checks a setting that may be one number per client (weights, probabilities): finite in sum
Summable = AfterValidator(summable)
