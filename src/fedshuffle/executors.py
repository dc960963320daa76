"""Executors run the planned local rounds of a cohort.

An executor receives fully planned client rounds (:class:`fedshuffle.local.ClientPlan`: the exact
minibatch sequence and step size of every client) and a shared :class:`fedshuffle.local.LocalRule`,
and returns the stacked client updates Δ (one row per cohort member). Because all randomness is in
the plans, any executor — the sequential reference here, a vectorized or a distributed one — must
return the same numbers up to floating-point reassociation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from .data import FederatedDataset
from .local import ClientPlan, LocalRule, run_client
from .problems import Problem


class Executor(Protocol):
    """Runs a cohort's local work."""

    def run(self, problem: Problem, data: FederatedDataset, params: torch.Tensor, plans: Sequence[ClientPlan], rule: LocalRule) -> torch.Tensor:
        """Client updates Δ_i = x − y_i stacked as a ``(len(plans), d)`` tensor."""
        ...

    def client_gradients(self, problem: Problem, data: FederatedDataset, params: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        """Full local gradients ∇f_i(x) of ``clients``, stacked as ``(len(clients), d)``."""
        ...


class SequentialExecutor:
    """The reference: one client after another, one step after another."""

    name = "sequential"

    def run(self, problem, data, params, plans, rule):
        if not plans:
            return params.new_zeros((0, params.numel()))
        return torch.stack([run_client(problem, data.features, data.labels, params, plan, rule) for plan in plans])

    def client_gradients(self, problem, data, params, clients):
        rows = [torch.from_numpy(data.client_indices[i]) for i in clients]
        return torch.stack([problem.gradient(params, data.features[r], data.labels[r]) for r in rows])


EXECUTORS = {"sequential": SequentialExecutor}
