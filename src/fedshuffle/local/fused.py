"""The compiled backend of the local loop: a whole cohort's local work in one numba call, for the linear problems
and small MLPs.

On a convex problem a batch-1 local step is a few hundred flops; in the torch loop
(:func:`fedshuffle.local.loop.run_local`) each step also pays tens of microseconds of operator
dispatch. This backend runs the same arithmetic — the same plans, the same closed-form minibatch
gradients (quadratic, logistic and softmax regression, the MLP's backpropagation written out) and the
same step chain — as one compiled loop over clients and steps, with no Python or dispatch per step
(``benchmarks/convex.py``, ``benchmarks/mlp_loop.py``).

The MLP runs here only while one member's step is small (at most :data:`MLP_STEP_LIMIT` parameters ×
batch rows, e.g. FedCDR's 60-32-10 network at batch 10): the torch loop pays about 0.3 ms of dispatch per
step, shared by the members still working, which this backend saves; a larger network's step is
arithmetic that batched matmuls do better (the 2NN of Yang et al. stays on the torch loop).

The step chain is compiled as a list of (op, value) pairs, each the formula of one transform of
:mod:`fedshuffle.local.steps`, applied in the chain's order to the step's gradient g (and to g_x, the
gradient at the center, when FedShuffleMVR's correction asks for it):

    clip        g ← g·min(1, c/(‖g‖+1e-12))          weight decay  g ← g + λy  (g_x ← g_x + λx)
    drift       g ← a·g + (1−a)m, or g + (1−a)(m − g_x)   prox   g ← g + μ(y − x)
    offset      g ← g + o_i                          momentum      v ← ρv + g, g ← v

then y ← y − η_i·g (plain SGD on the quadratic and logistic problems, whose chain is empty, updates y in one pass
per minibatch row without forming g). The backend is used when numba is installed (``pip install 'fedshuffle[fast]'``),
the run is on the CPU (float64; the MLP float32 too, its arrays kept in the run's dtype) and every
transform is one of these (:data:`COMPILED_TRANSFORMS`); otherwise the torch loop runs, and a step chain with a
transform this backend does not know is named once in a warning (:func:`torch_reason` says why for any run).
It gives the torch loop's trajectory up to
floating-point rounding: sums in another order, and in float32 runs some intermediate products in float64
(``tests/test_executors.py``). A diverging run gives inf or NaN here too.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from fedshuffle.local.plan import CohortPlan
from fedshuffle.local.steps import Clip, Drift, Momentum, Offset, Prox, StepChain, WeightDecay
from fedshuffle.problems.convex import LogisticRegression, Quadratic, SoftmaxRegression
from fedshuffle.problems.networks import MLP

try:
    import numba
except ImportError:  # the optional dependency: without it the torch loop runs
    numba = None

QUADRATIC, LOGISTIC, SOFTMAX, MULTILAYER = 0, 1, 2, 3
#: the largest MLP step (parameters × minibatch rows) run here, a cut between the shapes benchmarks/mlp_loop.py
#: measures:
#: 2.3·10⁴ (FedCDR's Synthetic MLP, 0.21–0.29× the torch loop's time), 10⁶ (FEMNIST's, 0.49–1.17×), 10⁷ (the 2NN,
#: 1.3–2.5×)
MLP_STEP_LIMIT = 1 << 17
CLIP, DECAY, DRIFT, DRIFT_CORRECTED, PROX, OFFSET, MOMENTUM = range(7)


def problem_code(problem) -> tuple[int, float, np.ndarray] | None:
    """(kind, λ, widths) of a problem the backend computes, or None; ``widths`` is [classes] for softmax regression,
    the layer widths [p, h_1, …, K] for the MLP, empty otherwise."""
    if type(problem) is Quadratic:
        return QUADRATIC, 0.0, np.zeros(0, dtype=np.int64)
    if type(problem) is LogisticRegression:
        return LOGISTIC, float(problem.l2), np.zeros(0, dtype=np.int64)
    if type(problem) is SoftmaxRegression:
        return SOFTMAX, float(problem.l2), np.array([problem.num_classes], dtype=np.int64)
    if type(problem) is MLP:
        return MULTILAYER, float(problem.l2), np.array(problem.widths, dtype=np.int64)
    return None


#: every transform of :mod:`fedshuffle.local.steps` and its compiled formula; a transform not here keeps a run on the
#: torch loop, and :func:`torch_reason` names it (tests/test_executors.py walks the module)
COMPILED_TRANSFORMS: dict[type, str] = {
    Clip: "clip",
    WeightDecay: "weight decay",
    Drift: "drift",
    Prox: "prox",
    Offset: "offset",
    Momentum: "momentum",
}
#: transforms of :mod:`fedshuffle.local.steps` that run on the torch loop only, on purpose
TORCH_ONLY: tuple[type, ...] = ()


def chain_code(chain: StepChain, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(ops, values, drift momentum m) of a chain the backend computes, or None."""
    ops, values, momentum = [], [], np.zeros(dim)
    for t in chain.transforms:
        if isinstance(t, Clip):
            ops.append(CLIP)
            values.append(t.norm)
        elif isinstance(t, WeightDecay):
            ops.append(DECAY)
            values.append(t.rate)
        elif isinstance(t, Drift):
            if t.momentum.shape != (dim,):
                return None
            ops.append(DRIFT_CORRECTED if t.correction else DRIFT)
            values.append(t.a)
            momentum = t.momentum.detach().cpu().numpy()
        elif isinstance(t, Prox):
            ops.append(PROX)
            values.append(t.mu)
        elif isinstance(t, Offset):
            ops.append(OFFSET)
            values.append(0.0)
        elif isinstance(t, Momentum):
            ops.append(MOMENTUM)
            values.append(t.rho)
        else:
            return None
    return (
        np.asarray(ops, dtype=np.int64),
        np.asarray(values, dtype=np.float64),
        np.ascontiguousarray(momentum, dtype=np.float64),
    )


class Fallback(NamedTuple):
    """Why a run's local work stays on the torch loop: the ``part`` that keeps it there (``"numba"``, ``"device"``,
    ``"problem"``, ``"dtype"`` or ``"transform"``) and the reason in words."""

    part: str
    why: str


def torch_reason(problem, features: torch.Tensor, work) -> Fallback | None:
    """Why this backend cannot run ``work`` (None: it can): numba missing, another device than the CPU, a problem
    without a compiled gradient, the dtype (linear problems: float64; a small MLP: float32 too, one step at most
    :data:`MLP_STEP_LIMIT` parameters × rows), or a transform of the step chain without a compiled formula."""
    start, code = work.start, problem_code(problem)
    if numba is None:
        return Fallback("numba", "numba is not installed (pip install 'fedshuffle[fast]')")
    if start.device.type != "cpu":
        return Fallback("device", f"the run is on {start.device.type}")
    if code is None or problem.stochastic:
        return Fallback("problem", f"{type(problem).__name__} has no compiled gradient")
    if features.dtype != start.dtype:
        return Fallback("dtype", f"the features are {features.dtype}, the model {start.dtype}")
    if code[0] == MULTILAYER:
        batch = int(CohortPlan.of(work.plans).widths.max())
        if start.dtype not in (torch.float32, torch.float64) or start.shape[-1] * batch > MLP_STEP_LIMIT:
            return Fallback("problem", f"an MLP step of {start.shape[-1]} parameters × {batch} rows in {start.dtype}")
    elif start.dtype != torch.float64 or features.dim() != 2:
        return Fallback("dtype", f"{type(problem).__name__} runs compiled in float64 on flat features only")
    unknown = next((type(t).__name__ for t in work.chain.transforms if type(t) not in COMPILED_TRANSFORMS), None)
    if unknown is not None:
        return Fallback("transform", f"the local step transform {unknown} has no compiled formula")
    if chain_code(work.chain, start.shape[-1]) is None:
        return Fallback("transform", "the drift's momentum is not of the model's size")
    return None


def usable(problem, features: torch.Tensor, work) -> bool:
    """Whether this backend can run ``work`` (:func:`torch_reason` says why not)."""
    return torch_reason(problem, features, work) is None


def run(problem, features: torch.Tensor, labels: torch.Tensor, work) -> torch.Tensor:
    """Δ_i = s_i − y_{τ_i} of every member (``(C, d)``, the order of ``work.plans``), computed by the compiled loop."""
    plans = CohortPlan.of(work.plans)
    kind, l2, widths = problem_code(problem)
    ops, values, momentum = chain_code(work.chain, work.start.shape[-1])
    # writable int64/float64 copies only where needed (arrays a worker received zero-copy are read-only: another numba
    # specialization)
    rows, row_starts, row_widths, steps = (
        np.require(a, np.int64, ["C", "W"]) for a in (plans.rows, plans.row_starts, plans.widths, plans.steps)
    )
    batch = int(row_widths.max())
    starts = work.rows("start").detach().cpu().numpy()
    centers = starts if work.center is None else np.ascontiguousarray(work.rows("center").detach().cpu().numpy())
    offsets = (
        np.zeros((1, starts.shape[1]), dtype=starts.dtype)
        if work.offset is None
        else np.ascontiguousarray(work.rows("offset").detach().cpu().numpy())
    )
    lrs = np.require(plans.lrs, np.float64, ["C", "W"])
    x = features.detach().cpu().numpy().reshape(features.shape[0], -1)
    lab = labels.detach().cpu().numpy()
    integer = kind in (SOFTMAX, MULTILAYER)
    float_labels = np.zeros(1) if integer else np.asarray(lab, dtype=np.float64)
    int_labels = np.asarray(lab, dtype=np.int64) if integer else np.zeros(1, dtype=np.int64)
    ys = np.array(starts, order="C")
    shape = (len(widths) + 2, batch * int(widths.max())) if kind == MULTILAYER else (1, max(int(widths.sum()), batch))
    scratch = np.empty(shape, dtype=ys.dtype)
    centers, x = np.ascontiguousarray(centers), np.ascontiguousarray(x)
    if kind == MULTILAYER:
        _mlp_loop(
            l2,
            widths,
            ys,
            centers,
            offsets,
            work.offset is not None,
            x,
            int_labels,
            rows,
            row_starts,
            row_widths,
            steps,
            lrs,
            ops,
            values,
            momentum,
            scratch,
        )
    else:
        _loop(
            kind,
            l2,
            widths,
            ys,
            centers,
            offsets,
            work.offset is not None,
            x,
            float_labels,
            int_labels,
            rows,
            row_starts,
            row_widths,
            steps,
            lrs,
            ops,
            values,
            momentum,
            scratch,
        )
    return work.rows("start") - torch.from_numpy(ys).to(work.start.device)


#: reassociation (vectorized sums and fused multiply-adds) without assuming finite values, so that a diverging run
#: yields inf or NaN, as the torch loop does, and is stopped as diverged
REASSOCIATE = {"reassoc", "contract", "arcp"}


def _jit(function=None, **options):
    """Compiled with numba (cached on disk) when it is installed; the plain function otherwise (never called then).
    NumPy's error model: a division by zero gives inf or NaN, never an exception."""
    if function is None:
        return lambda f: _jit(f, **options)
    return numba.njit(cache=True, error_model="numpy", **options)(function) if numba is not None else function


@_jit(fastmath=REASSOCIATE)
def _gradient(kind, l2, widths, y, x, float_labels, int_labels, rows, g, scratch):
    """g = Σ_b v_b ∇f(y; a_b) over the real rows of one minibatch, v_b = 1/n (the linear problems' closed forms).
    ``scratch`` (1, max(B, K)): the rows' logistic coefficients, or one row's softmax scores."""
    d = y.shape[0]
    n = 0
    for r in rows:
        if r >= 0:
            n += 1
    w = 1.0 / max(n, 1)
    if kind == QUADRATIC:  # y·Σv − Σ v_b e_b
        for j in range(d):
            g[j] = y[j] * (w * n)
        for r in rows:
            if r >= 0:
                for j in range(d):
                    g[j] -= w * x[r, j]
        return
    if kind == LOGISTIC:  # −Σ v_b b_b σ(−b_b a_bᵀy) a_b + λ(Σv)y, the coefficients first, then one pass over g
        coefs = scratch[0]
        b = 0
        for r in rows:
            if r >= 0:
                margin = 0.0
                for j in range(d):
                    margin += x[r, j] * y[j]
                coefs[b] = float_labels[r] * w / (1.0 + np.exp(float_labels[r] * margin))
                b += 1
        for j in range(d):
            g[j] = (w * n) * l2 * y[j]
        b = 0
        for r in rows:
            if r >= 0:
                coef = coefs[b]
                for j in range(d):
                    g[j] -= coef * x[r, j]
                b += 1
        return
    # softmax: (W (p×K) row-major, c (K)); ∂/∂W = Σ v_b a_b(s_b − e_{y_b})ᵀ + λ(Σv)W, ∂/∂c = Σ v_b(s_b − e_{y_b})
    k = widths[0]
    p = x.shape[1]
    scores = scratch[0]
    for j in range(p * k):
        g[j] = (w * n) * l2 * y[j]
    for j in range(p * k, d):
        g[j] = 0.0
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


@_jit(fastmath=REASSOCIATE)
def _mlp_gradient(l2, widths, y, x, int_labels, rows, g, scratch):
    """The MLP's Σ_b v_b ∇CE(y; a_b) (as :meth:`MLP.batched_gradient`): h_{k+1} = relu(h_k W_k + c_k), logits h_L W_L +
    c_L;
    δ = v ⊙ (softmax − onehot), ∂W_k = h_kᵀδ, ∂c_k = Σ_b δ_b, δ ← (δ W_kᵀ) ⊙ [h_k > 0]. W_k is (in × out) row-major,
    then c_k,
    layer after layer in the flat vector; the regularizer adds λ(Σv)y. ``scratch`` (L + 3, B · max width): row k holds
    layer k's activations h_k (B × width, the real rows only), the last two δ and its back-propagated successor."""
    layers = widths.shape[0] - 1
    n = 0
    for r in rows:
        if r >= 0:
            n += 1
    w = 1.0 / max(n, 1)
    g[:] = 0.0
    m = 0
    inputs = scratch[0, : rows.shape[0] * widths[0]].reshape(rows.shape[0], widths[0])
    for r in rows:  # h_0: the real rows' features
        if r >= 0:
            inputs[m] = x[r]
            m += 1
    par = 0
    for k in range(layers):  # forward
        fan_in, fan_out = widths[k], widths[k + 1]
        weights = y[par : par + fan_in * fan_out].reshape(fan_in, fan_out)
        bias = y[par + fan_in * fan_out : par + fan_in * fan_out + fan_out]
        h, z = scratch[k, : m * fan_in].reshape(m, fan_in), scratch[k + 1, : m * fan_out].reshape(m, fan_out)
        for b in range(m):
            for o in range(fan_out):
                z[b, o] = bias[o]
            for i in range(fan_in):
                a = h[b, i]
                if a != 0.0:
                    for o in range(fan_out):
                        z[b, o] += a * weights[i, o]
            if k < layers - 1:
                for o in range(fan_out):
                    z[b, o] = max(z[b, o], 0.0)
        par += fan_in * fan_out + fan_out
    classes = widths[layers]
    logits = scratch[layers, : m * classes].reshape(m, classes)
    delta, back = layers + 1, layers + 2
    d = scratch[delta, : m * classes].reshape(m, classes)
    b = 0
    for r in rows:  # δ = v ⊙ (softmax(logits) − e_y)
        if r >= 0:
            peak = logits[b].max()
            total = 0.0
            for o in range(classes):
                d[b, o] = np.exp(logits[b, o] - peak)
                total += d[b, o]
            for o in range(classes):
                d[b, o] = w * d[b, o] / total
            d[b, int_labels[r]] -= w
            b += 1
    for k in range(layers - 1, -1, -1):  # backward
        fan_in, fan_out = widths[k], widths[k + 1]
        par -= fan_in * fan_out + fan_out
        weights = y[par : par + fan_in * fan_out].reshape(fan_in, fan_out)
        grad_weights = g[par : par + fan_in * fan_out].reshape(fan_in, fan_out)
        grad_bias = g[par + fan_in * fan_out : par + fan_in * fan_out + fan_out]
        h, d = scratch[k, : m * fan_in].reshape(m, fan_in), scratch[delta, : m * fan_out].reshape(m, fan_out)
        for b in range(m):
            for o in range(fan_out):
                grad_bias[o] += d[b, o]
            for i in range(fan_in):
                a = h[b, i]
                if a != 0.0:
                    for o in range(fan_out):
                        grad_weights[i, o] += a * d[b, o]
        if k:
            previous = scratch[back, : m * fan_in].reshape(m, fan_in)
            for b in range(m):
                for i in range(fan_in):
                    s = 0.0
                    if h[b, i] > 0.0:
                        for o in range(fan_out):
                            s += d[b, o] * weights[i, o]
                    previous[b, i] = s
            delta, back = back, delta
    if l2 != 0.0:
        for j in range(y.shape[0]):
            g[j] += (w * n) * l2 * y[j]


@_jit
def _loop(
    kind,
    l2,
    widths,
    ys,
    centers,
    offsets,
    has_offset,
    x,
    float_labels,
    int_labels,
    rows,
    row_starts,
    row_widths,
    steps,
    lrs,
    ops,
    values,
    momentum,
    scratch,
):
    """Every member's steps on a linear problem: the minibatch gradient (and at the center, for a corrected drift), then
    :func:`_step`; plain SGD on the quadratic or logistic problem as :func:`_sgd_step`. Member c's step t uses the
    ``row_widths[c]`` sample rows at ``rows[row_starts[c] + t·row_widths[c]:]`` (−1: padding)."""
    g, gx, velocity = np.empty_like(ys[0]), np.empty_like(ys[0]), np.empty_like(ys[0])
    corrected = _corrected(ops)
    plain = ops.shape[0] == 0 and kind != SOFTMAX
    for c in range(ys.shape[0]):
        y, center, offset = ys[c], centers[c], offsets[c if has_offset else 0]
        velocity[:] = 0.0
        for t in range(steps[c]):
            batch = rows[row_starts[c] + t * row_widths[c] : row_starts[c] + (t + 1) * row_widths[c]]
            if plain:
                _sgd_step(kind, l2, y, x, float_labels, batch, lrs[c], scratch[0])
                continue
            _gradient(kind, l2, widths, y, x, float_labels, int_labels, batch, g, scratch)
            if corrected:
                _gradient(kind, l2, widths, center, x, float_labels, int_labels, batch, gx, scratch)
            _step(ops, values, momentum, g, gx, velocity, y, center, offset, has_offset, corrected, lrs[c])


@_jit(fastmath=REASSOCIATE)
def _sgd_step(kind, l2, y, x, float_labels, rows, lr, coefs):
    """y ← y − η·g of plain SGD without forming g: y ← (1 − η·s·Σv)·y + η Σ_b c_b a_b, with s = λ and
    c_b = v_b b_b σ(−b_b a_bᵀy) for the logistic problem, s = 1 and c_b = v_b (a_b = e_b) for the quadratic — the
    gradients of :func:`_gradient`, one pass over y per row instead of three."""
    n = 0
    for r in rows:
        if r >= 0:
            n += 1
    w = 1.0 / max(n, 1)
    b = 0
    for r in rows:
        if r >= 0:
            if kind == QUADRATIC:
                coefs[b] = lr * w
            else:
                margin = 0.0
                for j in range(y.shape[0]):
                    margin += x[r, j] * y[j]
                coefs[b] = lr * float_labels[r] * w / (1.0 + np.exp(float_labels[r] * margin))
            b += 1
    shrink = 1.0 - lr * (w * n) * (1.0 if kind == QUADRATIC else l2)
    for j in range(y.shape[0]):
        y[j] *= shrink
    b = 0
    for r in rows:
        if r >= 0:
            coef = coefs[b]
            for j in range(y.shape[0]):
                y[j] += coef * x[r, j]
            b += 1


@_jit
def _mlp_loop(
    l2,
    widths,
    ys,
    centers,
    offsets,
    has_offset,
    x,
    int_labels,
    rows,
    row_starts,
    row_widths,
    steps,
    lrs,
    ops,
    values,
    momentum,
    scratch,
):
    """:func:`_loop` for the MLP (compiled apart, so that neither problem family pays for compiling the other)."""
    g, gx, velocity = np.empty_like(ys[0]), np.empty_like(ys[0]), np.empty_like(ys[0])
    corrected = _corrected(ops)
    for c in range(ys.shape[0]):
        y, center, offset = ys[c], centers[c], offsets[c if has_offset else 0]
        velocity[:] = 0.0
        for t in range(steps[c]):
            batch = rows[row_starts[c] + t * row_widths[c] : row_starts[c] + (t + 1) * row_widths[c]]
            _mlp_gradient(l2, widths, y, x, int_labels, batch, g, scratch)
            if corrected:
                _mlp_gradient(l2, widths, center, x, int_labels, batch, gx, scratch)
            _step(ops, values, momentum, g, gx, velocity, y, center, offset, has_offset, corrected, lrs[c])


@_jit
def _corrected(ops):
    """Whether the chain holds FedShuffleMVR's corrected drift (which needs the gradient at the center)."""
    for o in ops:
        if o == DRIFT_CORRECTED:
            return True
    return False


@_jit(fastmath=REASSOCIATE)
def _step(ops, values, momentum, g, gx, velocity, y, center, offset, has_offset, corrected, lr):
    """The chain's transforms in order on g (and g_x), then y ← y − η_i·g. Written as loops over the coordinates: array
    expressions here would keep the call from being inlined into the step loop, which then costs more than the step."""
    d = g.shape[0]
    for o in range(ops.shape[0]):
        op, value = ops[o], values[o]
        if op == CLIP:  # g and g_x each by its own norm: g ← g·min(1, c/(‖g‖+1e-12))
            for which in range(2 if corrected else 1):
                v = g if which == 0 else gx
                squares = 0.0
                for j in range(d):
                    squares += v[j] * v[j]
                scale = min(value / (np.sqrt(squares) + 1e-12), 1.0)
                for j in range(d):
                    v[j] *= scale
        elif op == DECAY:
            for j in range(d):
                g[j] += value * y[j]
            if corrected:
                for j in range(d):
                    gx[j] += value * center[j]
        elif op == DRIFT:
            for j in range(d):
                g[j] = value * g[j] + (1 - value) * momentum[j]
        elif op == DRIFT_CORRECTED:  # FedShuffleMVR's correction
            for j in range(d):
                g[j] += (1 - value) * (momentum[j] - gx[j])
        elif op == PROX:
            for j in range(d):
                g[j] += value * (y[j] - center[j])
        elif op == OFFSET:
            if has_offset:
                for j in range(d):
                    g[j] += offset[j]
        else:  # local heavy-ball momentum
            for j in range(d):
                velocity[j] = value * velocity[j] + g[j]
                g[j] = velocity[j]
    for j in range(d):
        y[j] -= lr * g[j]
