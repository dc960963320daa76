"""Privacy and secure-aggregation settings that would make a run meaningless are refused before it starts."""

import warnings

import pytest
import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.runner import build_simulation
from fedshuffle.experiments.schema import Experiment, validate
from fedshuffle.privacy import SIGMA_RANGE, Accountant

pytest.importorskip("opacus", reason="the privacy accountant needs Opacus")


def spec(**privacy):
    raw = {
        "data": {"client_sizes": [2, 3, 4, 5]},
        "local": {"lr": 0.1},
        "run": {"rounds": 2},
        "sampler": {"name": "uniform", "cohort": 2},
        "privacy": {"mode": "central", "clip": 1.0, **privacy},
    }
    return validate(Experiment, raw).runs()[0][1]


@pytest.mark.parametrize("sigma", [1e-160, 1e-101, 1001.0, 1e300])
def test_a_noise_multiplier_the_accountant_cannot_evaluate_is_refused(sigma):
    with pytest.raises(ConfigError) as err:
        spec(noise_multiplier=sigma)
    assert err.value.field == "privacy.noise_multiplier" and "outside what the privacy" in err.value.message
    assert "accepted: 0 (no noise, ε = inf) or 1e-100..1000" in err.value.message


@pytest.mark.parametrize("sigma", [*SIGMA_RANGE, 1.0])
def test_the_accountant_evaluates_every_accepted_noise_multiplier(sigma):
    sim, _ = build_simulation(spec(noise_multiplier=sigma), 0)
    sim.step()
    assert sim.counters.epsilon >= 0 and sim.counters.epsilon == sim.counters.epsilon  # a number, not NaN


def test_delta_must_be_below_one_over_the_number_of_clients():
    with pytest.raises(ConfigError) as err:
        build_simulation(spec(noise_multiplier=1.0, delta=0.25), 0)
    assert err.value.field == "privacy.delta" and "not below 1/n = 1/4" in err.value.message
    assert "accepted: 0 < δ < 0.25" in err.value.message
    build_simulation(spec(noise_multiplier=1.0, delta=0.2), 0)


def test_a_negative_bound_from_the_conversion_is_reported_as_zero():
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_step = rdp.compute_rdp(q=1.0, noise_multiplier=100.0, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS)
        raw, _ = rdp.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=per_step, delta=0.2)
    assert raw < 0
    assert Accountant(100.0, 1.0, 0.2).epsilon(1) == 0.0


def test_a_secure_aggregation_that_rounds_every_update_to_zero_is_refused():
    pytest.importorskip("flwr", reason="secure aggregation is Flower's")
    from fedshuffle.integrations.flower.secagg import SecureAggregation

    model = torch.full((10,), 0.5)
    SecureAggregation().check_resolution(model)  # Flower's defaults: one level 3.8e-6
    with pytest.raises(ConfigError) as err:
        SecureAggregation(quantization_range=2).check_resolution(model)
    assert err.value.field == "run-config.secagg-quantization-range" and "give Q >= 32000" in err.value.message
    with pytest.raises(ConfigError) as err:
        SecureAggregation(clipping_range=1e300).check_resolution(model)
    assert err.value.field == "run-config.secagg-clipping-range" and "give c <= " in err.value.message
    with pytest.raises(ConfigError, match=r"the model's scale \(1, max\|x⁰\|\)"):  # a model starting at 0: scale 1
        SecureAggregation(quantization_range=1000).check_resolution(torch.zeros(10))
    SecureAggregation(quantization_range=20_000).check_resolution(torch.zeros(10))


def test_the_flower_server_checks_the_resolution_before_the_first_round():
    pytest.importorskip("flwr", reason="secure aggregation is Flower's")
    from test_flower_secagg import federation

    from fedshuffle.integrations.flower.secagg import SecureAggregation
    from fedshuffle.integrations.flower.strategy import FedShuffleStrategy

    _, run, grid = federation("fedshuffle", rounds=1)
    strategy = FedShuffleStrategy(run, secure=SecureAggregation(quantization_range=2))
    with pytest.raises(ConfigError, match="run-config.secagg-quantization-range: one quantization level"):
        strategy.start(grid)
    assert strategy.half.counters.rounds == 0
