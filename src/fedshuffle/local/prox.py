"""A deterministic prox solver on each client's full data: prox_{ηf_i}(v_i) to a stated residual tolerance.

For a cohort of clients with centers v_i (stacked ``(C, d)``) it minimizes, row by row,

    h_i(z) = f_i(z) + ‖z − v_i‖²/(2η),   ∇h_i(z) = ∇f_i(z) + (z − v_i)/η,

by L-BFGS with a history per client and Armijo backtracking, the whole cohort in one batched evaluation per
trial step, and stops a client once its residual ‖∇h_i(z)‖ ≤ tol. Because h_i is
(1/η − L)-strongly convex when ηL < 1, the residual bounds the error: ‖z − prox_{ηf_i}(v_i)‖ ≤ η·residual/(1 − ηL).
A non-convex f_i (an MLP with large η) gets a stationary point of h_i with that residual. A ReLU network is only
piecewise smooth: where h_i's minimizer sits on a kink the residual cannot reach 0 and the solver stops when it
stalls; the residual it returns says so (the FedCDR ``prox_residual`` metric).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.func import vmap

from fedshuffle.data.federated import client_rows
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
    """f_i and ∇f_i of a cohort on each member's full data (weights 1/n_i).

    Members are grouped by size (within a factor ``spread`` of the group's largest) and each group is padded to
    its largest member, so a cohort of skewed sizes (FedProx's Synthetic: 45 to 30,000 samples) costs about its
    real work, not cohort × largest."""

    def __init__(self, problem: Problem, data, clients: np.ndarray, device: torch.device, spread: float = 2.0) -> None:
        features, labels, own = client_rows(data, clients)
        self.problem = problem
        self.sizes = np.array([len(r) for r in own], dtype=np.int64)
        self.groups: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []  # (features, labels, weights) padded per group
        self.group_of = torch.empty(len(clients), dtype=torch.long, device=device)  # member → its group
        self.slot_of = torch.empty(len(clients), dtype=torch.long, device=device)  # member → its row in the group
        order = np.argsort(-self.sizes, kind="stable")
        while len(order):
            take = order[self.sizes[order] * spread > self.sizes[order[0]]]
            order = order[len(take) :]
            width = int(self.sizes[take[0]])
            rows = np.full((len(take), width), -1, dtype=np.int64)
            for c, member in enumerate(take):
                rows[c, : len(own[member])] = own[member]
            rows_t = torch.from_numpy(rows).to(device)
            mask = (rows_t >= 0).to(features.dtype)
            members = torch.from_numpy(take).to(device)
            self.group_of[members] = len(self.groups)
            self.slot_of[members] = torch.arange(len(take), device=device)
            self.groups.append(
                (features[rows_t.clamp(min=0)], labels[rows_t.clamp(min=0)], mask / mask.sum(1, keepdim=True))
            )

    def __call__(self, points: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(f_i(z_i), ∇f_i(z_i)) of the members ``rows`` at ``points`` (one row per member), a batched call per
        group."""
        problem = self.problem
        values, gradients = points.new_empty(len(rows)), torch.empty_like(points)
        groups = self.group_of[rows]
        for g in torch.unique(groups).tolist():
            features, labels, weights = self.groups[g]
            at = (groups == g).nonzero().squeeze(1)
            slot = self.slot_of[rows[at]]
            f, y, v = features[slot], labels[slot], weights[slot]
            values[at] = vmap(lambda p, a, b, w: (problem.losses(p, a, b) * w).sum())(points[at], f, y, v)
            gradients[at] = problem.batched_gradient(points[at], f, y, v)
        return values, gradients


def _two_loop(
    gradient: torch.Tensor,
    steps: torch.Tensor,
    changes: torch.Tensor,
    rho: torch.Tensor,
    gamma: torch.Tensor,
    newest: int,
) -> torch.Tensor:
    """H·g for each row by L-BFGS's two-loop recursion over the ring of stored pairs (slot ``newest`` the latest;
    a slot with ρ = 0 holds no pair and contributes nothing)."""
    memory = steps.shape[1]
    order = [(newest - t) % memory for t in range(memory)]  # newest first
    q, alphas = gradient.clone(), []
    for j in order:
        a = rho[:, j] * torch.linalg.vecdot(steps[:, j], q)
        q -= a[:, None] * changes[:, j]
        alphas.append(a)
    r = gamma[:, None] * q
    for j, a in zip(reversed(order), reversed(alphas)):
        b = rho[:, j] * torch.linalg.vecdot(changes[:, j], r)
        r += steps[:, j] * (a - b)[:, None]
    return r


def solve_prox(
    objectives: ClientObjectives,
    centers: torch.Tensor,
    eta: float,
    tol: float,
    max_iter: int,
    start: torch.Tensor | None = None,
    memory: int = 10,
    armijo: float = 1e-4,
    halvings: int = 40,
) -> ProxSolution:
    """prox_{ηf_i}(v_i) for every row at once by L-BFGS (memory m, per-row histories, Armijo backtracking), until
    ‖∇h_i‖ ≤ tol or ``max_iter`` iterations.

    Each iteration takes, for every unfinished row, the two-loop direction d = −H_i∇h_i (H⁰ = γI with
    γ = sᵀy/yᵀy of the newest pair; min(η, 1/‖∇h_i‖) before any pair), then the largest t ∈ {1, ½, ¼, …} with
    h_i(z + t d) ≤ h_i(z) + 10⁻⁴·t·∇h_iᵀd — or, where h_i changes by less than four ulps of its value (near the
    solution a residual ε moves h_i by about ε², and that test would pass or fail on rounding), with ‖∇h_i‖ smaller
    than before. The pairs (s, y) of the last m iterations are kept in one ring shared
    by all rows, written in place; a row's pair is left out (its slot empty) unless sᵀy > 0 (h_i need not be
    convex), so a row keeps at most m pairs, fewer after such an iteration. The ring, not a per-row history
    shifted each iteration, makes the bookkeeping cost one (C, d) write per iteration instead of copies of the
    whole (C, m, d) history: on FEMNIST's MLP (d = 108k) those copies were most of the solver's time.
    All rows are evaluated together, one batched call per trial step. A row stops when its residual meets ``tol``,
    or when no step decreases h_i any more (a ReLU kink, or the limit of the floating-point precision); its
    residual says which."""
    points = (centers if start is None else start).detach().clone()
    count, dim = points.shape
    device, dtype = points.device, points.dtype
    sizes = torch.as_tensor(objectives.sizes, device=device)
    evaluated = 0

    def h(at: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal evaluated
        evaluated += int(sizes[rows].sum())
        value, gradient = objectives(at, rows)
        diff = at - centers[rows]
        return value + (diff * diff).sum(1) / (2 * eta), gradient + diff / eta

    value, gradient = h(points, torch.arange(count, device=device))
    steps = torch.zeros(count, memory, dim, device=device, dtype=dtype)
    changes, rho = torch.zeros_like(steps), torch.zeros(count, memory, device=device, dtype=dtype)
    gamma = torch.zeros(count, device=device, dtype=dtype)
    running = torch.ones(count, dtype=torch.bool, device=device)
    iterations, newest = 0, memory - 1  # the ring's latest slot
    for _ in range(max_iter):
        running &= gradient.norm(dim=1) > tol
        if not bool(running.any()):
            break
        rows = running.nonzero().squeeze(1)
        every = len(rows) == count  # then the history is read in place, not gathered
        g = gradient if every else gradient[rows]
        history = (steps, changes, rho) if every else (steps[rows], changes[rows], rho[rows])
        fresh = history[2].abs().sum(1) == 0
        scale = torch.where(fresh, torch.clamp(1.0 / g.norm(dim=1), max=eta), gamma[rows])
        direction = -_two_loop(g, *history, scale, newest)
        slope = (g * direction).sum(1)
        uphill = slope >= 0  # curvature pairs gone stale: start that row's memory again
        if bool(uphill.any()):
            rho[rows[uphill]] = 0
            direction[uphill] = -torch.clamp(1.0 / g[uphill].norm(dim=1), max=eta)[:, None] * g[uphill]
            slope = (g * direction).sum(1)
        step = torch.ones(len(rows), device=device, dtype=dtype)
        pending = torch.ones(len(rows), dtype=torch.bool, device=device)
        new_value, new_gradient = value[rows].clone(), g.clone()
        for _ in range(halvings):
            trial = pending.nonzero().squeeze(1)
            v, gr = h(points[rows[trial]] + step[trial, None] * direction[trial], rows[trial])
            before = value[rows[trial]]
            # Armijo's sufficient decrease; where the change of h_i is below its value's resolution (near the solution,
            # where a residual ε changes h_i by about ε²), that test passes or fails on rounding, and ‖∇h_i‖ decides
            unresolved = (v - before).abs() <= 4 * torch.finfo(dtype).eps * before.abs()
            accepted = torch.where(
                unresolved, gr.norm(dim=1) < g[trial].norm(dim=1), v <= before + armijo * step[trial] * slope[trial]
            )
            new_value[trial[accepted]], new_gradient[trial[accepted]] = v[accepted], gr[accepted]
            pending[trial[accepted]] = False
            if not bool(pending.any()):
                break
            step[pending] *= 0.5
        moved = ~pending
        running[rows[pending]] = False  # no decrease along the direction: stalled
        if not bool(moved.any()):
            break
        iterations += 1
        rows, step, direction = rows[moved], step[moved], direction[moved]
        s = step[:, None] * direction
        y = new_gradient[moved] - gradient[rows]
        curvature = (s * y).sum(1)
        points[rows] += s
        value[rows], gradient[rows] = new_value[moved], new_gradient[moved]
        keep = curvature > 1e-10 * s.norm(dim=1) * y.norm(dim=1)
        newest = (newest + 1) % memory
        rho[:, newest] = 0  # the slot's old pairs go; the rows that keep a pair fill it
        if bool(keep.any()):
            kept = rows[keep]
            steps[kept, newest], changes[kept, newest] = s[keep], y[keep]
            rho[kept, newest] = 1.0 / curvature[keep]
            gamma[kept] = curvature[keep] / (y[keep] * y[keep]).sum(1)
    return ProxSolution(points, gradient.norm(dim=1), iterations, evaluated)
