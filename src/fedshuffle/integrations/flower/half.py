"""The server half of a run on the population's sizes alone (no samples: the nodes keep their own)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedshuffle.local.plan import CohortPlan
from fedshuffle.methods.base import ClientResult, RoundInfo
from fedshuffle.simulation import RoundRecord, Server


class ServerHalf(Server):
    """The simulation's :class:`Server` on the population's sizes alone: cohort, plans, broadcast, aggregation and
    server step, no samples and no client rows (nodes keep their own). ``last_round[i]`` is the last
    round whose update the server accepted from client i (−1: never); it is what a client's state must
    match, and it says who takes part for the first time. The members dropped so far are the ``dropped``
    entry of ``last_extras`` (the ``dropped`` metric)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.last_round = np.full(self.data.num_clients, -1, dtype=np.int64)
        self.last_extras = {"dropped": 0}

    @property
    def dropped(self) -> int:
        return int(self.last_extras.get("dropped", 0))

    def close_round(
        self,
        rnd: RoundInfo,
        points: list[torch.Tensor],
        broadcast: dict[str, torch.Tensor],
        result: ClientResult | None,
        compute_seconds: float = 0.0,
        dropped: int = 0,
    ) -> RoundRecord:
        """:meth:`Server.close_round` of the members that finished (``dropped``: how many did not); they are
        accepted."""
        before = self.dropped
        record = super().close_round(rnd, points, broadcast, result, compute_seconds)
        self.last_extras = {**record.extras, "dropped": before + dropped}
        self.last_round[np.unique(rnd.cohort)] = rnd.index
        return record

    def participated(self, clients: np.ndarray) -> np.ndarray:
        if not self.method.state_fields:
            return super().participated(clients)
        return self.last_round[clients] >= 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_round": self.last_round.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_round = np.array(state["last_round"], dtype=np.int64)


def keep_members(rnd: RoundInfo, keep: np.ndarray) -> RoundInfo:
    """The round without the members ``keep`` is False for (they did not finish)."""
    keep = np.asarray(keep, dtype=bool)
    if keep.all():
        return rnd
    first = rnd.first_time[keep] if len(rnd.first_time) else rnd.first_time
    return replace(
        rnd, cohort=rnd.cohort[keep], plans=CohortPlan.of(rnd.plans).take(np.flatnonzero(keep)), first_time=first
    )
