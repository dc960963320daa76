"""The Flower server's update bound and robust aggregation against a node that sends a huge finite update: without
them the model is wrecked; with the bound the update is rejected (exactly the round without its member) or clipped
(exactly the round with the clipped update); the median and the trimmed mean equal NumPy's on the same replies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flower_harness import FakeGrid
from test_flower import experiment, model, single_run, variant
from test_flower_replies import arrays_with

from flwr.app import ConfigRecord, Message, RecordDict

from fedshuffle.core.errors import ConfigError
from fedshuffle.integrations.flower.app import client_app
from fedshuffle.integrations.flower.common import AppSettings
from fedshuffle.integrations.flower.messages import TRAIN
from fedshuffle.integrations.flower.replies import UpdateBound
from fedshuffle.integrations.flower.robust import RobustAggregation, averaging_methods
from fedshuffle.integrations.flower.secagg import SecureAggregation
from fedshuffle.integrations.flower.strategy import FedShuffleStrategy

ROGUE = 2  # the client whose node attacks
HUGE = 1e307  # finite: passes every check of the reply's form
ROUNDS = 3


def fedavg(clients: int = 4):
    return experiment([variant("fedavg", sampler={"name": "full"})], clients=clients)


def attacked(exp, forge=lambda a: np.full_like(a, HUGE), clients: int = 4) -> FakeGrid:
    """Every node honest but the one hosting ``ROGUE``, whose training replies carry ``forge(Δ)``."""
    grid = FakeGrid(client_app(exp), clients)
    honest = grid.app

    def app(message, context):
        reply = honest(message, context)
        if message.metadata.message_type == TRAIN and int(message.content["instructions"]["client"]) == ROGUE:
            payload = arrays_with(reply.content["payload"], "delta", forge)
            reply = Message(RecordDict({"payload": payload, "result": reply.content["result"]}), reply_to=message)
        return reply

    grid.app = app
    return grid


def run(
    exp, grid: FakeGrid, rounds: int = ROUNDS, silent: int | None = None, **options
) -> tuple[torch.Tensor, list[dict], list[str]]:
    """The model after ``rounds`` rounds, each round's metrics and the log; client ``silent``'s node never answers
    after the handshake."""
    logged: list[str] = []
    strategy = FedShuffleStrategy(single_run(exp), log=logged.append, **options)
    strategy.handshake(grid)
    if silent is not None:
        grid.lose(silent)
    arrays, reported = strategy.initial_arrays(), []
    for r in range(1, rounds + 1):
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        arrays, metrics = strategy.aggregate_train(r, grid.send_and_receive(messages))
        reported.append(dict(metrics))
    return model(arrays), reported, logged


def test_without_a_bound_one_node_moves_the_model_by_1e307_per_round():
    exp = fedavg()
    wrecked, metrics, _ = run(exp, attacked(exp))
    assert all(m["rejected"] == 0 for m in metrics) and wrecked.abs().max() > 1e306


def test_a_bound_rejects_the_huge_update_exactly_as_if_its_member_had_not_answered():
    exp = fedavg()
    bound = UpdateBound(5.0)
    rejected, metrics, logged = run(exp, attacked(exp), bound=bound)
    without, _, _ = run(exp, FakeGrid(client_app(exp), 4), silent=ROGUE)
    honest, honest_metrics, _ = run(exp, FakeGrid(client_app(exp), 4), bound=bound)
    assert torch.equal(rejected, without) and bool(torch.isfinite(rejected).all())
    assert [m["rejected"] for m in metrics] == [1] * ROUNDS and all(m["clipped"] == 0 for m in metrics)
    assert any("beyond the update bound" in line and f"client {ROGUE} " in line for line in logged)
    # the honest run never meets the bound: it is the run without one
    assert torch.equal(honest, run(exp, FakeGrid(client_app(exp), 4))[0])
    assert all(m["rejected"] == 0 and m["clipped"] == 0 for m in honest_metrics)
    assert float((rejected - honest).norm()) < 0.5 * float(honest.norm())


def test_a_clipping_bound_equals_the_node_sending_the_update_scaled_to_the_bound():
    """x⁰ = 0: the bound is c·max(‖x‖, floor) = c·floor in round 1, c·‖x¹‖ or c·floor after."""
    exp = fedavg()
    bound = UpdateBound(2.0, floor=1.0, action="clip")
    clipped, metrics, logged = run(exp, attacked(exp), bound=bound)
    assert [m["clipped"] for m in metrics] == [1] * ROUNDS and all(m["rejected"] == 0 for m in metrics)
    assert bool(torch.isfinite(clipped).all())
    # the same rounds with the node itself sending (HUGE, …)·limit/‖(HUGE, …)‖, the limit from the current model
    strategy = FedShuffleStrategy(single_run(exp))
    grid = attacked(exp, forge=lambda a: np.full_like(a, limit / np.sqrt(a.size)))
    arrays = strategy.initial_arrays()
    for r in range(1, ROUNDS + 1):
        limit = 2.0 * max(float(strategy.half.params.norm()), 1.0)
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        arrays, _ = strategy.aggregate_train(r, grid.send_and_receive(messages))
    torch.testing.assert_close(clipped, model(arrays), rtol=1e-12, atol=1e-12)


def test_the_bound_keeps_a_model_at_zero_moving_and_measures_finite_rows_near_the_largest_float():
    bound = UpdateBound(1.0, floor=0.5, action="clip")
    rows = torch.tensor([[0.3, 0.0], [3.0, 4.0], [1e308, 1e308]], dtype=torch.float64)
    out, clipped = bound.apply(rows, torch.zeros(2, dtype=torch.float64))
    assert clipped == 2 and torch.equal(out[0], rows[0])
    torch.testing.assert_close(out[1], torch.tensor([0.3, 0.4], dtype=torch.float64), rtol=1e-15, atol=0)
    torch.testing.assert_close(out[2], torch.full((2,), 0.5 / np.sqrt(2), dtype=torch.float64), rtol=1e-15, atol=0)
    model = torch.tensor([3.0, 4.0], dtype=torch.float64)  # ‖x‖ = 5 > floor: the bound is 5
    assert UpdateBound(1.0, floor=0.5).apply(rows[:2], model)[1] == 0


def round_replies(exp, grid: FakeGrid, robust: RobustAggregation):
    """Round 1 under ``robust``: the members' Δ_i and weights ω_i the server got, and the model it took."""
    strategy = FedShuffleStrategy(single_run(exp), robust=robust)
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    rnd = strategy._open.rnd
    by_client = {int(r.content["result"]["client"]): r.content["payload"]["delta"].numpy()[0] for r in replies}
    deltas = np.stack([by_client[int(i)] for i in rnd.cohort])
    omega = np.asarray(strategy.half.method.aggregation_weights(rnd))
    x0 = strategy.half.params.numpy().copy()
    arrays, _ = strategy.aggregate_train(1, replies)
    return deltas, omega, x0, model(arrays).numpy()


@pytest.mark.parametrize("clients", [4, 5])
def test_the_median_is_numpys_coordinate_wise_median_times_the_total_weight(clients):
    exp = fedavg(clients)
    deltas, omega, x0, x1 = round_replies(exp, attacked(exp, clients=clients), RobustAggregation("median"))
    assert np.abs(deltas).max() == HUGE  # the attacker's row is among them
    np.testing.assert_allclose(x1, x0 - omega.sum() * np.median(deltas, axis=0), rtol=1e-14, atol=1e-15)
    assert np.abs(x1).max() < 10


@pytest.mark.parametrize("trim", [0.2, 0.4])
def test_the_trimmed_mean_is_numpys_weighted_mean_of_the_kept_values(trim):
    exp = fedavg(5)
    deltas, omega, x0, x1 = round_replies(exp, attacked(exp, clients=5), RobustAggregation("trimmed-mean", trim))
    k, expected = int(np.floor(trim * 5)), np.empty(deltas.shape[1])
    for j in range(deltas.shape[1]):
        order = np.argsort(deltas[:, j], kind="stable")[k : 5 - k]
        expected[j] = omega.sum() * np.sum(omega[order] * deltas[order, j]) / np.sum(omega[order])
    np.testing.assert_allclose(x1, x0 - expected, rtol=1e-14, atol=1e-15)
    assert np.abs(x1).max() < 10


def test_a_trimmed_mean_that_trims_nothing_is_the_methods_own_aggregation_exactly():
    exp = experiment([variant("fedshuffle", sampler={"name": "uniform", "cohort": 3})])  # unequal weights ω_i
    plain, _, _ = run(exp, FakeGrid(client_app(exp), 4))
    trimmed, _, _ = run(exp, FakeGrid(client_app(exp), 4), robust=RobustAggregation("trimmed-mean", 0.2))
    assert torch.equal(plain, trimmed)


@pytest.mark.parametrize(
    "name, options, key, text",
    [
        ("scaffold", dict(robust=RobustAggregation("median")), "run-config.robust-aggregation", "accepted methods: "),
        ("fedcdr", dict(robust=RobustAggregation("median")), "run-config.robust-aggregation", "fedavg, fedavg_rr"),
        (
            "fedavg",
            dict(robust=RobustAggregation("median"), secure=SecureAggregation(3, 2, 8.0, 1 << 22)),
            "run-config.robust-aggregation",
            "secure-aggregation = true the server sees only their sum",
        ),
        (
            "fedavg",
            dict(bound=UpdateBound(1.0), secure=SecureAggregation(3, 2, 8.0, 1 << 22)),
            "run-config.update-bound",
            "secure-aggregation = true the server sees only their sum",
        ),
    ],
)
def test_a_robust_aggregation_or_bound_where_it_cannot_work_is_refused_with_one_line(name, options, key, text):
    with pytest.raises(ConfigError) as info:
        FedShuffleStrategy(single_run(experiment([variant(name)])), **options)
    assert info.value.field == key and text in str(info.value) and "\n" not in str(info.value)


def test_the_averaging_methods_are_the_fedavg_family():
    assert set(averaging_methods()) >= {"fedavg", "fedprox", "fednova", "fedshuffle", "nastya"}
    assert not {"scaffold", "feddyn", "fedcdr"} & set(averaging_methods())


@pytest.mark.parametrize(
    "run_config, text",
    [
        ({"robust-aggregation": "mean"}, "unknown robust aggregation 'mean'; accepted: none, median, trimmed-mean"),
        ({"trim-fraction": 0.5}, "run-config.trim-fraction: input should be less than 0.5, got 0.5"),
        ({"update-bound": -1.0}, "run-config.update-bound: input should be greater than or equal to 0, got -1.0"),
        ({"update-bound-floor": 0}, "run-config.update-bound-floor: input should be greater than 0, got 0"),
        ({"update-bound-action": "warn"}, "accepted: reject, clip"),
    ],
)
def test_the_new_keys_are_checked_with_one_line_naming_them(run_config, text):
    with pytest.raises(ConfigError, match="run-config") as info:
        AppSettings.from_run_config(run_config)
    assert text in str(info.value) and "\n" not in str(info.value)


def test_the_run_config_builds_the_bound_and_the_aggregator():
    settings = AppSettings.from_run_config(
        {"update-bound": 3, "update-bound-action": "clip", "robust-aggregation": "trimmed-mean", "trim-fraction": 0.25}
    )
    assert UpdateBound.from_settings(settings) == UpdateBound(3.0, 1.0, "clip")
    assert RobustAggregation.from_settings(settings) == RobustAggregation("trimmed-mean", 0.25)
    assert UpdateBound.from_settings(AppSettings()) is None and RobustAggregation.from_settings(AppSettings()) is None
