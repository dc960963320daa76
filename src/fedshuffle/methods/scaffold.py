"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1): control variates in every local step."""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import Field

from fedshuffle.aggregation import Aggregator
from fedshuffle.core.registry import Example
from fedshuffle.methods.base import METHODS, ClientResult, Method, last_occurrence, sample_gradients

OPTIONS = ("I", "II")


class Scaffold(Method):
    """Clients step y ← y − η_i(g_i(y) − c_i + c) and return Δy_i = x − y_i and Δc_i = c_i⁺ − c_i, with

        c_i⁺ = ∇f_i(x)                          (option I: one full local gradient)
        c_i⁺ = c_i − c + (x − y_i)/(τ_iη_i)     (option II).

    The server takes the aggregation of Δy_i and c ← c + Σ_{i∈S} w_iΔc_i, which keeps c = Σ_i w_i c_i
    (the paper's (|S|/N)·mean_S Δc_i for uniform weights). A client sampled twice in a round keeps its
    last update. Clients upload Δy_i and Δc_i and download x and c.
    """

    name = "scaffold"
    state_fields = ("control",)
    payload_fields = ("delta", "control_delta")
    plain_local_steps = False

    def __init__(
        self,
        aggregator: Aggregator,
        option: Annotated[
            Literal[OPTIONS], Field(description="control variate update: option I (a full local gradient) or II")
        ] = "II",
    ) -> None:
        super().__init__(aggregator)
        self.option = option

    def init(self, params):
        return {"control": torch.zeros_like(params)}

    def configure(self, rnd, params, state):
        return {"model": params, "control": state["control"]}

    def client_update(self, broadcast, plans, rows, trainer):
        x, c, own = broadcast["model"], broadcast["control"], rows["control"]
        deltas = trainer.train(plans, x, offset=c - own)
        work = sample_gradients(plans)
        clients = [p.client for p in plans]
        if self.option == "I":
            updated = trainer.gradients(x, clients)
            work += trainer.sizes(clients)
        else:
            scale = torch.tensor([p.steps * p.lr for p in plans], dtype=deltas.dtype, device=deltas.device).unsqueeze(1)
            updated = own - c + deltas / scale
        return ClientResult({"delta": deltas, "control_delta": updated - own}, {"control": updated}, work)

    def aggregate(self, rnd, params, state, payload):
        direction, state, extras = super().aggregate(rnd, params, state, payload)
        if len(rnd.cohort):
            keep = last_occurrence(rnd.cohort)
            weights = torch.as_tensor(rnd.objective_weights[rnd.cohort[keep]], dtype=params.dtype, device=params.device)
            state = {**state, "control": state["control"] + weights @ payload["control_delta"][keep]}
        return direction, state, extras

    def describe(self):
        return f"scaffold (option {self.option})"


METHODS.add(
    "scaffold",
    Scaffold,
    "control variates c, c_i in every local step (option I or II)",
    "Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, SCAFFOLD, ICML 2020, Algorithm 1",
    local={"order": "with_replacement"},
    aggregation={"normalization": "unbiased"},
    example=Example(),
)
