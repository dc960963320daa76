"""A deterministic prox solver on each client's full data: prox_{ηf_i}(v_i) to a stated residual tolerance.

For a cohort of clients with centers v_i (stacked ``(C, d)``) it minimizes, row by row,

    h_i(z) = f_i(z) + ‖z − v_i‖²/(2η),   ∇h_i(z) = ∇f_i(z) + (z − v_i)/η,

by L-BFGS (memory m, two-loop recursion per row) with a per-row Armijo backtracking line search, and stops
a row once its residual ‖∇h_i(z)‖ ≤ tol. Every row has its own curvature pairs, step and stopping test, but
all rows still working share one batched evaluation of f_i and ∇f_i per trial point. Because h_i is
(1/η − L)-strongly convex when ηL < 1, the residual bounds the error: ‖z − prox_{ηf_i}(v_i)‖ ≤ η·residual/(1 − ηL).
A non-convex f_i (an MLP with large η) gets a stationary point of h_i with that residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.func import vmap

from fedshuffle.problems import Problem

#: inner solvers of FedCDR's prox: deterministic L-BFGS on the full client data, or the local SGD epochs
SOLVERS = ("lbfgs", "sgd")
ARMIJO = 1e-4
MAX_HALVINGS = 40


@dataclass(frozen=True)
class ProxSolution:
    """The solver's points, their residuals ‖∇h_i‖, its iterations and its per-sample gradient evaluations."""

    points: torch.Tensor
    residual: torch.Tensor
    iterations: int
    sample_gradients: int


class ClientObjectives:
    """f_i and ∇f_i of a cohort on each member's full data (padded to the largest member, weights 1/n_i)."""

    def __init__(self, problem: Problem, data, clients: np.ndarray, device: torch.device) -> None:
        from fedshuffle.executors.local import client_rows  # the executors' own data access (lazy data included)

        features, labels, own = client_rows(data, clients)
        width = max(len(r) for r in own)
        rows = np.full((len(clients), width), -1, dtype=np.int64)
        for c, r in enumerate(own):
            rows[c, : len(r)] = r
        rows_t = torch.from_numpy(rows).to(device)
        mask = (rows_t >= 0).to(features.dtype)
        self.problem = problem
        self.features, self.labels = features[rows_t.clamp(min=0)], labels[rows_t.clamp(min=0)]
        self.weights = mask / mask.sum(1, keepdim=True)
        self.sizes = np.array([len(r) for r in own], dtype=np.int64)

    def __call__(self, points: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(f_i(z_i), ∇f_i(z_i)) of the members ``rows`` at ``points`` (one row per member)."""
        f, y, v = self.features[rows], self.labels[rows], self.weights[rows]
        problem = self.problem
        values = vmap(lambda p, a, b, w: (problem.losses(p, a, b) * w).sum())(points, f, y, v)
        return values, problem.batched_gradient(points, f, y, v)


def solve_prox(objectives: ClientObjectives, centers: torch.Tensor, eta: float, tol: float, max_iter: int, start: torch.Tensor | None = None, memory: int = 10) -> ProxSolution:
    """prox_{ηf_i}(v_i) for every row by L-BFGS with Armijo backtracking, until ‖∇h_i‖ ≤ tol or ``max_iter`` iterations."""
    z = (centers if start is None else start).clone()
    C = z.shape[0]
    all_rows = torch.arange(C, device=z.device)
    sizes = torch.as_tensor(objectives.sizes, device=z.device)
    evaluated = 0

    def h(points: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal evaluated
        evaluated += int(sizes[rows].sum())
        value, gradient = objectives(points, rows)
        diff = points - centers[rows]
        return value + (diff * diff).sum(1) / (2 * eta), gradient + diff / eta

    value, gradient = h(z, all_rows)
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (s, y, ρ) per row; ρ = 0 drops a row's pair
    scale = torch.full((C,), eta, dtype=z.dtype, device=z.device)  # H₀ = γ I per row, γ = sᵀy/yᵀy
    iterations = 0
    for iterations in range(1, max_iter + 1):
        active = gradient.norm(dim=1) > tol
        if not bool(active.any()):
            iterations -= 1
            break
        q = gradient.clone()
        alphas = []
        for s, y, rho in reversed(pairs):
            a = rho * (s * q).sum(1)
            q -= a.unsqueeze(1) * y
            alphas.append(a)
        r = scale.unsqueeze(1) * q
        for (s, y, rho), a in zip(pairs, reversed(alphas)):
            b = rho * (y * r).sum(1)
            r += (a - b).unsqueeze(1) * s
        direction = -r
        slope = (direction * gradient).sum(1)
        bad = slope >= 0  # not a descent direction (a non-convex row): steepest descent instead
        direction[bad] = -scale[bad].unsqueeze(1) * gradient[bad]
        slope = (direction * gradient).sum(1)
        step = torch.ones(C, dtype=z.dtype, device=z.device)
        pending = active.clone()
        new_z, new_value, new_gradient = z.clone(), value.clone(), gradient.clone()
        for _ in range(MAX_HALVINGS):
            rows = pending.nonzero().squeeze(1)
            if len(rows) == 0:
                break
            trial = z[rows] + step[rows].unsqueeze(1) * direction[rows]
            v_trial, g_trial = h(trial, rows)
            ok = v_trial <= value[rows] + ARMIJO * step[rows] * slope[rows]
            done = rows[ok]
            new_z[done], new_value[done], new_gradient[done] = trial[ok], v_trial[ok], g_trial[ok]
            pending[done] = False
            step[rows[~ok]] *= 0.5
        s, y = new_z - z, new_gradient - gradient
        sy = (s * y).sum(1)
        good = sy > 1e-10 * s.norm(dim=1) * y.norm(dim=1)
        rho = torch.where(good, 1.0 / torch.where(good, sy, torch.ones_like(sy)), torch.zeros_like(sy))
        pairs = [*pairs[-(memory - 1):], (s, y, rho)] if memory > 1 else [(s, y, rho)]
        scale = torch.where(good, sy / (y * y).sum(1).clamp(min=torch.finfo(z.dtype).tiny), scale)
        z, value, gradient = new_z, new_value, new_gradient
    return ProxSolution(z, gradient.norm(dim=1), iterations, evaluated)
