"""Problems: gradients against autograd, minimizers against optimality, learning on real-shaped data."""

import pytest
import torch

from conftest import build_flat
from fedshuffle import MLP, LogisticRegression, Quadratic, SoftmaxRegression, Simulation, UniformWithoutReplacement
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.experiments.build import build_problem_and_data


def autograd_mean_gradient(problem, x, features, labels):
    x = x.clone().requires_grad_(True)
    problem.losses(x, features, labels).mean().backward()
    return x.grad


@pytest.mark.parametrize(
    "problem, features, labels",
    [
        (Quadratic(3), torch.randn(7, 3, dtype=torch.float64), torch.zeros(7)),
        (
            LogisticRegression(4, 0.1),
            torch.randn(9, 4, dtype=torch.float64),
            torch.tensor([1.0, -1] * 4 + [1.0], dtype=torch.float64),
        ),
    ],
)
def test_closed_form_gradients_match_autograd(problem, features, labels):
    x = torch.randn(problem.dim, dtype=torch.float64)
    assert torch.allclose(
        problem.gradient(x, features, labels), autograd_mean_gradient(problem, x, features, labels), atol=1e-13
    )
    w = torch.rand(features.shape[0], dtype=torch.float64)
    x.requires_grad_(True)
    problem.weighted_loss(x, features, labels, w).backward()
    assert torch.allclose(problem.weighted_gradient(x.detach(), features, labels, w), x.grad, atol=1e-13)


@pytest.mark.parametrize("name", ["logistic", "softmax"])
def test_minimizers_are_stationary(name):
    spec = validate(
        RunSpec,
        {
            "problem": {"name": name, "l2": 0.01},
            "data": {
                "source": "synthetic",
                "samples": 300,
                "features": 5,
                "classes": 2 if name == "logistic" else 3,
                "partition": "iid",
                "clients": 4,
            },
        },
    )
    problem, data = build_problem_and_data(spec)
    s = data.sample_weights()
    x_star = problem.minimizer(data.features, data.labels, s)
    assert float(problem.weighted_gradient(x_star, data.features, data.labels, s).norm()) < 1e-9


def test_fedshuffle_learns_logistic_regression_on_dirichlet_clients():
    spec = validate(
        RunSpec,
        {
            "problem": {"name": "logistic", "l2": 0.01},
            "data": {
                "source": "synthetic",
                "samples": 600,
                "features": 6,
                "partition": "dirichlet",
                "clients": 8,
                "alpha": 0.5,
                "test_fraction": 0.2,
            },
        },
    )
    problem, data = build_problem_and_data(spec)
    assert sum(data.sizes) == 480 and data.test_features.shape[0] == 120
    sim = Simulation(
        problem, data, build_flat("fedshuffle", {"lr": 0.05, "batch_size": 8}), UniformWithoutReplacement(8, 4), seed=0
    )
    s = data.sample_weights()
    f0 = float(problem.weighted_loss(sim.params, data.features, data.labels, s))
    for _ in range(60):
        sim.step()
    f1 = float(problem.weighted_loss(sim.params, data.features, data.labels, s))
    assert f1 < 0.8 * f0
    assert problem.accuracy(sim.params, data.test_features, data.test_labels) > 0.7


def test_mlp_trains_in_float32():
    spec = validate(
        RunSpec,
        {
            "problem": {"name": "mlp", "hidden": [16]},
            "data": {
                "source": "synthetic",
                "samples": 400,
                "features": 8,
                "classes": 3,
                "partition": "iid",
                "clients": 5,
            },
        },
    )
    problem, data = build_problem_and_data(spec)
    assert isinstance(problem, MLP) and problem.dim == 8 * 16 + 16 + 16 * 3 + 3
    sim = Simulation(
        problem,
        data,
        build_flat("fedavg_rr", {"lr": 0.05, "batch_size": 10}),
        UniformWithoutReplacement(5, 5),
        seed=1,
        dtype=torch.float32,
    )
    assert sim.params.dtype == torch.float32
    before = problem.accuracy(sim.params, sim.data.features, sim.data.labels)
    for _ in range(15):
        sim.step()
    assert problem.accuracy(sim.params, sim.data.features, sim.data.labels) > max(0.6, before + 0.1)


def test_softmax_problem_dimension_and_accuracy_bounds():
    problem = SoftmaxRegression(4, 3, 0.0)
    assert problem.dim == 15
    acc = problem.accuracy(
        torch.zeros(15, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64), torch.arange(10) % 3
    )
    assert 0 <= acc <= 1
