"""Errors that name what the user must change."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input: ``field`` names the setting (dotted path), ``message`` says what is accepted."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class ResultsError(OSError):
    """The results folder cannot be written (permissions, disk full): nothing about the config is wrong."""


class DataError(ConfigError):
    """A data file that cannot be used: ``field`` is the file (and line, where one is to blame)."""
