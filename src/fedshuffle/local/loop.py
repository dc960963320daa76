"""The one local loop: τ_i local steps of every client of a (sub)cohort, as one masked computation.

Client models are stacked as ``(C, d)``. The clients are ordered longest-first, so at step t the
clients still working are the prefix ``[0, k_t)``; their minibatches are gathered into ``(k_t, B, …)``
with per-row weights (1/n on real rows, 0 on the padding of a short batch), the gradients come from
:meth:`Problem.local_gradient`, the :class:`~fedshuffle.local.steps.StepChain` turns them into
moves, and y ← y − η_i·d. With an empty chain (plain SGD) the step is the problem's own
:meth:`Problem.descend`, the same y ← y − η_i·g done in place (a module updates its parameters
piece by piece, as a hand-written PyTorch loop does). One client (C = 1) is the sequential reference; every executor
runs this
function, so they all do the same arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fedshuffle.core.streams import step_seed
from fedshuffle.local import fused
from fedshuffle.local.plan import ClientPlan, CohortPlan
from fedshuffle.local.steps import Step, StepChain
from fedshuffle.problems import Problem

LOGGER = logging.getLogger("fedshuffle")
#: the fallbacks already reported by this process (each once)
_SAID: set[str] = set()


@dataclass(frozen=True)
class LocalWork:
    """A cohort's local work: each member's plan, start s_i, center x_i (default s_i) and offset o_i.

    ``start``/``center`` are one model ``(d,)`` shared by every member or one per member ``(C, d)``.
    """

    plans: Sequence[ClientPlan]
    start: torch.Tensor
    chain: StepChain = field(default_factory=StepChain)
    center: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.plans)

    def rows(self, name: str) -> torch.Tensor | None:
        value = getattr(self, name)
        if value is None or value.dim() == 2:
            return value
        return value.expand(len(self.plans), -1)

    def subset(self, members: Sequence[int], plans: Sequence[ClientPlan] | None = None) -> LocalWork:
        """The work of the given members (in that order), optionally with their plans replaced."""
        index = torch.as_tensor(np.asarray(members, dtype=np.int64), device=self.start.device)
        pick = {
            k: (v if v is None or v.dim() == 1 else v.index_select(0, index))
            for k, v in (("start", self.start), ("center", self.center), ("offset", self.offset))
        }
        if plans is None:
            plans = self.plans.take(members) if isinstance(self.plans, CohortPlan) else [self.plans[i] for i in members]
        return replace(self, plans=plans, **pick)


def run_local(
    problem: Problem, features: torch.Tensor, labels: torch.Tensor, work: LocalWork, compiled: bool = False
) -> torch.Tensor:
    """Δ_i = s_i − y_{τ_i} of every member, stacked ``(C, d)`` in the order of ``work.plans``.

    ``compiled``: run the whole work as one compiled loop (:mod:`fedshuffle.local.fused`) where that
    backend can (numba installed, on the CPU: linear problems in float64, small MLPs in float32 or float64); the
    same steps either way.
    """
    plans = work.plans
    if not plans:
        return work.start.new_zeros((0, work.start.shape[-1]))
    if compiled:
        fallback = fused.torch_reason(problem, features, work)
        if fallback is None:
            return fused.run(problem, features, labels, work)
        if fallback.part == "transform" and fallback.why not in _SAID:  # a step the compiled loop would otherwise run
            _SAID.add(fallback.why)
            LOGGER.warning("the local loop runs on PyTorch operators, not compiled: %s", fallback.why)
    order = np.argsort(-CohortPlan.of(plans).steps, kind="stable")
    if np.array_equal(order, np.arange(len(plans))):
        return _run_sorted(problem, features, labels, work)
    deltas = _run_sorted(problem, features, labels, work.subset(order))
    return deltas[torch.from_numpy(np.argsort(order, kind="stable")).to(deltas.device)]


def _run_sorted(problem: Problem, features: torch.Tensor, labels: torch.Tensor, work: LocalWork) -> torch.Tensor:
    plans = CohortPlan.of(work.plans)
    device, dtype = work.start.device, work.start.dtype
    steps, batch = int(plans.steps[0]), int(plans.widths.max())
    rows = np.full((len(plans), steps, batch), -1, dtype=np.int64)
    for c in range(len(plans)):
        member = plans.batches(c)
        rows[c, : member.shape[0], : member.shape[1]] = member
    rows_t = torch.from_numpy(rows).to(device)
    mask = (rows_t >= 0).to(dtype)
    weights = mask / mask.sum(-1, keepdim=True).clamp(min=1)
    safe = rows_t.clamp(min=0)
    working = np.searchsorted(-plans.steps, -np.arange(steps), side="left")  # k_t = #{c: τ_c > t}
    lrs = torch.tensor(plans.lrs, dtype=dtype, device=device).unsqueeze(1)
    starts = work.rows("start")
    centers = work.rows("center") if work.center is not None else starts
    offsets = work.rows("offset")
    ys = starts.clone()
    chain = work.chain
    states = chain.init(ys)
    keys = [tuple(key) for key in plans.keys.tolist()] if problem.stochastic else []
    for t in range(steps):
        k = int(working[t])
        idx = safe[:k, t]
        y, f, lab, m = ys[:k], features[idx], labels[idx], weights[:k, t]
        seeds = [step_seed(key, t) for key in keys[:k]] if problem.stochastic else None
        if not chain.transforms:  # plain SGD: the problem's in-place step (modules: piece by piece)
            problem.descend(y, f, lab, m, lrs[:k], seeds)
            continue
        g = problem.local_gradient(y, f, lab, m, seeds)
        g_x = problem.local_gradient(centers[:k], f, lab, m, seeds) if chain.needs_center_gradient else None
        step = Step(y, centers[:k], None if offsets is None else offsets[:k], k)
        d = chain.update(g, g_x, states, step)
        y.addcmul_(lrs[:k], d, value=-1.0)  # y is the view ys[:k]
    return starts - ys
