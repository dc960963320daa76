"""The objective inspector: exact enumeration against §4.2 and eq. (31), Monte Carlo against exact."""

import json
from fractions import Fraction

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import build_flat
from fedshuffle import FullParticipation, Independent, UniformWithoutReplacement, inspect_objective
from fedshuffle.cli import app

SIZES = np.array([1, 2, 3])
W = SIZES / 6


def test_sum_one_expected_weights_are_the_papers_fractions():
    """§4.2: sizes 1, 2, 3, two clients uniformly, sum-one: E[ω_i 1{i∈S}] = 7/36, 16/45, 9/20."""
    report = inspect_objective(build_flat("fedavg", {"lr": 0.01}), UniformWithoutReplacement(3, 2), SIZES, W)
    assert report.exact
    expected = [float(Fraction(7, 36)), float(Fraction(16, 45)), float(Fraction(9, 20))]
    assert np.allclose(report.expected_aggregation_weights, expected, atol=1e-15)
    assert report.biased


def test_fedavg_full_participation_effective_weights_are_size_squared():
    """Appendix E.2: full participation, B = 1, E epochs: ŵ_i = |D_i|² / Σ|D_j|² for FedAvg."""
    report = inspect_objective(build_flat("fedavg_rr", {"lr": 0.01, "epochs": 2}), FullParticipation(3), SIZES, W)
    assert np.allclose(report.effective_weights, SIZES**2 / np.sum(SIZES**2), atol=1e-15)


@pytest.mark.parametrize("method", ["fedshuffle", "fednova", "fednova_rr", "fedshuffle_gen"])
def test_consistent_methods_have_effective_weights_equal_to_w(method):
    report = inspect_objective(
        build_flat(method, {"lr": 0.01, "normalization": "unbiased"}), UniformWithoutReplacement(3, 2), SIZES, W
    )
    assert not report.biased
    assert np.allclose(report.effective_weights, W, atol=1e-12)


@pytest.mark.parametrize("method", ["fedavg_min", "fedavg_mean"])
def test_fixed_step_heuristics_are_consistent_only_under_full_participation(method):
    """FedAvgMin/Mean give every client the same K: unbiased with full participation. Under partial
    participation K depends on the cohort (the small client drags K down whenever it is sampled),
    so even unbiased w_i/p_i weights leave ŵ ≠ w."""
    full = inspect_objective(build_flat(method, {"lr": 0.01}), FullParticipation(3), SIZES, W)
    assert np.allclose(full.effective_weights, W, atol=1e-12)
    partial = inspect_objective(
        build_flat(method, {"lr": 0.01, "normalization": "unbiased"}), UniformWithoutReplacement(3, 2), SIZES, W
    )
    assert partial.biased and partial.effective_weights[0] < W[0]


def test_importance_sampling_with_unit_weights_is_unbiased():
    sampler = Independent.importance(W, 1.5)
    report = inspect_objective(build_flat("fedshuffle", {"lr": 0.01}), sampler, SIZES, W)
    assert np.allclose(report.expected_aggregation_weights, W, atol=1e-14)


def test_monte_carlo_agrees_with_exact_within_its_standard_error():
    alg = build_flat("fedavg", {"lr": 0.01})
    exact = inspect_objective(alg, UniformWithoutReplacement(3, 2), SIZES, W)
    mc = inspect_objective(alg, UniformWithoutReplacement(3, 2), SIZES, W, exact=False, rounds=20000)
    z = np.abs(mc.expected_aggregation_weights - exact.expected_aggregation_weights) / mc.aggregation_stderr
    assert np.all(z < 4.5)
    assert np.all(mc.aggregation_stderr < 5e-3)


def test_random_epochs_use_monte_carlo_and_show_fedavg_bias():
    report = inspect_objective(
        build_flat("fedavg_rr", {"lr": 0.01, "epochs": [2, 5]}),
        FullParticipation(3),
        np.array([4, 4, 4]),
        np.full(3, 1 / 3),
        rounds=4000,
    )
    assert not report.exact
    assert np.allclose(report.effective_weights, 1 / 3, atol=5 * report.effective_stderr.max())
    fedshuffle = inspect_objective(
        build_flat("fedshuffle", {"lr": 0.01, "epochs": [2, 5]}),
        FullParticipation(3),
        np.array([1, 4, 9]),
        np.array([1, 4, 9]) / 14,
        rounds=2000,
    )
    assert np.allclose(fedshuffle.effective_weights, np.array([1, 4, 9]) / 14, atol=1e-12)


def test_cli_inspect_json_example_from_the_issue():
    result = CliRunner().invoke(
        app, ["inspect", "--method", "fedavg", "--sizes", "1,2,3", "--sampler", "uniform", "--cohort", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    old = CliRunner().invoke(
        app, ["inspect", "--algorithm", "fedavg", "--sizes", "1,2,3", "--sampler", "uniform", "--cohort", "2", "--json"]
    )
    assert (
        old.exit_code == 0 and old.stdout == result.stdout and "--algorithm is now --method" in old.stderr
    )  # the old name, one more release
    out = json.loads(result.stdout)
    for key in ("weights", "inclusion_probabilities", "expected_aggregation_weights", "effective_weights"):
        assert key in out
    assert np.allclose(out["expected_aggregation_weights"], [7 / 36, 16 / 45, 9 / 20], atol=1e-12)
    assert np.allclose(out["inclusion_probabilities"], [2 / 3] * 3)
    assert out["biased"] is True


def test_cli_inspect_table_warns_and_names_step_convention():
    result = CliRunner().invoke(
        app,
        [
            "inspect",
            "--method",
            "fedshuffle",
            "--sizes",
            "1,2,3",
            "--sampler",
            "uniform",
            "--cohort",
            "2",
            "--set",
            "aggregation.normalization='sum_one'",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "warning" in result.stdout and "τ_max" in result.stdout


@pytest.mark.parametrize(
    "args, field",
    [
        (["--method", "fedavgg"], "method.name"),
        (["--sizes", "1,0,3"], "--sizes"),
        (["--sampler", "uniform", "--cohort", "5"], "sampler.cohort"),
        (["--sampler", "uniform"], "sampler.cohort"),
        (["--lr", "-1"], "local.lr"),
    ],
)
def test_cli_inspect_bad_input_exits_2_naming_the_field(args, field):
    result = CliRunner().invoke(app, ["inspect", *args])
    assert result.exit_code == 2
    assert field in result.stderr and "Traceback" not in result.output
