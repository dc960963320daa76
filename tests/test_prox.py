"""FedCDR's deterministic prox: Algorithm 1 with an exact prox against its closed form, and the stated tolerance."""

import numpy as np
import pytest
import torch

from fedshuffle import MLP, Cyclic, LogisticRegression, Quadratic, Simulation
from fedshuffle.data import FederatedDataset, contiguous_partition, objective_weights
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.local.prox import ClientObjectives, solve_prox

from conftest import build_flat


def quadratic_population(sizes=(3, 1, 4, 2, 5, 1), dim=3, spread=4.0, seed=0):
    rng = np.random.default_rng(seed)
    centers = spread * rng.normal(size=(len(sizes), dim))
    targets = np.concatenate([c + rng.normal(size=(s, dim)) for c, s in zip(centers, sizes)])
    data = FederatedDataset(
        torch.tensor(targets),
        torch.zeros(len(targets)),
        contiguous_partition(list(sizes)),
        objective_weights(np.array(sizes), "uniform"),
    )
    means = np.stack([targets[ix].mean(0) for ix in data.client_indices])  # f_i(z) = ½‖z − ē_i‖² + const
    return Quadratic(dim), data, torch.tensor(means)


@pytest.mark.parametrize("init", ["prox", "lazy"])
def test_fedcdr_with_the_lbfgs_prox_equals_algorithm_1_in_closed_form_on_quadratics(init):
    """prox_{ηf_i}(y) = (y + ηē_i)/(1 + η); Algorithm 1 run by hand with it, on the simulation's cohorts."""
    problem, data, means = quadratic_population()
    alpha, eta = 0.8, 1.5
    alg = build_flat(
        "fedcdr",
        {
            "lr": 0.1,
            "alpha": alpha,
            "eta": eta,
            "exact_prox": False,
            "prox_solver": "lbfgs",
            "prox_tol": 1e-11,
            "initialization": init,
        },
    )
    sim = Simulation(problem, data, alg, Cyclic(6, 2, "reshuffle"), seed=5)
    prox = lambda v, i: (v + eta * means[i]) / (1 + eta)  # noqa: E731
    x0 = sim.params.clone()
    y = x0.expand(6, -1).clone()
    xi = torch.stack([prox(x0, i) for i in range(6)])
    xhat = 2 * xi - y if init == "prox" else x0.expand(6, -1).clone()
    x = x0.clone()
    for _ in range(18):
        record, broadcast = sim.step(), x.clone()
        for i in record.cohort:
            y[i] = y[i] + alpha * (broadcast - xi[i])
            new = prox(y[i], i)
            x = x + (2 * new - y[i] - xhat[i]) / 6
            xi[i], xhat[i] = new, 2 * new - y[i]
        torch.testing.assert_close(sim.params, x, rtol=0, atol=1e-9)
        assert record.extras["prox_residual"] <= 1e-11
    gradient = x - means.mean(0)  # ∇f(x) for f = (1/n)Σ f_i
    offset = (
        2 * (x0 - torch.stack([prox(x0, i) for i in range(6)]).mean(0)) / eta
    )  # Algorithm 1 keeps x − (1/n)Σx̂_i = η·offset/1
    if init == "prox":  # the literal initialization converges to ∇f(x) = 2·(1/n)Σ∇f_i(x_i⁰), not to x*
        for _ in range(300):
            sim.step()
        torch.testing.assert_close(sim.params - means.mean(0), offset, rtol=0, atol=1e-8)
    else:
        assert float(gradient.norm()) < float(offset.norm())  # moving toward x* = (1/n)Σē_i


def logistic_clients():
    rng = np.random.default_rng(3)
    sizes = [30, 7, 55, 12]
    x = np.concatenate([rng.normal(loc=2 * rng.normal(size=5), size=(s, 5)) for s in sizes])
    y = np.sign(x @ rng.normal(size=5) + 0.5 * rng.normal(size=len(x)))
    return LogisticRegression(5, 0.01), FederatedDataset(
        torch.tensor(x), torch.tensor(y), contiguous_partition(sizes), objective_weights(np.array(sizes), "uniform")
    )


def mlp_clients():
    rng = np.random.default_rng(4)
    sizes = [40, 9, 25]
    x = rng.normal(size=(sum(sizes), 6))
    y = rng.integers(0, 3, size=sum(sizes))
    return MLP(6, [8], 3), FederatedDataset(
        torch.tensor(x), torch.tensor(y), contiguous_partition(sizes), objective_weights(np.array(sizes), "uniform")
    )


@pytest.mark.parametrize(
    "make, clients, eta, tol",
    [
        (logistic_clients, [0, 1, 2, 3], 10.0, 1e-7),
        (logistic_clients, [0, 1, 2, 3], 0.5, 1e-7),
        (mlp_clients, [0, 2], 0.5, 1e-4),
    ],
    ids=["logistic-eta10", "logistic-eta0.5", "mlp-eta0.5"],
)
def test_lbfgs_prox_meets_its_tolerance_on_the_clients_full_data(make, clients, eta, tol):
    problem, data = make()
    clients = np.array(clients)
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(len(clients), problem.dim, generator=gen, dtype=torch.float64)
    solution = solve_prox(ClientObjectives(problem, data, clients, centers.device), centers, eta, tol, 200)
    gradients = VectorizedExecutor().client_gradients(problem, data, solution.points, clients)  # an independent check
    residual = (gradients + (solution.points - centers) / eta).norm(dim=1)
    assert float(residual.max()) <= tol and solution.iterations < 200
    torch.testing.assert_close(residual, solution.residual, rtol=1e-6, atol=1e-12)
    assert solution.sample_gradients >= solution.iterations * int(data.sizes[clients].min())
    if problem.convex:  # h_i is (1/η)-strongly convex: ‖z − prox‖ ≤ η·residual; a far tighter solve is the reference
        tight = solve_prox(ClientObjectives(problem, data, clients, centers.device), centers, eta, 1e-12, 500)
        assert bool(((solution.points - tight.points).norm(dim=1) <= eta * residual + 1e-12).all())


def test_the_prox_residual_is_reported_when_a_relu_kink_stops_the_solver():
    """Client 1 of the small ReLU MLP: the minimizer of h_1 sits on a kink; the solver stops and says how far it got."""
    problem, data = mlp_clients()
    centers = torch.randn(1, problem.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    solution = solve_prox(ClientObjectives(problem, data, np.array([1]), centers.device), centers, 0.5, 1e-8, 200)
    gradients = VectorizedExecutor().client_gradients(problem, data, solution.points, np.array([1]))
    torch.testing.assert_close(
        (gradients + (solution.points - centers) / 0.5).norm(dim=1), solution.residual, rtol=1e-6, atol=1e-12
    )
    assert solution.iterations < 200 and float(solution.residual[0]) > 1e-8


@pytest.mark.parametrize("make", [logistic_clients, mlp_clients], ids=["logistic", "mlp"])
def test_a_cohort_solve_equals_each_member_solved_alone(make):
    """The rows share one batched evaluation and one ring of L-BFGS pairs, but no information: a member's iterates
    are the same in a cohort as alone (an early stop included: the tolerance is met by some rows before others)."""
    problem, data = make()
    clients = np.arange(len(data.sizes))
    centers = torch.randn(len(clients), problem.dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    together = solve_prox(ClientObjectives(problem, data, clients, centers.device), centers, 2.0, 1e-6, 25)
    for row in range(len(clients)):
        alone = solve_prox(
            ClientObjectives(problem, data, clients[row : row + 1], centers.device),
            centers[row : row + 1],
            2.0,
            1e-6,
            25,
        )
        torch.testing.assert_close(together.points[row : row + 1], alone.points, rtol=0, atol=1e-9)
        torch.testing.assert_close(together.residual[row : row + 1], alone.residual, rtol=0, atol=1e-9)


def textbook_lbfgs(objective, center, eta, tol, max_iter, memory=10):
    """One row's L-BFGS as the solver's docstring states it, unbatched: the pairs of the last ``memory`` iterations
    (None where sᵀy ≤ 0 left a pair out), the two-loop recursion, Armijo backtracking by halving (a shrinking ‖∇h‖
    instead, where h changes by less than its value's resolution)."""

    def h(z):
        value, gradient = objective(z[None], torch.tensor([0]))
        return float(value[0] + (z - center).square().sum() / (2 * eta)), gradient[0] + (z - center) / eta

    z = center.clone()
    value, gradient = h(z)
    pairs, gamma = [], 0.0
    for _ in range(max_iter):
        if float(gradient.norm()) <= tol:
            break
        stored = [p for p in pairs if p is not None]
        q, alphas = gradient.clone(), []
        for s, y in reversed(stored):
            alphas.append(float(s @ q) / float(s @ y))
            q -= alphas[-1] * y
        r = q * (gamma if stored else min(eta, 1 / float(gradient.norm())))
        for (s, y), a in zip(stored, reversed(alphas)):
            r += s * (a - float(y @ r) / float(s @ y))
        direction = -r
        if float(gradient @ direction) >= 0:
            pairs, direction = [], -min(eta, 1 / float(gradient.norm())) * gradient
        for halving in range(40):
            step = 0.5**halving
            trial_value, trial_gradient = h(z + step * direction)
            if abs(trial_value - value) <= 4 * torch.finfo(torch.float64).eps * abs(
                value
            ):  # below the value's resolution
                if float(trial_gradient.norm()) < float(gradient.norm()):
                    break
            elif trial_value <= value + 1e-4 * step * float(gradient @ direction):
                break
        else:
            break
        s, y = step * direction, trial_gradient - gradient
        z, value, gradient = z + s, trial_value, trial_gradient
        kept = float(s @ y) > 1e-10 * float(s.norm() * y.norm())
        pairs = (pairs + [(s, y) if kept else None])[-memory:]
        gamma = float(s @ y) / float(y @ y) if kept else gamma
    return z


@pytest.mark.parametrize(
    "make, eta, iterations", [(logistic_clients, 10.0, 25), (mlp_clients, 2.0, 15)], ids=["logistic", "mlp"]
)
def test_the_batched_solver_follows_textbook_lbfgs_row_by_row(make, eta, iterations):
    """The ring of pairs shared by the cohort gives each row the iterates of an unbatched L-BFGS (memory 3, so
    the ring wraps around several times; the logistic rows meet the tolerance at different iterations). Compared
    before rounding takes over: near the solution a backtracking line search decides on differences of 1e-16,
    and the MLP's kinks amplify them (1e-8 apart after 40 iterations)."""
    problem, data = make()
    clients = np.arange(len(data.sizes))
    centers = torch.randn(len(clients), problem.dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    batched = solve_prox(
        ClientObjectives(problem, data, clients, centers.device), centers, eta, 1e-9, iterations, memory=3
    )
    assert batched.iterations > 3 * 3  # the ring of 3 slots went round at least three times
    for row in range(len(clients)):
        reference = textbook_lbfgs(
            ClientObjectives(problem, data, clients[row : row + 1], centers.device),
            centers[row],
            eta,
            1e-9,
            iterations,
            memory=3,
        )
        torch.testing.assert_close(batched.points[row], reference, rtol=0, atol=1e-10)


def test_a_tolerance_below_the_precision_limit_stops_the_solver_instead_of_wandering():
    """Far from the origin (‖v‖ ≈ 10⁶) ‖∇h‖ cannot get below about 10⁶·ε: a tolerance of 10⁻¹⁴ is out of reach. The line
    search then judges by ‖∇h‖, where h's change is below its resolution, so the solver stops at the precision
    limit within a few iterations, not after ``max_iter`` steps accepted on rounding."""
    problem, data, means = quadratic_population()
    clients = np.arange(len(data.sizes))
    centers = 1e6 * torch.randn(
        len(clients), problem.dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    eta = 1.5
    solved = solve_prox(ClientObjectives(problem, data, clients, centers.device), centers, eta, 1e-14, 500)
    exact = (centers + eta * means) / (1 + eta)
    assert solved.iterations < 20
    torch.testing.assert_close(solved.points, exact, rtol=1e-15, atol=0)
    assert float(solved.residual.max()) < 1e-8
