"""Step-size schedules: one factor per round that multiplies every step size of the round.

The factor scales the local step η_l (hence every η_i = η_l/c_i) and the server step; RR-CLI's
global step keeps its ratio θ/(ηR) (see :class:`fedshuffle.server.MetaEpochExtrapolation`), so it
decays with them. Kinds:

* ``"constant"``: 1.
* ``"inverse_epochs"``: 1/(1 + e), e = number of completed epochs of computation (sample gradients
  so far divided by the number of training samples) — RR-CLI paper (Malinovsky et al. 2023) §4.5, "decaying ∝
  1/(1 + #passed epochs)".
* ``"step"``: ``decay_factor`` to the power of the number of milestones passed; milestones are fractions
  of the run (e.g. 0.5 and 0.75 of the rounds), as in the usual step decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedshuffle.core.errors import ConfigError

KINDS = ("constant", "inverse_epochs", "step")


@dataclass(frozen=True)
class Schedule:
    name: str = "constant"
    decay_at: tuple[float, ...] = ()
    decay_factor: float = 0.1
    total_rounds: int = 1

    def __post_init__(self) -> None:
        if self.name not in KINDS:
            raise ConfigError("name", f"unknown schedule {self.name!r}; accepted: {', '.join(KINDS)}")
        if self.name == "step" and not self.decay_at:
            raise ConfigError("decay_at", "a step schedule needs milestones, e.g. [0.5, 0.75] (fractions of the run)")
        if any(not 0 < m < 1 for m in self.decay_at) or list(self.decay_at) != sorted(self.decay_at):
            raise ConfigError("decay_at", f"milestones must be increasing fractions in (0, 1), got {list(self.decay_at)}")
        if not 0 < self.decay_factor <= 1:
            raise ConfigError("decay_factor", f"must be in (0, 1], got {self.decay_factor}")

    def __call__(self, round_index: int, epochs_done: float) -> float:
        if self.name == "constant":
            return 1.0
        if self.name == "inverse_epochs":
            return 1.0 / (1.0 + math.floor(epochs_done + 1e-9))
        passed = sum(round_index >= m * self.total_rounds for m in self.decay_at)
        return self.decay_factor**passed
