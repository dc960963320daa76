"""The compiled backend of the local loop: a whole cohort's local work in one numba call, for the linear problems.

On a convex problem a batch-1 local step is a few hundred flops; in the torch loop
(:func:`fedshuffle.local.loop.run_local`) each step also pays tens of microseconds of operator
dispatch. This backend runs the same arithmetic — the same plans, the same closed-form minibatch
gradients (quadratic, logistic and softmax regression) and the same step chain — as one compiled
loop over clients and steps, with no Python or dispatch per step (``benchmarks/convex.py``).

The step chain is compiled as a list of (op, value) pairs, each the formula of one transform of
:mod:`fedshuffle.local.steps`, applied in the chain's order to the step's gradient g (and to g_x, the
gradient at the center, when FedShuffleMVR's correction asks for it):

    clip        g ← g·min(1, c/(‖g‖+1e-12))          weight decay  g ← g + λy  (g_x ← g_x + λx)
    drift       g ← a·g + (1−a)m, or g + (1−a)(m − g_x)   prox   g ← g + μ(y − x)
    offset      g ← g + o_i                          momentum      v ← ρv + g, g ← v

then y ← y − η_i·g. The backend is used when numba is installed (``pip install 'fedshuffle[fast]'``),
the run is float64 on the CPU and every transform is one of these; otherwise the torch loop runs.
It gives the torch loop's trajectory up to floating-point reassociation (``tests/test_executors.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from fedshuffle.local.steps import Clip, Drift, Momentum, Offset, Prox, StepChain, WeightDecay
from fedshuffle.problems.convex import LogisticRegression, Quadratic, SoftmaxRegression

try:
    import numba
except ImportError:  # the optional dependency: without it the torch loop runs
    numba = None

QUADRATIC, LOGISTIC, SOFTMAX = 0, 1, 2
CLIP, DECAY, DRIFT, DRIFT_CORRECTED, PROX, OFFSET, MOMENTUM = range(7)


def problem_code(problem) -> tuple[int, float, int] | None:
    """(kind, λ, classes) of a problem the backend computes, or None."""
    if type(problem) is Quadratic:
        return QUADRATIC, 0.0, 0
    if type(problem) is LogisticRegression:
        return LOGISTIC, float(problem.l2), 0
    if type(problem) is SoftmaxRegression:
        return SOFTMAX, float(problem.l2), int(problem.num_classes)
    return None


def chain_code(chain: StepChain, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(ops, values, drift momentum m) of a chain the backend computes, or None."""
    ops, values, momentum = [], [], np.zeros(dim)
    for t in chain.transforms:
        if isinstance(t, Clip):
            ops.append(CLIP), values.append(t.norm)
        elif isinstance(t, WeightDecay):
            ops.append(DECAY), values.append(t.rate)
        elif isinstance(t, Drift):
            if t.momentum.shape != (dim,):
                return None
            ops.append(DRIFT_CORRECTED if t.correction else DRIFT), values.append(t.a)
            momentum = t.momentum.detach().cpu().numpy()
        elif isinstance(t, Prox):
            ops.append(PROX), values.append(t.mu)
        elif isinstance(t, Offset):
            ops.append(OFFSET), values.append(0.0)
        elif isinstance(t, Momentum):
            ops.append(MOMENTUM), values.append(t.rho)
        else:
            return None
    return np.asarray(ops, dtype=np.int64), np.asarray(values, dtype=np.float64), np.ascontiguousarray(momentum, dtype=np.float64)


def usable(problem, features: torch.Tensor, work) -> bool:
    """Whether this backend can run ``work`` (numba installed, float64 on the CPU, a known problem and chain)."""
    start = work.start
    return (
        numba is not None and start.device.type == "cpu" and start.dtype == torch.float64 and features.dtype == torch.float64
        and features.dim() == 2 and not problem.stochastic and problem_code(problem) is not None and chain_code(work.chain, start.shape[-1]) is not None
    )


def run(problem, features: torch.Tensor, labels: torch.Tensor, work) -> torch.Tensor:
    """Δ_i = s_i − y_{τ_i} of every member (``(C, d)``, the order of ``work.plans``), computed by the compiled loop."""
    plans = work.plans
    kind, l2, classes = problem_code(problem)
    ops, values, momentum = chain_code(work.chain, work.start.shape[-1])
    shapes = [p.batches.shape for p in plans]
    steps = np.array([s[0] for s in shapes], dtype=np.int64)
    batch = max(s[1] for s in shapes)
    rows = np.full((len(plans), int(steps.max()), batch), -1, dtype=np.int64)
    for c, (plan, (tau, width)) in enumerate(zip(plans, shapes)):
        rows[c, :tau, :width] = plan.batches
    starts = work.rows("start").detach().cpu().numpy()
    centers = starts if work.center is None else np.ascontiguousarray(work.rows("center").detach().cpu().numpy())
    offsets = np.zeros((1, starts.shape[1])) if work.offset is None else np.ascontiguousarray(work.rows("offset").detach().cpu().numpy())
    lrs = np.array([p.lr for p in plans], dtype=np.float64)
    x = features.detach().cpu().numpy()
    lab = labels.detach().cpu().numpy()
    float_labels = lab.astype(np.float64) if kind != SOFTMAX else np.zeros(1)
    int_labels = lab.astype(np.int64) if kind == SOFTMAX else np.zeros(1, dtype=np.int64)
    ys = np.array(starts, dtype=np.float64, order="C")
    _loop(kind, l2, classes, ys, np.ascontiguousarray(centers), offsets, work.offset is not None, np.ascontiguousarray(x), float_labels, int_labels, rows, steps, lrs, ops, values, momentum)
    return work.rows("start") - torch.from_numpy(ys).to(work.start.device)


def _jit(function):
    """Compiled with numba (cached on disk) when it is installed; the plain function otherwise (never called then)."""
    return numba.njit(cache=True)(function) if numba is not None else function


@_jit
def _gradient(kind, l2, classes, y, x, float_labels, int_labels, rows, g, scores):
    """g = Σ_b v_b ∇f(y; a_b) over the real rows of one minibatch, v_b = 1/n (the torch problems' closed forms)."""
    d = y.shape[0]
    n = 0
    for r in rows:
        if r >= 0:
            n += 1
    w = 1.0 / max(n, 1)
    g[:] = 0.0
    if kind == 0:  # quadratic: y·Σv − Σ v_b e_b
        for r in rows:
            if r >= 0:
                for j in range(d):
                    g[j] -= w * x[r, j]
        for j in range(d):
            g[j] += y[j] * (w * n)
        return
    if kind == 1:  # logistic: −Σ v_b b_b σ(−b_b a_bᵀy) a_b + λ(Σv)y
        for r in rows:
            if r >= 0:
                b = float_labels[r]
                margin = 0.0
                for j in range(d):
                    margin += x[r, j] * y[j]
                coef = b * w / (1.0 + np.exp(b * margin))
                for j in range(d):
                    g[j] -= coef * x[r, j]
        if l2 != 0.0:
            for j in range(d):
                g[j] += (w * n) * l2 * y[j]
        return
    # softmax: parameters (W (p×K) row-major, c (K)); ∂/∂W = Σ v_b a_b(s_b − e_{y_b})ᵀ + λ(Σv)W, ∂/∂c = Σ v_b(s_b − e_{y_b})
    k = classes
    p = x.shape[1]
    for r in rows:
        if r >= 0:
            top = -np.inf
            for m in range(k):
                s = y[p * k + m]
                for j in range(p):
                    s += x[r, j] * y[j * k + m]
                scores[m] = s
                top = max(top, s)
            total = 0.0
            for m in range(k):
                scores[m] = np.exp(scores[m] - top)
                total += scores[m]
            for m in range(k):
                scores[m] = w * (scores[m] / total - (1.0 if m == int_labels[r] else 0.0))
                g[p * k + m] += scores[m]
            for j in range(p):
                for m in range(k):
                    g[j * k + m] += x[r, j] * scores[m]
    if l2 != 0.0:
        for j in range(p * k):
            g[j] += (w * n) * l2 * y[j]


@_jit
def _loop(kind, l2, classes, ys, centers, offsets, has_offset, x, float_labels, int_labels, rows, steps, lrs, ops, values, momentum):
    members, d = ys.shape
    g, gx, velocity, scores = np.empty(d), np.empty(d), np.empty(d), np.empty(max(classes, 1))
    corrected = False
    for o in ops:
        corrected = corrected or o == 3
    for c in range(members):
        y, center = ys[c], centers[c]
        velocity[:] = 0.0
        for t in range(steps[c]):
            _gradient(kind, l2, classes, y, x, float_labels, int_labels, rows[c, t], g, scores)
            if corrected:
                _gradient(kind, l2, classes, center, x, float_labels, int_labels, rows[c, t], gx, scores)
            for o in range(ops.shape[0]):
                op, value = ops[o], values[o]
                if op == 0:  # clip, g and g_x each by its own norm
                    scale = min(value / (np.sqrt(np.sum(g * g)) + 1e-12), 1.0)
                    g *= scale
                    if corrected:
                        gx *= min(value / (np.sqrt(np.sum(gx * gx)) + 1e-12), 1.0)
                elif op == 1:  # weight decay
                    g += value * y
                    if corrected:
                        gx += value * center
                elif op == 2:  # drift without correction
                    g[:] = value * g + (1 - value) * momentum
                elif op == 3:  # drift with FedShuffleMVR's correction
                    g += (1 - value) * (momentum - gx)
                elif op == 4:  # prox
                    g += value * (y - center)
                elif op == 5:  # offset
                    if has_offset:
                        g += offsets[c]
                else:  # local heavy-ball momentum
                    velocity[:] = value * velocity + g
                    g[:] = velocity
            y -= lrs[c] * g
