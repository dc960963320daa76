"""Samplers, local planning and normalizers against their definitions."""

import itertools

import numpy as np
import pytest
import torch

from conftest import quadratic_dataset
from fedshuffle import (
    Cyclic,
    FullParticipation,
    Independent,
    LocalPlanner,
    Quadratic,
    UniformWithoutReplacement,
    WithReplacement,
    water_filling,
)
from fedshuffle.core.errors import ConfigError
from fedshuffle.local.loop import LocalWork, run_local
from fedshuffle.local.steps import standard_chain


def test_water_filling_matches_reference_example():
    """REFERENCE-NOTES §10.4: sizes (1000, 400, 50, 30, 20, 10, 5, 5, 3, 2)."""
    n = [1000, 400, 50, 30, 20, 10, 5, 5, 3, 2]
    assert np.allclose(water_filling(n, 4), [1, 1, 0.8, 0.48, 0.32, 0.16, 0.08, 0.08, 0.048, 0.032], atol=1e-15)
    q2 = water_filling(n, 2)
    assert q2[0] == 1 and q2[1] == pytest.approx(0.761904761904762) and q2.sum() == pytest.approx(2, abs=1e-14)


@pytest.mark.parametrize("b", [0.5, 1, 2.5, 7])
def test_water_filling_is_exact_and_capped(b):
    v = np.random.default_rng(3).lognormal(0, 2, size=12)
    q = water_filling(v, b)
    assert q.sum() == pytest.approx(b, abs=1e-12) and q.max() <= 1
    uncapped = q < 1
    assert np.allclose(q[uncapped] / v[uncapped], (q[uncapped] / v[uncapped])[0])


@pytest.mark.parametrize(
    "sampler",
    [
        FullParticipation(5),
        UniformWithoutReplacement(5, 2),
        WithReplacement(5, 3, [0.1, 0.2, 0.3, 0.2, 0.2]),
        WithReplacement(4, 1, np.array([3, 1, 4, 2]) / 10),
        Independent.importance([1, 2, 3, 4, 10], 2),
        Cyclic(6, 2, "reshuffle"),
        Cyclic(6, 3, "fixed"),
    ],
    ids=lambda s: type(s).__name__,
)
def test_distribution_matches_inclusion_probabilities_and_sampling(sampler):
    dist = sampler.distribution()
    assert sum(p for p, _ in dist) == pytest.approx(1.0)
    n = sampler.num_clients
    p_inc = np.zeros(n)
    counts = np.zeros(n)
    for prob, cohort in dist:
        p_inc[list(set(cohort))] += prob
        np.add.at(counts, list(cohort), prob)
    assert np.allclose(p_inc, sampler.inclusion_probabilities())
    assert np.allclose(counts, sampler.expected_counts())
    empirical = np.zeros(n)
    rounds = 6000
    for r in range(rounds):
        np.add.at(empirical, sampler.sample(r, seed=5), 1)
    assert np.allclose(empirical / rounds, sampler.expected_counts(), atol=0.03)


def test_cyclic_visits_every_client_once_per_meta_epoch():
    sampler = Cyclic(12, 3, "reshuffle")
    for meta in range(3):
        seen = np.concatenate([sampler.sample(meta * 4 + k, seed=1) for k in range(4)])
        assert sorted(seen) == list(range(12))
    first = [sampler.sample(k, 1) for k in range(4)]
    second = [sampler.sample(4 + k, 1) for k in range(4)]
    assert any(not np.array_equal(a, b) for a, b in zip(first, second))
    once = Cyclic(12, 3, "shuffle_once")
    assert all(np.array_equal(once.sample(k, 1), once.sample(k + 4, 1)) for k in range(4))


def test_cyclic_requires_divisible_cohort():
    with pytest.raises(ConfigError, match="divide"):
        Cyclic(10, 3)


def test_rr_epochs_are_permutations_and_so_repeats_one():
    clients = [np.arange(0, 5), np.arange(5, 12)]
    for order in ("reshuffle", "shuffle_once"):
        plan = LocalPlanner(lr=0.1, epochs=3, order=order, batch_size=2).plan(clients, np.array([1]), 0, seed=2)[0]
        assert plan.steps == 3 * 4 and plan.batches.shape == (12, 2)
        epochs = plan.batches.reshape(3, 8)
        for e in epochs:
            assert sorted(e[e >= 0]) == list(range(5, 12))
        same = all(np.array_equal(epochs[0], e) for e in epochs)
        assert same == (order == "shuffle_once")


@pytest.mark.parametrize("size, order", [(921, "shuffle_once"), (409, "reshuffle"), (265, "shuffle_once")])
def test_epoch_batches_give_exactly_k_steps_that_cover_one_pass(size, order):
    """RR-CLI §4.5: 100 local steps on ≈1 % of the local data, every sample once per pass (phishing, w3a, a3a
    splits)."""
    clients = [np.arange(size) + 7]
    plan = LocalPlanner(lr=0.1, epochs=2, order=order, epoch_batches=100).plan(clients, np.array([0]), 0, seed=1)[0]
    assert plan.steps == 200 and plan.sample_gradients == 2 * size
    counts = (plan.batches >= 0).sum(1)
    assert set(counts.tolist()) <= {size // 100, -(-size // 100)} and counts[:100].sum() == size
    for epoch in (plan.batches[:100], plan.batches[100:]):
        assert np.array_equal(np.sort(epoch[epoch >= 0]), clients[0])
    with pytest.raises(ConfigError, match="epoch_batches"):
        LocalPlanner(lr=0.1, epoch_batches=100).plan([np.arange(50)], np.array([0]), 0, seed=1)


def test_random_epochs_are_within_range_and_cover_it():
    solver = LocalPlanner(lr=0.1, epochs=(2, 5))
    draws = {solver.draw_epochs(0, r, seed=1) for r in range(200)}
    assert draws == {2, 3, 4, 5}


@pytest.mark.parametrize("momentum, prox", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.0), (0.0, 0.5)])
def test_a_norm_matches_accumulated_coefficients(momentum, prox):
    """‖a‖₁ closed forms (REFERENCE-NOTES §1 and §10.1b) against running the local solver on a linear model."""
    tau, lr = 5, 0.1
    data = quadratic_dataset([1])
    solver = LocalPlanner(lr=lr, epochs=tau, momentum=momentum, prox_mu=prox / lr)
    plan = solver.plan(data.client_indices, np.array([0]), 0, 0)[0]

    # a constant-gradient problem: Δ = η Σ a_k g with g = x − e at x (zero-Hessian part removed by a tiny target step)
    class Linear(Quadratic):
        def batched_gradient(self, params, features, labels, weights):
            return torch.ones_like(params)

    delta = run_local(
        Linear(1), data.features, data.labels, LocalWork([plan], torch.zeros(1, dtype=torch.float64), solver.chain())
    )[0]
    closed = (
        (tau - momentum * (1 - momentum**tau) / (1 - momentum)) / (1 - momentum)
        if momentum
        else (1 - (1 - prox) ** tau) / prox
        if prox
        else tau
    )
    assert plan.a_l1 == pytest.approx(closed)
    assert float(delta) / lr == pytest.approx(plan.a_l1, rel=1e-12)
    if (momentum, prox) == (0.9, 0.0):
        assert plan.a_l1 == pytest.approx(13.1441, rel=1e-6)
    if (momentum, prox) == (0.0, 0.5):
        assert plan.a_l1 == pytest.approx((1 - 0.5**5) / 0.5)


def test_unfinished_work_truncates_plans():
    clients = [np.arange(4)]
    assert LocalPlanner(lr=0.1, drop_last_steps=1).plan(clients, np.array([0]), 0, 0)[0].steps == 3
    assert LocalPlanner(lr=0.1, drop_last_steps=10).plan(clients, np.array([0]), 0, 0)[0].steps == 1
    stragglers = [
        LocalPlanner(lr=0.1, straggler_probability=1.0).plan(clients, np.array([0]), r, 0)[0].steps for r in range(100)
    ]
    assert set(stragglers) == {1, 2, 3, 4}


def test_clipping_and_weight_decay_follow_their_definitions():
    data = quadratic_dataset([1], np.array([[10.0, 0.0]]))
    plan = LocalPlanner(lr=0.5, epochs=1).plan(data.client_indices, np.array([0]), 0, 0)[0]
    x = torch.tensor([0.0, 1.0], dtype=torch.float64)
    delta = run_local(
        Quadratic(2), data.features, data.labels, LocalWork([plan], x, standard_chain(weight_decay=0.1, clip_norm=1.0))
    )[0]
    g = x - data.features[0]
    expected = 0.5 * (g / g.norm() + 0.1 * x)
    assert torch.allclose(delta, expected)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"lr": -1}, "lr"),
        ({"lr": 0.1, "order": "random"}, "order"),
        ({"lr": 0.1, "epochs": (3, 2)}, "epochs"),
        ({"lr": 0.1, "momentum": 0.9, "prox_mu": 0.1}, "momentum"),
        ({"lr": 0.1, "steps": "median"}, "steps"),
    ],
)
def test_local_solver_rejects_bad_settings(kwargs, field):
    with pytest.raises(ConfigError) as info:
        LocalPlanner(**kwargs)
    assert info.value.field == field


def test_executor_independence_of_streams():
    """Plans depend only on (seed, round, client): planning a client alone or within a cohort gives the same batches."""
    clients = [np.arange(0, 4), np.arange(4, 10), np.arange(10, 13)]
    solver = LocalPlanner(lr=0.1, epochs=(1, 3), order="reshuffle")
    together = solver.plan(clients, np.array([0, 1, 2]), 7, seed=3)
    for i, plan in enumerate(together):
        alone = solver.plan(clients, np.array([i]), 7, seed=3)[0]
        assert np.array_equal(alone.batches, plan.batches)
    assert any(
        not np.array_equal(a.batches, b.batches)
        for a, b in itertools.pairwise([together[0], solver.plan(clients, np.array([0]), 8, seed=3)[0]])
    )


def test_a_cohort_plan_is_its_members_plans_and_selects_joins_and_pickles_them_without_mixing_rows():
    """The planner's columns read back as the members' own plans (rows, η_i, ‖a_i‖₁, key), also where a short batch is
    padded, a member stops early or a client is drawn twice; take, joined and a pickle keep each member's rows."""
    import pickle

    from fedshuffle.local.plan import ClientPlan, CohortPlan

    clients = [np.arange(0, 7), np.arange(7, 10), np.arange(10, 22)]
    cohort = np.array([2, 0, 2, 1])
    for settings in (
        {"batch_size": 1},
        {"batch_size": 5, "epochs": 2, "straggler_probability": 0.7},
        {"epoch_batches": 3, "momentum": 0.5},
    ):
        plans = LocalPlanner(lr=0.1, **settings).plan(clients, cohort, 4, seed=9)
        members = [plans[c] for c in range(len(plans))]
        assert [p.key for p in members] == [(9, 4, 2, 0), (9, 4, 0, 0), (9, 4, 2, 1), (9, 4, 1, 0)]
        assert not np.array_equal(members[0].batches, members[2].batches)  # a client drawn twice: two independent runs
        rebuilt = CohortPlan.of(members)
        assert plans.sample_gradients == rebuilt.sample_gradients == sum(p.sample_gradients for p in members)
        for columns in (
            rebuilt,
            pickle.loads(pickle.dumps(plans.take([3, 0]))),
            CohortPlan.joined([plans.take([3]), members[:1]]),
            plans[::3][::-1],
        ):
            picked = [members[3], members[0]] if len(columns) == 2 else members
            for got, want in zip(columns, picked, strict=True):
                assert np.array_equal(got.batches, want.batches) and got.key == want.key
                assert (got.client, got.lr, got.planned_steps, got.a_l1, got.steps) == (
                    want.client,
                    want.lr,
                    want.planned_steps,
                    want.a_l1,
                    want.steps,
                )
        assert len(pickle.dumps(plans.take([1]))) < len(pickle.dumps(plans))  # a worker gets its own members' rows only
    # plans made by hand keep their clients whatever their keys; a seed past 64 bits stays in the keys exactly
    by_hand = CohortPlan.of(
        [
            ClientPlan(5, np.zeros((2, 1), dtype=np.int64), 0.1, 2, 2.0),
            ClientPlan(2, np.ones((2, 1), dtype=np.int64), 0.1, 2, 2.0),
        ]
    )
    assert by_hand.clients.tolist() == [5, 2] and [p.client for p in by_hand] == [5, 2]
    huge = LocalPlanner(lr=0.1).plan(clients, cohort, 4, seed=2**64 + 5)
    assert [p.key for p in huge][2] == (2**64 + 5, 4, 2, 1) and huge.clients.tolist() == cohort.tolist()


def test_runs_that_differ_in_step_sizes_share_each_rounds_draws():
    """SharedDraws: a planner of another η_l (and so another ‖a_i‖₁ under a proximal term) plans from the rows another
    made for the same seed, round and cohort — the same plans as its own, the rows read-only and not copied; another
    seed, round, cohort or drawing setting draws its own; only the newest rounds are kept."""
    from fedshuffle.local.plan import SharedDraws

    clients = [np.arange(0, 7), np.arange(7, 10), np.arange(10, 22)]
    cohort = np.array([2, 0, 2])
    shared = SharedDraws()
    settings = {"batch_size": 2, "epochs": (1, 3), "straggler_probability": 0.5, "prox_mu": 0.5}
    first = LocalPlanner(lr=0.1, **settings).plan(clients, cohort, 4, 9, shared=shared)
    for lr, scale in ((0.3, 1.0), (0.1, 0.5)):
        own, reused = (
            LocalPlanner(lr=lr, **settings).plan(clients, cohort, 4, 9, scale, shared=s) for s in (None, shared)
        )
        assert reused.rows is first.rows and not reused.rows.flags.writeable
        for column in ("clients", "rows", "row_starts", "steps", "widths", "lrs", "planned_steps", "a_l1", "keys"):
            assert np.array_equal(getattr(own, column), getattr(reused, column)), column
        assert not np.array_equal(reused.lrs, first.lrs) and not np.array_equal(reused.a_l1, first.a_l1)
    others = [
        LocalPlanner(lr=0.1, **settings).plan(clients, cohort, 4, 10, shared=shared),
        LocalPlanner(lr=0.1, **settings).plan(clients, cohort, 5, 9, shared=shared),
        LocalPlanner(lr=0.1, **settings).plan(clients, cohort[:2], 4, 9, shared=shared),
        LocalPlanner(lr=0.1, **{**settings, "batch_size": 3}).plan(clients, cohort, 4, 9, shared=shared),
    ]
    assert all(other.rows is not first.rows for other in others)
    LocalPlanner(lr=0.1, **settings).plan(clients, cohort, 6, 9, shared=shared)
    assert (
        LocalPlanner(lr=0.1, **settings).plan(clients, cohort, 4, 9, shared=shared).rows is not first.rows
    )  # round 4 is gone once round 6 is drawn


def test_batched_generators_are_the_keyed_generators():
    """streams.generators (SeedSequence hash vectorized, PCG64 seeded by hand) draws what streams.generator draws,
    key by key — also for keys beyond one 32-bit word and for seeds past 2³¹."""
    from fedshuffle.core.streams import Stream, generator, generators

    rng = np.random.default_rng(0)
    keys = np.concatenate([rng.integers(0, 2**32, (40, 2)), rng.integers(0, 3, (40, 1))], axis=1)
    keys[0] = 0
    for seed, rows in ((0, keys), (2**31 + 7, keys), (5, keys[:, :1]), (1, np.array([[2**40, 1, 0]]))):
        for g, row in zip(generators(seed, Stream.DATA_ORDER, rows), rows.tolist(), strict=True):
            assert np.array_equal(g.permutation(30), generator(seed, Stream.DATA_ORDER, *row).permutation(30))


def test_batched_permutations_are_the_keyed_generators_permutations(monkeypatch):
    """streams.permutations (PCG64 and NumPy's shuffle compiled) gives each key's generator's successive permutations —
    lengths 1 to past 2¹⁶ (masks of several widths), repeats carrying the 32-bit buffer, keys past one word — and the
    same numbers when it falls back to the generators (no numba, or a NumPy whose shuffle it does not reproduce)."""
    from fedshuffle.core import streams
    from fedshuffle.core.streams import Stream, generator, permutations

    rng = np.random.default_rng(1)
    keys = np.concatenate([rng.integers(0, 2**32, (25, 2)), rng.integers(0, 3, (25, 1))], axis=1)
    lengths = np.concatenate([[1, 2, 3, 70_000], rng.integers(1, 600, 21)])
    repeats = rng.integers(1, 4, 25)
    for seed, rows in ((3, keys), (2**33, keys[:3]), (0, np.array([[2**40, 1, 0]]))):
        expected = np.concatenate(
            [
                g.permutation(n)
                for g, n, r in zip(
                    (generator(seed, Stream.DATA_ORDER, *k) for k in rows.tolist()), lengths.tolist(), repeats.tolist()
                )
                for _ in range(r)
            ]
        )
        for compiled in (True, False):
            monkeypatch.setattr(streams, "_COMPILED_AGREES", compiled and streams._compiled_shuffles is not None)
            got = permutations(seed, Stream.DATA_ORDER, rows, lengths[: len(rows)], repeats[: len(rows)])
            assert got.dtype == np.int64 and np.array_equal(got, expected)
    if streams._compiled_shuffles is not None:
        assert streams._agrees_with_numpy()
    with pytest.raises(ValueError, match="non-negative"):  # as the generators refuse them, on either path
        permutations(-1, Stream.DATA_ORDER, keys[:1], lengths[:1], repeats[:1])


def test_the_planners_population_scan_is_kept_per_sizes_array_and_never_pickled():
    """τ_max = max epochs · max_j ⌈|D_j|/B⌉ is scanned once per population (planning a round is O(cohort)); another
    sizes
    array is scanned afresh, and a pickled planner (sent to workers) carries no population."""
    import pickle

    planner = LocalPlanner(lr=0.1, epochs=(1, 3), batch_size=4)
    sizes = np.arange(1, 100_001)
    assert planner.max_planned_steps(sizes) == 3 * 25_000
    assert planner.max_planned_steps(sizes) == 3 * 25_000
    assert planner.max_planned_steps(np.array([1, 2, 9])) == 3 * 3
    assert len(pickle.dumps(planner)) < 8_000
    assert (
        pickle.loads(pickle.dumps(planner)) == planner
        and pickle.loads(pickle.dumps(planner)).max_planned_steps(sizes) == 75_000
    )
