"""Executors run the planned local rounds of a cohort.

An executor receives fully planned client rounds (:class:`fedshuffle.local.ClientPlan`: the exact
minibatch sequence and step size of every client) and a shared :class:`fedshuffle.local.LocalRule`,
and returns the stacked client updates Δ (one row per cohort member). Because all randomness is in
the plans, any executor — the sequential reference here, a vectorized or a distributed one — must
return the same numbers up to floating-point reassociation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from fedshuffle.data import FederatedDataset, LazyFederatedDataset
from fedshuffle.core.errors import ConfigError
from fedshuffle.local.plan import ClientPlan, LocalRule, local_direction, run_client
from fedshuffle.problems import Problem


class Executor(Protocol):
    """Runs a cohort's local work."""

    def run(self, problem: Problem, data: FederatedDataset, params: torch.Tensor, plans: Sequence[ClientPlan], rule: LocalRule) -> torch.Tensor:
        """Client updates Δ_i = s_i − y_i stacked as a ``(len(plans), d)`` tensor, s_i the plan's start (default x)."""
        ...

    def client_gradients(self, problem: Problem, data: FederatedDataset, params: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        """Full local gradients ∇f_i(x) of ``clients``, stacked as ``(len(clients), d)``; ``params`` is one
        model ``(d,)`` for all, or one per client ``(len(clients), d)``."""
        ...


Data = FederatedDataset | LazyFederatedDataset


def _localized(data: LazyFederatedDataset, row_sets: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """Generate only the rows ``row_sets`` use (−1 is padding) and renumber the sets into them."""
    rows = np.unique(np.concatenate([r[r >= 0] for r in row_sets]))
    features, labels = data.gather(rows)
    return features, labels, [np.where(r >= 0, np.searchsorted(rows, r), -1) for r in row_sets]


def rows_of(data: Data, plans: Sequence[ClientPlan]) -> tuple[torch.Tensor, torch.Tensor, list[ClientPlan]]:
    """The sample tensors the plans index, and the plans: as they are for in-memory data; for lazy
    data, only the rows the plans use, generated now, with the plans' rows renumbered into them."""
    if not isinstance(data, LazyFederatedDataset):
        return data.features, data.labels, list(plans)
    features, labels, batches = _localized(data, [p.batches for p in plans])
    return features, labels, [replace(p, batches=b) for p, b in zip(plans, batches)]


def client_rows(data: Data, clients: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """Sample tensors and, per client, its rows in them (all of its data), for full local gradients."""
    own = [data.client_indices[i] for i in clients]
    if not isinstance(data, LazyFederatedDataset):
        return data.features, data.labels, own
    return _localized(data, own)


def _sample_elements(data: Data) -> tuple[int, int]:
    """Elements of one sample's features, and bytes per element."""
    if isinstance(data, LazyFederatedDataset):
        return int(np.prod(data.feature_shape)), torch.empty(0, dtype=data.dtype).element_size()
    return int(np.prod(data.features.shape[1:])), data.features.element_size()


class SequentialExecutor:
    """The reference: one client after another, one step after another."""

    name = "sequential"

    def run(self, problem, data, params, plans, rule):
        if not plans:
            return params.new_zeros((0, params.numel()))
        features, labels, plans = rows_of(data, plans)
        return torch.stack([run_client(problem, features, labels, params, plan, rule) for plan in plans])

    def client_gradients(self, problem, data, params, clients):
        features, labels, rows = client_rows(data, clients)
        rows = [torch.from_numpy(r).to(params.device) for r in rows]
        points = params if params.dim() == 2 else params.expand(len(rows), -1)
        return torch.stack([problem.gradient(p, features[r], labels[r]) for p, r in zip(points, rows)])


class VectorizedExecutor:
    """The whole cohort at once: client models stacked as ``(C, d)``, one batched step for all.

    Step t of every client runs together: the minibatch rows of all clients are gathered into
    ``(C, B, ...)`` with a 0/1 mask for padding (a short last batch, or a client with fewer steps —
    unequal datasets, random epochs, unfinished work), gradients come from
    :meth:`Problem.batched_gradient` (``vmap``-ed ``grad`` for networks, batched closed forms for linear
    models), and the step y_c ← y_c − η_c·d_c is taken only where client c still has a batch. Step
    sizes, clipping, weight decay, local momentum, prox and the global-momentum drift are per-row
    tensor operations (:func:`fedshuffle.local.local_direction`), so no Python loop runs over clients.

    Memory: a cohort is cut into chunks of at most ``chunk_size`` clients, by default as many as fit in
    ``memory_budget`` bytes by the estimate of :meth:`chunk_for`.
    """

    name = "vectorized"

    def __init__(self, chunk_size: int | None = None, memory_budget: int = 1 << 30) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError("run.chunk_size", f"must be >= 1, got {chunk_size}")
        if memory_budget < 1 << 20:
            raise ConfigError("run.memory_budget", f"must be at least 1 MiB, got {memory_budget} bytes")
        self.chunk_size, self.memory_budget = chunk_size, memory_budget

    def chunk_for(self, data: Data, dim: int, batch: int, steps: int = 1) -> int:
        """Clients per chunk: the budget over ≈ 6d + 3B·(features + 1) + 3τB elements per client (models,
        a gathered minibatch and its gradient work, and the row indices and masks of all τ steps)."""
        if self.chunk_size is not None:
            return self.chunk_size
        elements, itemsize = _sample_elements(data)
        per_client = (6 * dim + 3 * batch * (elements + 1) + 3 * steps * batch) * itemsize
        return max(1, self.memory_budget // per_client)

    def run(self, problem, data, params, plans, rule):
        if not plans:
            return params.new_zeros((0, params.shape[-1]))
        batch, steps = max(p.batches.shape[1] for p in plans), max(p.steps for p in plans)
        size = self.chunk_for(data, params.numel(), batch, steps)
        order = np.argsort([-p.steps for p in plans], kind="stable")  # longest first: the clients still working are a prefix
        chunks = []
        for k in range(0, len(plans), size):
            features, labels, chunk = rows_of(data, [plans[i] for i in order[k : k + size]])
            chunks.append(self._run_chunk(problem, features, labels, params, chunk, rule))
        deltas = torch.cat(chunks)
        return deltas[torch.from_numpy(np.argsort(order, kind="stable")).to(deltas.device)]

    def _run_chunk(self, problem: Problem, features: torch.Tensor, labels: torch.Tensor, x: torch.Tensor, plans: Sequence[ClientPlan], rule: LocalRule) -> torch.Tensor:
        """``plans`` sorted by decreasing step count, so that at step t the working clients are rows [0, k_t)."""
        steps, batch = plans[0].steps, max(p.batches.shape[1] for p in plans)
        rows = np.full((len(plans), steps, batch), -1, dtype=np.int64)
        for c, plan in enumerate(plans):
            rows[c, : plan.steps, : plan.batches.shape[1]] = plan.batches
        rows_t = torch.from_numpy(rows).to(x.device)
        mask = (rows_t >= 0).to(x.dtype)
        weights = mask / mask.sum(-1, keepdim=True).clamp(min=1)  # 1/n on real rows, 0 on padding
        safe = rows_t.clamp(min=0)
        working = np.searchsorted(-np.array([p.steps for p in plans]), -np.arange(steps), side="left")  # k_t = #{c: τ_c > t}
        lrs = torch.tensor([p.lr for p in plans], dtype=x.dtype, device=x.device).unsqueeze(1)
        starts = torch.stack([x if p.start is None else p.start for p in plans]) if any(p.start is not None for p in plans) else x.expand(len(plans), -1)
        xs = torch.stack([s if p.center is None else p.center for s, p in zip(starts, plans)]) if any(p.center is not None for p in plans) else starts
        offsets = torch.stack([torch.zeros_like(x) if p.offset is None else p.offset for p in plans]) if any(p.offset is not None for p in plans) else None
        ys = starts.clone()
        velocity = torch.zeros_like(ys) if rule.momentum else None
        correction = rule.drift is not None and rule.drift.correction
        for t in range(steps):
            k = int(working[t])
            idx = safe[:k, t]
            y, f, lab, m = ys[:k], features[idx], labels[idx], weights[:k, t]
            grad_x = problem.batched_gradient(xs[:k], f, lab, m) if correction else None
            d = local_direction(rule, problem.batched_gradient(y, f, lab, m), y, xs[:k], grad_x)
            if offsets is not None:
                d = d + offsets[:k]
            if velocity is not None:
                velocity[:k] = rule.momentum * velocity[:k] + d
                d = velocity[:k]
            y.addcmul_(lrs[:k], d, value=-1.0)  # y is the view ys[:k]
        return starts - ys

    def client_gradients(self, problem, data, params, clients):
        if len(clients) == 0:
            return params.new_zeros((0, params.numel()))
        width = int(data.sizes[clients].max())
        points = params if params.dim() == 2 else params.expand(len(clients), -1)
        size = self.chunk_for(data, points.shape[1], width)
        out = []
        for k in range(0, len(clients), size):
            part = clients[k : k + size]
            features, labels, own = client_rows(data, part)
            rows = np.full((len(part), width), -1, dtype=np.int64)
            for c, r in enumerate(own):
                rows[c, : len(r)] = r
            rows_t = torch.from_numpy(rows).to(params.device)
            safe, mask = rows_t.clamp(min=0), (rows_t >= 0).to(params.dtype)
            out.append(problem.batched_gradient(points[k : k + size], features[safe], labels[safe], mask / mask.sum(1, keepdim=True)))
        return torch.cat(out)
