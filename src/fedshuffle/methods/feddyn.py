"""FedDyn (Acar et al., ICLR 2021, "Federated Learning Based on Dynamic Regularization", Algorithm 1)."""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from fedshuffle.aggregation import Aggregator
from fedshuffle.core.registry import Example, StepSize
from fedshuffle.methods.base import METHODS, ClientResult, Method, last_occurrence, sample_gradients


class FedDyn(Method):
    """Dynamic regularization: client i minimizes

        L_i(θ) − ⟨∇L_i^{t−1}, θ⟩ + (α/2)‖θ − x^{t−1}‖²

    by its planned local steps (d = ∇f_batch(θ) − ∇L_i^{t−1} + α(θ − x)), then keeps
    ∇L_i^t = ∇L_i^{t−1} − α(θ_i^t − x^{t−1}) and its model θ_i^t (for the local-model metrics,
    :func:`fedshuffle.metrics.local_model_scores`). The server keeps h:

        h^t = h^{t−1} − α Σ_{i∈S} w_i(θ_i^t − x^{t−1}),    x^t = Σ_{i∈S} ŵ_iθ_i^t − h^t/α,

    with ŵ the cohort's sum-one weights. With w_i = 1/m these are the paper's (1/m)Σ and (1/|P|)Σ;
    with data weights, h = Σ_i w_i∇L_i, so a fixed point has Σ_i w_i∇f_i(x) = 0: the exact minimizer
    of Σ w_i f_i on heterogeneous data (a test checks it). The server step is d = x^{t−1} − x^t, so
    a server optimizer with step 1 (the default) gives the paper's update.

    Convention: with unequal client sizes we take one α and the data weights w_i; the official code uses
    α_i = α/(M·w_i) per client and uniform averages (the same algorithm when w_i = 1/M).
    """

    name = "feddyn"
    state_fields = ("gradient", "model")
    local_model_field = "model"  # θ_i, scored by fedshuffle.metrics.local_model_scores
    sets_own_prox = True
    plain_local_steps = False

    def __init__(
        self,
        aggregator: Aggregator,
        alpha: Annotated[float, Field(gt=0, description="regularization α > 0"), StepSize()] = 0.01,
    ) -> None:
        super().__init__(aggregator)
        self.alpha = alpha

    def init(self, params):
        return {"h": torch.zeros_like(params), "x0": params.clone()}

    def client_update(self, broadcast, plans, rows, trainer):
        x = broadcast["model"]
        deltas = trainer.train(plans, x, center=x, offset=-rows["gradient"], prox_mu=self.alpha)
        return ClientResult(
            {"delta": deltas},
            {"gradient": rows["gradient"] + self.alpha * deltas, "model": x - deltas},
            sample_gradients(plans),
        )

    def aggregate(self, rnd, params, state, payload):
        if len(rnd.cohort) == 0:
            return torch.zeros_like(params), state, {}
        deltas = payload["delta"]  # x − θ_i
        keep = last_occurrence(rnd.cohort)
        h = state["h"] + self.alpha * (rnd.member_weights(params)[keep] @ deltas[keep])
        weights = rnd.member_weights(params)
        mean_delta = (weights / weights.sum()) @ deltas
        return mean_delta + h / self.alpha, {**state, "h": h}, {}

    def describe(self):
        return f"feddyn (α = {self.alpha})"


METHODS.add(
    "feddyn",
    FedDyn,
    "dynamic regularization: linear and quadratic terms in the local objective, server state h",
    "Acar, Zhao, Matas, Mattina, Whatmough & Saligrama, Federated Learning Based on Dynamic Regularization, ICLR "
    "2021, Algorithm 1",
    local={"order": "reshuffle"},
    example=Example(),
)
