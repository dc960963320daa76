"""Fixed points on quadratics against closed forms (FedShuffle §4.1, §4.2, Appendix E)."""

import numpy as np
import pytest
import torch

from conftest import client_means, quadratic_dataset, build_flat
from fedshuffle import FullParticipation, Quadratic, Simulation, UniformWithoutReplacement, unit_quadratic_fixed_point

ETA = 1 / 80  # the paper's toy step for the client with the most local steps
X_STAR = np.full(6, 1 / 6)


def tail_average(sim, rounds, burn_in):
    acc = torch.zeros_like(sim.params)
    for r in range(rounds):
        sim.step()
        if r >= burn_in:
            acc += sim.params
    return (acc / (rounds - burn_in)).numpy()


@pytest.mark.parametrize("epochs", [1, 3])
@pytest.mark.parametrize("lr", [0.05, 0.01])
def test_fedavg_rr_converges_to_its_closed_form_biased_point(epochs, lr):
    """Each client holds |D_i| copies of e_i (paper eq. (10)): RR is deterministic, and FedAvgRR with full
    participation converges to x̂ = Σ w_i s_i e_i / Σ w_i s_i with s_i = 1 − (1 − η)^{E|D_i|}."""
    sizes = [1, 2, 3]
    targets = np.repeat(np.eye(3), sizes, axis=0)
    data = quadratic_dataset(sizes, targets)
    sim = Simulation(
        Quadratic(3), data, build_flat("fedavg_rr", {"lr": lr, "epochs": epochs}), FullParticipation(3), seed=0
    )
    for _ in range(3000):  # until the iterates stop moving (deterministic: RR over copies of one point)
        before = sim.params.clone()
        sim.step()
        if float((sim.params - before).abs().max()) < 1e-16:
            break
    w = np.array(sizes) / 6
    s = 1 - (1 - lr) ** (epochs * np.array(sizes))
    closed_form = w * s / (w * s).sum()
    assert np.max(np.abs(sim.params.numpy() - closed_form)) < 1e-12
    # and the library's general closed form agrees
    general = unit_quadratic_fixed_point(sim.algorithm, sim.sampler, data.sizes, data.weights, np.eye(3))
    assert np.max(np.abs(general - closed_form)) < 1e-15
    # far from x* = w (the bias of §4.1)
    assert np.max(np.abs(closed_form - w)) > 0.05


def test_fedavg_rr_small_step_limit_is_the_size_squared_objective():
    """§4.1: as η → 0, FedAvgRR's point tends to Σ|D_i|² e_i / Σ|D_i|²; the gap shrinks linearly in η."""
    sizes = np.array([1, 2, 3])
    data = quadratic_dataset(list(sizes), np.repeat(np.eye(3), sizes, axis=0))
    limit = sizes**2 / (sizes**2).sum()
    gaps = []
    for lr in (1e-2, 1e-3, 1e-4):
        alg = build_flat("fedavg_rr", {"lr": lr})
        gaps.append(
            np.abs(unit_quadratic_fixed_point(alg, FullParticipation(3), sizes, data.weights, np.eye(3)) - limit).max()
        )
    assert gaps[0] > gaps[1] > gaps[2]
    assert gaps[2] < 1e-4 and 8 < gaps[1] / gaps[2] < 12


@pytest.mark.parametrize(
    "method, expected",
    [
        ("fedavg_rr", [0.071662916, 0.143027236, 0.214094204]),
        ("fednova_rr", [0.167130434, 0.166782246, 0.166435025]),
        ("fedshuffle", [0.167188647, 0.166666183, 0.166492996]),
    ],
)
def test_toy_fixed_points_match_reference_constants(toy, method, expected):
    """REFERENCE-NOTES §10.2: stationary means on (36) at η = 1/80, full participation, one epoch."""
    alg = build_flat(method, {"lr": ETA / 3})
    x_hat = unit_quadratic_fixed_point(alg, FullParticipation(3), toy.sizes, toy.weights, client_means(toy))
    assert np.allclose(x_hat[[0, 1, 3]], expected, atol=5e-9)


@pytest.mark.parametrize("method", ["fedavg_rr", "fedshuffle", "fednova_rr"])
def test_stochastic_runs_average_to_the_closed_form(toy, method):
    """The long-run average of the random-reshuffling iterates is the closed-form stationary mean."""
    alg = build_flat(method, {"lr": ETA / 3})
    sim = Simulation(Quadratic(6), toy, alg, FullParticipation(3), seed=7)
    x_bar = tail_average(sim, 3000, 500)
    x_hat = unit_quadratic_fixed_point(alg, sim.sampler, toy.sizes, toy.weights, client_means(toy))
    assert np.max(np.abs(x_bar - x_hat)) < 3e-4


def test_fedavg_saturates_while_fedshuffle_and_fednova_rr_remove_the_inconsistency(toy):
    """Figure 1 (left): FedAvgRR's error floor is ~5e4 times FedShuffle's; FedShuffle beats FedNovaRR."""
    errors = {}
    for method in ("fedavg_rr", "fednova_rr", "fedshuffle"):
        x_hat = unit_quadratic_fixed_point(
            build_flat(method, {"lr": ETA / 3}), FullParticipation(3), toy.sizes, toy.weights, client_means(toy)
        )
        errors[method] = np.sum((x_hat - X_STAR) ** 2)
    assert errors["fedavg_rr"] == pytest.approx(1.689147e-2, rel=1e-5)
    assert errors["fedavg_rr"] > 1e4 * errors["fedshuffle"]
    assert errors["fedshuffle"] < errors["fednova_rr"] < 1e-6


def test_sum_one_is_biased_and_unbiased_weights_are_not_under_partial_participation(toy):
    """Figure 1 (middle right), REFERENCE-NOTES §10.2b: 2 of 3 clients uniformly, η = 1/160."""
    sampler = UniformWithoutReplacement(3, 2)
    points = {}
    for normalization in ("sum_one", "unbiased"):
        alg = build_flat("fedshuffle", {"lr": 1 / 480, "normalization": normalization})
        points[normalization] = unit_quadratic_fixed_point(alg, sampler, toy.sizes, toy.weights, client_means(toy))
    assert np.allclose(points["sum_one"][[0, 1, 3]], [0.194735068, 0.177765298, 0.149911446], atol=1e-9)
    assert np.sum((points["sum_one"] - X_STAR) ** 2) == pytest.approx(1.8764067e-3, rel=1e-6)
    assert np.sum((points["unbiased"] - X_STAR) ** 2) < 1e-7
    # and simulation shows the same separation
    errs = {}
    for normalization in ("sum_one", "unbiased"):
        alg = build_flat("fedshuffle", {"lr": 1 / 480, "normalization": normalization})
        sim = Simulation(Quadratic(6), toy, alg, sampler, seed=3)
        errs[normalization] = np.sum((tail_average(sim, 6000, 1500) - X_STAR) ** 2)
    assert errs["sum_one"] > 1.2e-3 and errs["unbiased"] < 2e-4


def test_sum_one_small_step_limit(toy):
    """η → 0 limit of sum-one under 2-of-3 sampling: x̃ = (7/36, 8/45, 8/45, 3/20, 3/20, 3/20), ‖x̃ − x*‖² = 1/540."""
    alg = build_flat("fedshuffle", {"lr": 1e-7, "normalization": "sum_one"})
    x = unit_quadratic_fixed_point(alg, UniformWithoutReplacement(3, 2), toy.sizes, toy.weights, client_means(toy))
    assert np.allclose(x, [7 / 36, 8 / 45, 8 / 45, 3 / 20, 3 / 20, 3 / 20], atol=1e-6)
    assert np.sum((x - X_STAR) ** 2) == pytest.approx(1 / 540, rel=1e-5)


def test_importance_sampling_beats_uniform_on_the_d10_instance():
    """Figure 1 (right): sizes (8, 1, 1), d = 10, one client per round, each at its step from the reference
    toy (η = 1/500 uniform, 1/300 IS). IS reaches the optimum's neighbourhood much faster: its f − f*
    over rounds 500–1500 is less than half of uniform sampling's. (Its final noise floor is not lower:
    the larger step it affords raises the floor; see the closing note of the preset.)"""
    from fedshuffle import Independent

    data = quadratic_dataset([8, 1, 1])
    x_star = torch.full((10,), 0.1, dtype=torch.float64)
    window = {}
    for label, lr, sampler in (
        ("uniform", 1 / 4000, UniformWithoutReplacement(3, 1)),
        ("importance", 1 / 2400, Independent.importance(data.weights, 1)),
    ):
        gaps = []
        for seed in (1, 2, 3):
            sim = Simulation(Quadratic(10), data, build_flat("fedshuffle", {"lr": lr}), sampler, seed=seed)
            for r in range(1500):
                sim.step()
                if r >= 500:
                    gaps.append(0.5 * float(((sim.params - x_star) ** 2).sum()))
        window[label] = np.mean(gaps)
    assert window["importance"] < 0.5 * window["uniform"]


def test_global_momentum_exact_fixes_fedavg_inconsistency(toy):
    """Figure 1 (middle left): with the unbiased momentum of (13)–(14), FedAvgRR's bias drops sharply."""
    errs = {}
    for beta in (0.0, 0.9):
        alg = build_flat("fedavg_rr", {"lr": ETA / 3, "global_momentum": beta})
        sim = Simulation(Quadratic(6), toy, alg, FullParticipation(3), seed=5)
        errs[beta] = np.sum((tail_average(sim, 3000, 1500) - X_STAR) ** 2)
    assert errs[0.0] > 1.6e-2
    assert errs[0.9] < 0.1 * errs[0.0]


def test_fedshuffle_gen_hybrid_removes_unfinished_work_bias(toy):
    """Figure 4: when clients skip their last step, FedShuffle is biased and the FedShuffleGen hybrid is not."""
    means = client_means(toy)
    err = {}
    for method in ("fedshuffle", "fedshuffle_gen"):
        alg = build_flat(method, {"lr": ETA / 3, "drop_last_steps": 1})
        x_hat = unit_quadratic_fixed_point(alg, FullParticipation(3), toy.sizes, toy.weights, means)
        err[method] = np.sum((x_hat - X_STAR) ** 2)
    assert err["fedshuffle"] > 1e-3
    assert err["fedshuffle_gen"] < 1e-5
