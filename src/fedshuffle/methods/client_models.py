"""The clients' own models of a method that keeps none: each client's model after its last local training.

FedCDR keeps each client's x_i = prox_{ηf_i}(y_i) and FedDyn its θ_i, and :func:`fedshuffle.metrics.local_model_scores`
scores them on the clients' own data (the public FedDR code's evaluation point). A method with the default halves
(FedAvg, RR-CLI, Nastya, …) keeps no client model: its clients train y_i from the server model x and upload
Δ_i = x − y_i. :class:`ClientModels` keeps that y_i = x − Δ_i per client, so that such a method is scored at its
clients' own models the same way (``run.score_client_models``): a personalised reading judged on equal terms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.local.plan import ClientPlan
from fedshuffle.methods.base import ClientResult, Method, RoundInfo, State, Trainer


class ClientModels(Method):
    """A method with the default halves that also keeps, per client, the model its last local training ended at,
    y_i = x − Δ_i (a client that has not taken part holds the start x⁰). The server half and the updates are the
    method's own; only the summing of the updates as they are produced is given up (each Δ_i is needed)."""

    local_model_field = "own_model"

    def __init__(self, inner: Method) -> None:
        super().__init__(inner.aggregator)
        self.inner, self.name = inner, inner.name
        self.payload_fields, self.needs_cycles = inner.payload_fields, inner.needs_cycles
        self.sets_own_prox = inner.sets_own_prox
        self.plain_local_steps = inner.plain_local_steps
        self.state_fields = (self.local_model_field,)

    def init(self, params: torch.Tensor) -> State:
        return {"inner": self.inner.init(params), "x0": params.clone()}

    def configure(self, rnd: RoundInfo, params: torch.Tensor, state: State) -> dict[str, torch.Tensor]:
        return self.inner.configure(rnd, params, state["inner"])

    def aggregation_weights(self, rnd: RoundInfo) -> np.ndarray:
        return self.inner.aggregation_weights(rnd)

    def aggregate(
        self, rnd: RoundInfo, params: torch.Tensor, state: State, payload: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, State, dict[str, float]]:
        direction, inner, extras = self.inner.aggregate(rnd, params, state["inner"], payload)
        return direction, {**state, "inner": inner}, extras

    def client_update(
        self,
        broadcast: Mapping[str, torch.Tensor],
        plans: Sequence[ClientPlan],
        rows: Mapping[str, torch.Tensor],
        trainer: Trainer,
        weights: torch.Tensor | None = None,
    ) -> ClientResult:
        """The method's Δ_i, and each member's own model y_i = x − Δ_i as its new row."""
        result = self.inner.client_update(broadcast, plans, {}, trainer)
        result.rows = {self.local_model_field: broadcast["model"] - result.payload["delta"]}
        return result

    def describe(self) -> str:
        return f"{self.inner.describe()}, its clients' own models kept"


def keep_client_models(method: Method) -> Method:
    """``method`` keeping its clients' own models for scoring: itself when it already keeps them (FedCDR, FedDyn),
    :class:`ClientModels` around a method with the default halves; refused in one line otherwise."""
    if getattr(method, "local_model_field", None) is not None:
        return method
    if not method.sums_updates:
        raise ConfigError(
            "run.score_client_models",
            f"{method.describe()} changes its clients' updates or the server's "
            "sum of them, so its clients' own models are not x − Δ_i; it covers methods with the default "
            "halves (FedAvg, RR-CLI, Nastya, FedShuffle, FedNova, …) and those that keep client models",
        )
    return ClientModels(method)
