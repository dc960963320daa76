"""Errors that name what the user must change."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


class ConfigError(ValueError):
    """Bad input: ``field`` names the setting (dotted path), ``message`` says what is accepted."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        """Pickled as its field and message (a worker process's error reaches the command whole)."""
        return type(self), (self.field, self.message)


def did_you_mean(value: object, accepted: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the accepted name closest to ``value``, or an empty string."""
    hint = difflib.get_close_matches(str(value), list(accepted), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


class ResultsError(OSError):
    """The results folder cannot be written (permissions, disk full): nothing about the config is wrong."""


class ClusterError(RuntimeError):
    """The machinery a run needs did not work (Ray did not start): nothing about the config is wrong, and what
    was written stays resumable."""


class DataError(ConfigError):
    """A data file that cannot be used: ``field`` is the file (and line, where one is to blame)."""


@contextmanager
def section(name: str) -> Iterator[None]:
    """Errors raised inside name their own parameter; prefix it with the section it was set in.

    A part (a method, a sampler, a data source) raises ``ConfigError("alpha", ...)`` about its own
    parameter; the configuration layer wraps the call in ``section("method")`` so the user reads
    ``method.alpha``. Fields that are already dotted paths, and data files, are left as they are.
    """
    try:
        yield
    except ConfigError as exc:
        if "." in exc.field or isinstance(exc, DataError):
            raise
        raise ConfigError(f"{name}.{exc.field}", exc.message) from None
