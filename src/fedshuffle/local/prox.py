"""A deterministic prox solver on each client's full data: prox_{ηf_i}(v_i) to a stated residual tolerance.

For a cohort of clients with centers v_i (stacked ``(C, d)``) it minimizes, row by row,

    h_i(z) = f_i(z) + ‖z − v_i‖²/(2η),   ∇h_i(z) = ∇f_i(z) + (z − v_i)/η,

by L-BFGS (:class:`torch.optim.LBFGS`, memory m, strong-Wolfe line search), one client at a time, and stops
a client once its residual ‖∇h_i(z)‖ ≤ tol. Because h_i is
(1/η − L)-strongly convex when ηL < 1, the residual bounds the error: ‖z − prox_{ηf_i}(v_i)‖ ≤ η·residual/(1 − ηL).
A non-convex f_i (an MLP with large η) gets a stationary point of h_i with that residual. A ReLU network is only
piecewise smooth: where h_i's minimizer sits on a kink the residual cannot reach 0 and the solver stops when it
stalls; the residual it returns says so (the FedCDR ``prox_residual`` metric).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.func import vmap

from fedshuffle.problems import Problem

#: inner solvers of FedCDR's prox: deterministic L-BFGS on the full client data, or the local SGD epochs
SOLVERS = ("lbfgs", "sgd")


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
    """prox_{ηf_i}(v_i) for every row by :class:`torch.optim.LBFGS` (strong-Wolfe line search), one row at a time,
    until ‖∇h_i‖ ≤ tol or ``max_iter`` iterations: LBFGS stops on ‖∇h_i‖_∞ ≤ tol/√d, which implies ‖∇h_i‖ ≤ tol."""
    points = (centers if start is None else start).detach().clone()
    sizes = objectives.sizes
    evaluated, iterations = 0, 0
    for c in range(points.shape[0]):
        row = torch.tensor([c], device=points.device)
        z = points[c : c + 1].clone().requires_grad_(False)
        z.requires_grad_(True)
        optimizer = torch.optim.LBFGS([z], lr=1, max_iter=max_iter, max_eval=4 * max_iter, tolerance_grad=tol / math.sqrt(z.shape[1]),
                                      tolerance_change=0.0, history_size=memory, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            nonlocal evaluated
            evaluated += int(sizes[c])
            with torch.no_grad():
                value, gradient = objectives(z.detach(), row)
                diff = z.detach() - centers[c : c + 1]
                z.grad = gradient + diff / eta
            return value.sum() + (diff * diff).sum() / (2 * eta)

        done, last = 0, math.inf
        while done < max_iter:  # LBFGS also stops on a non-descent direction: restart it until the tolerance or the cap
            optimizer.state.clear()
            optimizer.param_groups[0].update(max_iter=max_iter - done, max_eval=4 * (max_iter - done))
            optimizer.step(closure)
            ran = int(optimizer.state[z]["n_iter"])
            done += ran
            closure()
            norm = float(z.grad.norm())
            if ran == 0 or norm <= tol or norm >= 0.99 * last:  # met, or stalled (a ReLU kink: the gradient jumps there)
                break
            last = norm
        iterations = max(iterations, done)
        points[c] = z.detach()[0]
    with torch.no_grad():
        _, gradient = objectives(points, torch.arange(points.shape[0], device=points.device))
        residual = (gradient + (points - centers) / eta).norm(dim=1)
    return ProxSolution(points, residual, iterations, evaluated + int(sizes.sum()))
