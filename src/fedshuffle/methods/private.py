"""Differential privacy's client half around a method (:mod:`fedshuffle.privacy` has the math, the settings and the
server half)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedshuffle.aggregation import Aggregator
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.streams import Stream
from fedshuffle.local.plan import ClientPlan
from fedshuffle.methods.base import ClientResult, Method, RoundInfo, State, Trainer
from fedshuffle.privacy import CLIP, UNCLIPPED, PrivacySettings, clip_updates, gaussian


class PrivateClients(Method):
    """A method with the default halves whose client half clips each member's update to C (and, with local DP, adds
    N(0, σ²C²I)): the server half is the method's own; the central noise is
    :class:`fedshuffle.privacy.PrivateAggregation`'s.

    It never sums the updates as they are produced (``sums_updates`` is False): clipping needs each Δ_i."""

    def __init__(self, inner: Method, privacy: PrivacySettings) -> None:
        super().__init__(inner.aggregator)
        self.inner, self.privacy = inner, privacy
        self.name = inner.name
        self.payload_fields = inner.payload_fields
        self.needs_cycles = inner.needs_cycles
        self.sets_own_prox = inner.sets_own_prox
        self.plain_local_steps = inner.plain_local_steps

    def init(self, params: torch.Tensor) -> State:
        return {"inner": self.inner.init(params)}

    def configure(self, rnd: RoundInfo, params: torch.Tensor, state: State) -> dict[str, torch.Tensor]:
        return self.inner.configure(rnd, params, state["inner"])

    def aggregation_weights(self, rnd: RoundInfo) -> np.ndarray:
        return self.inner.aggregation_weights(rnd)

    def aggregate(
        self, rnd: RoundInfo, params: torch.Tensor, state: State, payload: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, State, dict[str, float]]:
        direction, inner, extras = self.inner.aggregate(rnd, params, state["inner"], payload)
        return direction, {"inner": inner}, extras

    def client_update(
        self,
        broadcast: Mapping[str, torch.Tensor],
        plans: Sequence[ClientPlan],
        rows: Mapping[str, torch.Tensor],
        trainer: Trainer,
        weights: torch.Tensor | None = None,
    ) -> ClientResult:
        """The method's Δ_i, clipped to the round's C (the broadcast's with adaptive clipping); with local DP, plus
        σC·ξ_i,
        ξ_i drawn from the stream at the plan's key (seed, round, client, occurrence), which the planner sets and a
        Flower
        node rebuilds from its message (:func:`~fedshuffle.integrations.flower.messages.records_plans`)."""
        result = self.inner.client_update(broadcast, plans, rows, trainer)
        p = self.privacy
        clip = float(broadcast[CLIP][0]) if p.adaptive else float(p.clip)
        deltas, unclipped = clip_updates(result.payload["delta"], clip)
        if p.mode == "local" and p.noise_multiplier > 0:
            noise = np.stack(
                [
                    gaussian(p.noise, deltas.shape[1], plan.key[0], Stream.CLIENT_PRIVACY, *plan.key[1:])
                    for plan in plans
                ]
            )
            deltas = deltas + (p.noise_multiplier * clip) * torch.from_numpy(noise).to(deltas.device, deltas.dtype)
        result.payload = {**result.payload, "delta": deltas}
        if p.adaptive:
            result.extras = {**result.extras, UNCLIPPED: float(unclipped.double().mean())}
        return result

    @property
    def server_needs_only_sum(self) -> bool:
        """The method's own: clipping and local noise change each Δ_i, not how the server combines them, so a secure sum
        (Flower's SecAgg+) of the private updates may stand in for them; central noise is added to that sum."""
        return self.inner.server_needs_only_sum

    def sum_weights(self, rnd: RoundInfo) -> np.ndarray:
        return self.inner.sum_weights(rnd)

    def describe(self) -> str:
        return f"{self.inner.describe()} with {self.privacy.mode} DP"


def private_method(method: Method, privacy: PrivacySettings) -> Method:
    """``method`` with its updates clipped and noised as ``privacy`` says (itself when privacy is off). Refuses, in one
    line, a method whose client half uploads more than Δ_i or whose server half is not Σ ω_iΔ_i, and a central DP
    whose aggregation weights have no bound fixed before the round."""
    if not privacy.active:
        return method
    if not method.sums_updates:
        raise ConfigError(
            "privacy.mode",
            f"{privacy.mode!r} DP covers methods whose clients upload only Δ_i and whose server sums ω_iΔ_i; "
            f"{method.name}{' with global momentum' if hasattr(method, 'inner') else ''} uploads or aggregates more "
            "(use privacy.mode = 'none')",
        )
    aggregator: Aggregator = method.aggregator
    if privacy.mode == "central":
        for setting, value, accepted in (
            ("normalization", aggregator.normalization, "unbiased"),
            ("direction", aggregator.direction, "model_delta"),
        ):
            if value != accepted:
                raise ConfigError(
                    f"aggregation.{setting}",
                    f"privacy.mode = 'central' needs weights ω_i fixed before the round (sensitivity C·max ω_i); "
                    f"{setting} = {value!r} makes them depend on the round; use {accepted!r} ({method.name})",
                )
        if aggregator.weighting == "normalized":
            raise ConfigError(
                "aggregation.weighting",
                f"privacy.mode = 'central' needs weights ω_i fixed before the round (sensitivity C·max ω_i); "
                "'normalized' (FedNova's) depends on each round's local work; use 'data', 'uniform' or a list, or "
                f"privacy.mode = 'local' ({method.name})",
            )
    return PrivateClients(method, privacy)
