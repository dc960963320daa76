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
        return {"lr": lr * tau.max(), "step_normalization": list(np.full(len(SIZES), tau.max())), "weighting": list(w), "normalization": "sum_one"}
    if method in ("fednova", "fednova_rr"):
        return {"lr": lr * tau.max(), "step_normalization": list(np.full(len(SIZES), tau.max())), "weighting": list(w / tau), "normalization": "sum_one"}
    if method == "fedshuffle":
        return {"lr": lr * tau.max(), "step_normalization": list(tau), "weighting": list(w), "normalization": "unbiased"}
    raise ValueError(method)


@pytest.mark.parametrize("method, order", [("fedavg", "with_replacement"), ("fedavg_rr", "rr"), ("fednova", "with_replacement"), ("fednova_rr", "rr"), ("fedshuffle", "rr")])
@pytest.mark.parametrize("sampler", [FullParticipation(4), UniformWithoutReplacement(4, 2)], ids=["full", "uniform2"])
def test_named_method_equals_fedshuffle_gen_with_its_parameters(method, order, sampler):
    lr, epochs = 0.03, 2
    tau = epochs * np.array(SIZES)
    direct = trajectory(method, {"lr": lr, "epochs": epochs}, sampler)
    general = trajectory("fedshuffle_gen", {**gen_parameters(method, lr, epochs, tau, None), "epochs": epochs, "order": order}, sampler)
    assert torch.allclose(direct, general, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(direct[0], direct[-1])  # the run moved


def test_fedshuffle_mvr_is_fedshuffle_with_exact_global_momentum():
    a = trajectory("fedshuffle_mvr", {"lr": 0.03}, FullParticipation(4))
    b = trajectory("fedshuffle", {"lr": 0.03, "global_momentum": 0.9, "momentum_estimator": "exact"}, FullParticipation(4))
    assert torch.equal(a, b)
    assert not torch.allclose(a, trajectory("fedshuffle", {"lr": 0.03}, FullParticipation(4)))


def test_fixed_steps_equal_to_epoch_work_reproduce_the_epoch_run_for_equal_sizes():
    """With equal |D_i| and RR, K = E|D_i| steps is the same run as E epochs; FedAvgMin/Mean then coincide."""
    rng = np.random.default_rng(1)
    data = quadratic_dataset([3, 3, 3], rng.normal(size=(9, 2)))
    runs = {}
    for name, settings in {"epochs": {"lr": 0.05, "epochs": 2, "order": "rr"}, "min": {"lr": 0.05, "epochs": 2, "order": "rr", "steps": "min"},
                           "mean": {"lr": 0.05, "epochs": 2, "order": "rr", "steps": "mean"}, "fixed": {"lr": 0.05, "epochs": 2, "order": "rr", "steps": 6}}.items():
        sim = Simulation(Quadratic(2), data, build_flat("fedavg", settings), FullParticipation(3), seed=4)
        for _ in range(10):
            sim.step()
        runs[name] = sim.params
    for name in ("min", "mean", "fixed"):
        assert torch.equal(runs[name], runs["epochs"])
