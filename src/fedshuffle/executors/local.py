"""Executors: where a cohort's local work runs. All of them run :func:`fedshuffle.local.loop.run_local`.

An executor receives a :class:`~fedshuffle.local.loop.LocalWork` — every member's plan (the exact
minibatch sequence and step size), start, center, offset and the step chain — and returns the
stacked updates Δ_i = s_i − y_i. Because all randomness is in the plans, every executor returns the
same numbers up to floating-point reassociation: the sequential one runs the loop one client at a
time (C = 1), the vectorized one on chunks of the cohort, the threaded one client by client in threads of
this process, the Ray one on shares in other processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.threads import operator_threads
from fedshuffle.data import FederatedDataset, LazyFederatedDataset
from fedshuffle.data.federated import client_rows, localized
from fedshuffle.local import fused
from fedshuffle.local.loop import LocalWork, run_local
from fedshuffle.local.plan import ClientPlan, CohortPlan
from fedshuffle.problems import Problem


class Executor(Protocol):
    """Runs a cohort's local work and full local gradients."""

    name: str

    def run(
        self, problem: Problem, data: FederatedDataset, work: LocalWork, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Client updates Δ_i = s_i − y_i stacked as a ``(len(work), d)`` tensor; with ``weights`` ω, Σ_i ω_iΔ_i
        ``(d,)`` added up as the updates are produced, in an order that does not depend on timing."""
        ...

    def client_gradients(
        self, problem: Problem, data: FederatedDataset, params: torch.Tensor, clients: np.ndarray
    ) -> torch.Tensor:
        """Full local gradients ∇f_i(x) of ``clients``, stacked as ``(len(clients), d)``; ``params`` is one
        model ``(d,)`` for all, or one per client ``(len(clients), d)``."""
        ...


Data = FederatedDataset | LazyFederatedDataset


def rows_of(data: Data, plans: Sequence[ClientPlan]) -> tuple[torch.Tensor, torch.Tensor, Sequence[ClientPlan]]:
    """The sample tensors the plans index, and the plans: as they are for in-memory data; for lazy
    data, only the rows the plans use, generated now, with the plans' rows renumbered into them."""
    if not isinstance(data, LazyFederatedDataset):
        return data.features, data.labels, plans
    features, labels, batches = localized(data, [p.batches for p in plans])
    return features, labels, [replace(p, batches=b) for p, b in zip(plans, batches)]


def _sample_elements(data: Data) -> tuple[int, int]:
    """Elements of one sample's features, and bytes per element."""
    if isinstance(data, LazyFederatedDataset):
        return int(np.prod(data.feature_shape)), torch.empty(0, dtype=data.dtype).element_size()
    return int(np.prod(data.features.shape[1:])), data.features.element_size()


class LocalExecutor:
    """The cohort in this process, cut into chunks of at most ``chunk_size`` clients, each chunk one
    masked batched loop (:func:`~fedshuffle.local.loop.run_local`).

    ``chunk_size = 1`` is the sequential reference (one client after another). By default a chunk is
    as many clients as fit in ``memory_budget`` bytes by the estimate of :meth:`chunk_for`. With
    ``compiled`` (not for the sequential reference), linear problems in float64 and small MLPs run each chunk as
    one compiled loop when numba is installed (:mod:`fedshuffle.local.fused`).
    """

    name = "vectorized"
    #: how the executor was chosen when ``run.executor = "auto"`` ("auto: <name> — <reason>") and, off the CPU, that the
    #: compiled loop is off (:data:`~fedshuffle.executors.choice.COMPILED_OFF`); else None
    chosen: str | None = None

    def __init__(self, chunk_size: int | None = None, memory_budget: int = 1 << 30, compiled: bool = True) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError("run.chunk_size", f"must be >= 1, got {chunk_size}")
        if memory_budget < 1 << 20:
            raise ConfigError("run.memory_budget_mb", f"must be at least 1 MiB, got {memory_budget} bytes")
        self.chunk_size, self.memory_budget, self.compiled = chunk_size, memory_budget, compiled

    @staticmethod
    def client_bytes(data: Data, dim: int, batch: int, steps: int = 1) -> int:
        """Bytes one client of a chunk needs: ≈ 6d + 3B·(features + 1) + 3τB elements (models, a gathered
        minibatch and its gradient work, and the row indices and masks of all τ steps)."""
        elements, itemsize = _sample_elements(data)
        return (6 * dim + 3 * batch * (elements + 1) + 3 * steps * batch) * itemsize

    def chunk_for(self, data: Data, dim: int, batch: int, steps: int = 1) -> int:
        """Clients per chunk: ``chunk_size``, or as many as fit in the budget by :meth:`client_bytes`."""
        if self.chunk_size is not None:
            return self.chunk_size
        return max(1, self.memory_budget // self.client_bytes(data, dim, batch, steps))

    def check_chunk(self, data: Data, dim: int, batch: int, steps: int, members: int) -> None:
        """Refuse a chunk of ``members`` clients that cannot fit in the memory available (core/limits.py)."""
        setting = "run.chunk_size" if self.chunk_size is not None else "run.memory_budget_mb"
        limits.check_fits(
            members * self.client_bytes(data, dim, batch, steps), setting, f"a vectorized chunk of {members} clients"
        )

    def run(self, problem: Problem, data: Data, work: LocalWork, weights: torch.Tensor | None = None) -> torch.Tensor:
        plans = work.plans
        if weights is not None:
            return self.run_summed(problem, data, work, weights, self.chunks(data, work) if plans else [])
        if not plans:
            return work.start.new_zeros((0, work.start.shape[-1]))
        deltas = work.start.new_empty((len(plans), work.start.shape[-1]))
        for members in self.chunks(data, work):
            self.run_chunk(problem, data, work, members, deltas)
        return deltas

    def run_summed(
        self,
        problem: Problem,
        data: Data,
        work: LocalWork,
        weights: torch.Tensor,
        chunks: Sequence[np.ndarray],
        deltas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Σ ω_iΔ_i over the members of ``chunks``, chunk after chunk in their order; the updates are computed
        chunk by chunk, or taken from ``deltas`` ``(len(work), d)`` where they were computed already."""
        total = work.start.new_zeros(work.start.shape[-1])
        for members in chunks:
            index = torch.from_numpy(members).to(total.device)
            total += weights[index] @ (
                self.chunk_deltas(problem, data, work, members) if deltas is None else deltas[index]
            )
        return total

    def add_up(self, data: Data, work: LocalWork, weights: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Σ ω_iΔ_i of updates ``deltas`` already computed, added in the order :meth:`run` with ``weights`` adds them,
        so the sum is the same floating-point number (replicas: :mod:`fedshuffle.replicas`)."""
        return self.run_summed(None, data, work, weights, self.chunks(data, work) if work.plans else [], deltas)

    def chunks(self, data: Data, work: LocalWork) -> list[np.ndarray]:
        """The members of ``work`` in the chunks this executor runs, longest plans first (chunks of similar length)."""
        plans = CohortPlan.of(work.plans)
        batch, steps = int(plans.widths.max()), int(plans.steps.max())
        size = self.chunk_for(data, work.start.shape[-1], batch, steps)
        limits.check_fits(
            3 * len(plans) * work.start[0].nbytes, "sampler.cohort", f"the updates of a cohort of {len(plans)}"
        )
        self.check_chunk(data, work.start.shape[-1], batch, steps, min(size, len(plans)))
        order = np.argsort(-plans.steps, kind="stable")
        return [order[k : k + size] for k in range(0, len(plans), size)]

    def chunk_deltas(self, problem: Problem, data: Data, work: LocalWork, members: np.ndarray) -> torch.Tensor:
        """The members' updates ``(len(members), d)``, their local work run as one masked loop."""
        chunk = work.subset(members)
        features, labels, plans = rows_of(data, chunk.plans)
        return run_local(problem, features, labels, replace(chunk, plans=plans), self.compiled)

    def run_chunk(
        self, problem: Problem, data: Data, work: LocalWork, members: np.ndarray, deltas: torch.Tensor
    ) -> None:
        """Write the members' updates into their rows of ``deltas``."""
        deltas[torch.from_numpy(members).to(deltas.device)] = self.chunk_deltas(problem, data, work, members)

    def batching(self) -> tuple[object, ...]:
        """What decides how this executor cuts and adds up a cohort: replicas whose executors agree on it may share
        its calls (:mod:`fedshuffle.replicas`)."""
        return type(self), self.chunk_size, self.memory_budget, self.compiled

    def same_rows_in_any_chunk(self, problem: Problem, data: Data, work: LocalWork) -> bool:
        """Whether each member's update is the same number in a chunk of any other members (so the work of several
        replicas can be batched): one member per loop (``chunk_size = 1``), the compiled backend (member after
        member) and problems whose batched gradient computes each row on its own
        (:attr:`~fedshuffle.problems.Problem.independent_rows`) always; else the torch loop where, in each chunk, no
        step is taken by one member alone (its top two step counts are equal).

        The torch loop computes a step of k working members as (k, B, d) tensors, whose reductions are one
        floating-point order for k ≥ 2 and may be another for k = 1 (measured: sequential and vectorized differ
        by ~1 ulp on a3a); so a step that is one member's alone in one run and shared in the other may differ."""
        if self.chunk_size == 1 or problem.independent_rows:
            return True
        if self.compiled and fused.usable(problem, data.features, work):
            return True
        planned = CohortPlan.of(work.plans).steps
        for members in self.chunks(data, work):
            steps = sorted(planned[members].tolist(), reverse=True)
            if len(steps) < 2 or steps[0] != steps[1]:
                return False
        return True

    def client_gradients(self, problem, data, params, clients):
        if len(clients) == 0:
            return params.new_zeros((0, params.shape[-1]))
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
            out.append(
                problem.batched_gradient(
                    points[k : k + size], features[safe], labels[safe], mask / mask.sum(1, keepdim=True)
                )
            )
        return torch.cat(out)


class SequentialExecutor(LocalExecutor):
    """The reference: one client after another (the local loop with C = 1)."""

    name = "sequential"

    def __init__(self) -> None:
        super().__init__(chunk_size=1, compiled=False)


class VectorizedExecutor(LocalExecutor):
    """The whole cohort at once (in memory-bounded chunks)."""


class ThreadedExecutor:
    """The cohort's clients run ``threads`` at a time in threads of this process, each as the sequential reference
    with one operator thread: clients in parallel use a multi-core CPU better than one client's operators split
    across the cores (PyTorch releases the GIL inside operators; ``benchmarks/cross_device_cnn.py``). The threads
    take the clients longest plan first, each writing its update into its own row of the cohort's result, and
    each runs its client's plan on its own thread's copy of the module, so the numbers are the sequential ones.
    Modules with dropout are refused: their masks come from the global generator, which threads share.
    """

    name = "threaded"
    #: how the executor was chosen when ``run.executor = "auto"``, else None
    chosen: str | None = None

    def __init__(self, threads: int | None = None) -> None:
        threads = torch.get_num_threads() if threads is None else threads
        if threads < 1:
            raise ConfigError("run.threads", f"must be >= 1, got {threads}")
        self.threads = threads
        self.sequential = SequentialExecutor()
        self._pool: ThreadPoolExecutor | None = None

    def run(self, problem: Problem, data: Data, work: LocalWork, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The updates as :class:`SequentialExecutor` computes them. Stacked: the threads take the clients in turn.
        Summed (``weights``): thread k sums clients k, k + T, k + 2T, … (longest plans first) and the T partial sums
        are added in order, so the result does not depend on which thread finishes first."""
        if problem.stochastic:
            raise ConfigError(
                "run.executor",
                f"'threaded' cannot run {problem.name}: its dropout masks come from the global generator, which "
                "threads share; accepted for it: sequential, vectorized, ray",
            )
        if len(work.plans) < 2 or self.threads == 1:
            return self.sequential.run(problem, data, work, weights)
        chunks = self.sequential.chunks(data, work)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fedshuffle-clients")
        with operator_threads(1):
            if weights is not None:
                shares = [
                    self._pool.submit(
                        self.sequential.run_summed, problem, data, work, weights, chunks[k :: self.threads]
                    )
                    for k in range(min(self.threads, len(chunks)))
                ]
                return self._add_parts([share.result() for share in shares])
            deltas = work.start.new_empty((len(work.plans), work.start.shape[-1]))
            for done in [
                self._pool.submit(self.sequential.run_chunk, problem, data, work, members, deltas) for members in chunks
            ]:
                done.result()
            return deltas

    @staticmethod
    def _add_parts(parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The threads' partial sums added in thread order (not in the order they finish)."""
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def add_up(self, data: Data, work: LocalWork, weights: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Σ ω_iΔ_i of updates ``deltas`` already computed, added as :meth:`run` with ``weights`` adds them: thread k's
        share chunk by chunk, then the shares in thread order (the same floating-point number)."""
        if len(work.plans) < 2 or self.threads == 1:
            return self.sequential.add_up(data, work, weights, deltas)
        chunks = self.sequential.chunks(data, work)
        return self._add_parts(
            [
                self.sequential.run_summed(None, data, work, weights, chunks[k :: self.threads], deltas)
                for k in range(min(self.threads, len(chunks)))
            ]
        )

    def batching(self) -> tuple[object, ...]:
        """What decides how this executor cuts and adds up a cohort (:meth:`LocalExecutor.batching`)."""
        return type(self), self.threads

    def same_rows_in_any_chunk(self, problem: Problem, data: Data, work: LocalWork) -> bool:
        """Always: each client runs on its own (:meth:`LocalExecutor.same_rows_in_any_chunk`)."""
        return True

    def client_gradients(self, problem: Problem, data: Data, params: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        return self.sequential.client_gradients(problem, data, params, clients)

    def close(self) -> None:
        """Stop the threads (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
