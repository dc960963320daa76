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
from typing import Annotated

from pydantic import AfterValidator, Field

from fedshuffle.core.registry import Example, Registry


def _milestones(at: list[float]) -> list[float]:
    if any(not 0 < m < 1 for m in at) or at != sorted(at):
        raise ValueError(f"milestones must be increasing fractions in (0, 1), got {at}")
    return at


@dataclass(frozen=True)
class Schedule:
    """The factor of round ``round_index`` after ``epochs_done`` epochs of computation (module docstring);
    ``total_rounds`` is the run length the step schedule's milestones refer to."""

    name: str = "constant"
    decay_at: tuple[float, ...] = ()
    decay_factor: float = 0.1
    total_rounds: int = 1

    def __call__(self, round_index: int, epochs_done: float) -> float:
        if self.name == "constant":
            return 1.0
        if self.name == "inverse_epochs":
            return 1.0 / (1.0 + math.floor(epochs_done + 1e-9))
        passed = sum(round_index >= m * self.total_rounds for m in self.decay_at)
        return self.decay_factor**passed


def constant() -> Schedule:
    return Schedule("constant")


def inverse_epochs() -> Schedule:
    return Schedule("inverse_epochs")


def step(
    total_rounds: int,
    decay_at: Annotated[
        list[float],
        AfterValidator(_milestones),
        Field(min_length=1, description="milestones as increasing fractions of the run, e.g. [0.5, 0.75]"),
    ],
    decay_factor: Annotated[float, Field(gt=0, le=1, description="the factor applied at each milestone")] = 0.1,
) -> Schedule:
    return Schedule("step", tuple(decay_at), decay_factor, total_rounds)


#: Schedules by name; the framework passes the run's length (``total_rounds``).
SCHEDULES = Registry("schedule.name", runtime=("total_rounds",), noun="schedule")
SCHEDULES.add("constant", constant, "1 every round", example=Example())
SCHEDULES.add(
    "inverse_epochs",
    inverse_epochs,
    "1/(1 + completed epochs of computation)",
    "Malinovsky, Horváth, Burlachenko & Richtárik 2023 (RR-CLI), §4.5",
    example=Example(),
)
SCHEDULES.add(
    "step", step, "decay_factor to the power of the milestones passed", example=Example(settings={"decay_at": [0.5]})
)
