"""Memory estimates checked before anything is allocated.

A size that cannot fit (``data.samples = 1e12``, ``problem.hidden = [1e6, 1e6]``, an svmlight index of
10⁹, an ``.npy`` header claiming 10¹² rows) is refused with one :class:`ConfigError` naming the setting
or file, instead of a ``MemoryError`` (or the kernel's OOM killer) halfway through building a run.

The memory available to this process is the smallest of

* ``MemAvailable`` of ``/proc/meminfo`` (memory the kernel can hand out without swapping);
* the cgroup limit minus the cgroup's usage (``memory.max``/``memory.current``, or v1's
  ``memory.limit_in_bytes``/``memory.usage_in_bytes``);
* the soft ``RLIMIT_AS`` minus the address space already mapped (``VmSize``);
* ``FEDSHUFFLE_MAX_MEMORY`` (bytes, or with a K/M/G/T suffix), a cap a user or a test sets.

Estimates are deliberately simple upper bounds (a few copies of the largest array); a check fails
when the estimate exceeds :data:`HEADROOM` of what is available. Work that cannot be interrupted and
resumed (``inspect``'s expectations, generating a dataset) is also checked against time:
:func:`check_seconds` refuses an estimate beyond ``FEDSHUFFLE_MAX_SECONDS`` (default :data:`MAX_SECONDS`). Estimates up
to :data:`SMALL` pass
without reading the system (unless ``FEDSHUFFLE_MAX_MEMORY`` is set), and the system's figures are
re-read at most once a second, so that checks made every round cost microseconds.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from fedshuffle.core.errors import ConfigError

#: the share of available memory one estimate may claim
HEADROOM = 0.8
#: estimates up to this size are not checked (unless FEDSHUFFLE_MAX_MEMORY is set): they fit anywhere this runs
SMALL = 32 << 20
ENV = "FEDSHUFFLE_MAX_MEMORY"
#: seconds one uninterruptible computation may be estimated to take (``FEDSHUFFLE_MAX_SECONDS`` overrides)
MAX_SECONDS = 600.0
SECONDS_ENV = "FEDSHUFFLE_MAX_SECONDS"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room() -> int | None:
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        cap, used = _read_int(Path("/sys/fs/cgroup") / limit), _read_int(Path("/sys/fs/cgroup") / usage)
        if cap is not None and used is not None and cap < 1 << 60:
            return max(cap - used, 0)
    return None


def _address_space_room() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover (not POSIX)
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                mapped = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(soft - mapped, 0)


def parse_bytes(text: str) -> int:
    """``"512M"`` → 536870912; plain digits are bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise ConfigError(ENV, f"expected a size such as 4G, 512M or a number of bytes, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


_system: tuple[float, object, list[tuple[int, str]]] | None = None


def _system_room() -> list[tuple[int, str]]:
    """(bytes, source) of the system's bounds, re-read at most once a second (reading /proc takes ~1 ms)
    or when the address-space limit changes."""
    global _system
    try:
        import resource

        key: object = resource.getrlimit(resource.RLIMIT_AS)
    except ImportError:  # pragma: no cover (not POSIX)
        key = None
    now = time.monotonic()
    if _system is None or _system[1] != key or now - _system[0] > 1.0:
        readings = (
            (_meminfo("MemAvailable"), "available system memory"),
            (_cgroup_room(), "the cgroup's memory limit"),
            (_address_space_room(), "the address-space limit (ulimit -v)"),
        )
        _system = (now, key, [(value, source) for value, source in readings if value is not None])
    return _system[2]


def available_bytes() -> tuple[int, str]:
    """The memory this process may still use, and what bounds it (for the error message)."""
    candidates = list(_system_room())
    if (env := os.environ.get(ENV)) is not None:
        candidates.append((parse_bytes(env), ENV))
    return min(candidates) if candidates else (1 << 62, "no known limit")


def human(n: float) -> str:
    """Bytes in binary units: ``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"  # pragma: no cover


def check_fits(needed: float, setting: str, what: str, error: type[ConfigError] = ConfigError) -> None:
    """Raise ``error`` (a :class:`ConfigError`; :class:`DataError` for a file) on ``setting`` when ``what``
    needs more than HEADROOM of the available memory."""
    if needed <= SMALL and ENV not in os.environ:
        return
    room, source = available_bytes()
    if needed > HEADROOM * room:
        raise error(
            setting,
            f"{what} needs about {human(needed)} of memory, more than the {human(room)} available ({source}); use a "
            "smaller value",
        )


def array_bytes(*shape: float, itemsize: int = 8) -> float:
    """Bytes of a dense array of ``shape`` (a float: sizes from a config may be astronomically large)."""
    total = float(itemsize)
    for n in shape:
        total *= max(float(n), 0.0)
    return total


#: copies of a dataset's feature matrix alive while it is built (generated or read, split, cast)
DATASET_COPIES = 4
#: copies of the model a run keeps (parameters, server state, momentum, checkpoints in flight, evaluation)
MODEL_COPIES = 16


def check_dataset(
    samples: float, features: float, setting: str, what: str = "the dataset", error: type[ConfigError] = ConfigError
) -> None:
    """A dense ``samples × features`` float64 dataset, :data:`DATASET_COPIES` times over."""
    check_fits(
        DATASET_COPIES * array_bytes(samples, features + 1),
        setting,
        f"{what} ({samples:.0f} samples × {features:.0f} features)",
        error,
    )


def check_model(dim: float, setting: str, what: str = "the model", cohort: float = 1.0) -> None:
    """A model of ``dim`` float64 parameters: :data:`MODEL_COPIES` copies plus one update per cohort member."""
    check_fits(array_bytes(dim) * (MODEL_COPIES + 2 * cohort), setting, f"{what} ({dim:.0f} parameters)")


def check_seconds(estimate: float, setting: str, what: str, error: type[ConfigError] = ConfigError) -> None:
    """Raise ``error`` on ``setting`` when ``what`` is estimated (a lower bound from measured costs) to take
    longer than ``FEDSHUFFLE_MAX_SECONDS`` (default :data:`MAX_SECONDS`): it cannot be interrupted and resumed."""
    text = os.environ.get(SECONDS_ENV)
    try:
        budget = MAX_SECONDS if text is None else float(text)
    except ValueError:
        raise ConfigError(SECONDS_ENV, f"expected a number of seconds, got {text!r}") from None
    if not estimate <= budget:  # NaN too
        raise error(
            setting,
            f"{what} would take at least {estimate:.3g} s, more than the {budget:g} s allowed ({SECONDS_ENV}); use a "
            "smaller value",
        )
