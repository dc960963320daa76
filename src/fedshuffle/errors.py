"""Errors that name what the user must change."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input: ``field`` names the setting (dotted path), ``message`` says what is accepted."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class DivergenceError(RuntimeError):
    """The iterate or the objective became NaN/inf at ``round``."""

    def __init__(self, round_index: int, what: str) -> None:
        self.round = round_index
        super().__init__(f"run diverged at round {round_index}: {what} is not finite")
