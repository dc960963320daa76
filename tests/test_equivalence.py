"""One method configured as another gives the other's numbers (FedShuffleGen, Appendix E.2)."""

import numpy as np
import pytest
import torch

from conftest import params_trajectory, quadratic_dataset, build_flat
from fedshuffle import FullParticipation, Quadratic, Simulation, UniformWithoutReplacement

SIZES = [1, 2, 3, 5]


def trajectory(method, settings, sampler, rounds=40, seed=11):
    rng = np.random.default_rng(0)
    data = quadratic_dataset(SIZES, rng.normal(size=(sum(SIZES), 4)))
    return params_trajectory(Simulation(Quadratic(4), data, build_flat(method, settings), sampler, seed=seed), rounds)


def gen_parameters(method, lr, epochs, tau, sampler_counts):
    """FedShuffleGen's explicit (c, w̃, q) for a named method (B = 1, fixed epochs)."""
    w = np.array(SIZES) / sum(SIZES)
    tau = np.asarray(tau, dtype=float)
    if method in ("fedavg", "fedavg_rr"):
        return {
            "lr": lr * tau.max(),
            "step_normalization": list(np.full(len(SIZES), tau.max())),
            "weighting": list(w),
            "normalization": "sum_one",
        }
    if method in (
        "fednova",
        "fednova_rr",
    ):  # Wang et al. eq. (5): w_i·τ_eff/τ_i with τ_eff = Σ_j w_jτ_j, divided by p_i
        return {
            "lr": lr * tau.max(),
            "step_normalization": list(np.full(len(SIZES), tau.max())),
            "weighting": list(w * (w @ tau) / tau),
            "normalization": "unbiased",
        }
    if method == "fednova_reference":  # the FedShuffle reference code: w_i/τ_i normalized to sum one over the cohort
        return {
            "lr": lr * tau.max(),
            "step_normalization": list(np.full(len(SIZES), tau.max())),
            "weighting": list(w / tau),
            "normalization": "sum_one",
        }
    if method == "fedshuffle":
        return {
            "lr": lr * tau.max(),
            "step_normalization": list(tau),
            "weighting": list(w),
            "normalization": "unbiased",
        }
    raise ValueError(method)


@pytest.mark.parametrize(
    "method, order",
    [
        ("fedavg", "with_replacement"),
        ("fedavg_rr", "reshuffle"),
        ("fednova", "with_replacement"),
        ("fednova_rr", "reshuffle"),
        ("fedshuffle", "reshuffle"),
    ],
)
@pytest.mark.parametrize("sampler", [FullParticipation(4), UniformWithoutReplacement(4, 2)], ids=["full", "uniform2"])
def test_named_method_equals_fedshuffle_gen_with_its_parameters(method, order, sampler):
    lr, epochs = 0.03, 2
    tau = epochs * np.array(SIZES)
    direct = trajectory(method, {"lr": lr, "epochs": epochs}, sampler)
    general = trajectory(
        "fedshuffle_gen", {**gen_parameters(method, lr, epochs, tau, None), "epochs": epochs, "order": order}, sampler
    )
    assert torch.allclose(direct, general, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(direct[0], direct[-1])  # the run moved


@pytest.mark.parametrize("sampler", [FullParticipation(4), UniformWithoutReplacement(4, 2)], ids=["full", "uniform2"])
def test_fednova_with_sum_one_is_the_fedshuffle_reference_codes_normalization(sampler):
    lr, epochs = 0.03, 2
    tau = epochs * np.array(SIZES)
    direct = trajectory("fednova_rr", {"lr": lr, "epochs": epochs, "normalization": "sum_one"}, sampler)
    general = trajectory(
        "fedshuffle_gen",
        {**gen_parameters("fednova_reference", lr, epochs, tau, None), "epochs": epochs, "order": "reshuffle"},
        sampler,
    )
    assert torch.allclose(direct, general, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(direct, trajectory("fednova_rr", {"lr": lr, "epochs": epochs}, sampler))


def test_fedshuffle_mvr_is_fedshuffle_with_exact_global_momentum():
    a = trajectory("fedshuffle_mvr", {"lr": 0.03}, FullParticipation(4))
    b = trajectory(
        "fedshuffle", {"lr": 0.03, "global_momentum": 0.9, "momentum_estimator": "exact"}, FullParticipation(4)
    )
    assert torch.equal(a, b)
    assert not torch.allclose(a, trajectory("fedshuffle", {"lr": 0.03}, FullParticipation(4)))


def test_fixed_steps_equal_to_epoch_work_reproduce_the_epoch_run_for_equal_sizes():
    """With equal |D_i| and RR, K = E|D_i| steps is the same run as E epochs; FedAvgMin/Mean then coincide."""
    rng = np.random.default_rng(1)
    data = quadratic_dataset([3, 3, 3], rng.normal(size=(9, 2)))
    runs = {}
    for name, settings in {
        "epochs": {"lr": 0.05, "epochs": 2, "order": "reshuffle"},
        "min": {"lr": 0.05, "epochs": 2, "order": "reshuffle", "steps": "min"},
        "mean": {"lr": 0.05, "epochs": 2, "order": "reshuffle", "steps": "mean"},
        "fixed": {"lr": 0.05, "epochs": 2, "order": "reshuffle", "steps": 6},
    }.items():
        sim = Simulation(Quadratic(2), data, build_flat("fedavg", settings), FullParticipation(3), seed=4)
        for _ in range(10):
            sim.step()
        runs[name] = sim.params
    for name in ("min", "mean", "fixed"):
        assert torch.equal(runs[name], runs["epochs"])


def test_fednova_is_wang_et_al_eq_5_on_a_hand_computed_round():
    """Wang et al. (NeurIPS 2020) eq. (5) with w = (1/4, 3/4), τ = (1, 3), full participation:
    x⁺ = x − τ_eff Σ_i w_i (x − y_i)/τ_i, τ_eff = Σ_i w_i τ_i = 2.5. On ½‖x − a‖² with one target per
    client (client 2 holds it three times), τ steps of size η give x − y_i = (1 − (1 − η)^τ_i)(x − a_i)."""
    a1, a2, eta = np.array([1.0, -2.0]), np.array([0.5, 3.0]), 0.2
    data = quadratic_dataset([1, 3], np.stack([a1, a2, a2, a2]))
    sim = Simulation(Quadratic(2), data, build_flat("fednova_rr", {"lr": eta}), FullParticipation(2), seed=0)
    x = np.zeros(2)
    deltas = [(1 - (1 - eta) ** t) * (x - a) for t, a in ((1, a1), (3, a2))]
    expected = x - 2.5 * (0.25 * deltas[0] / 1 + 0.75 * deltas[1] / 3)
    sim.step()
    np.testing.assert_allclose(sim.params.numpy(), expected, rtol=1e-14, atol=1e-15)
