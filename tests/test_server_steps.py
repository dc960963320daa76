"""Server step sizes (Nastya, RR-CLI, generalized FedAvg): equivalences, closed forms, theory."""

import math

import numpy as np
import pytest
import torch

from fedshuffle import (
    Cyclic,
    FullParticipation,
    LogisticRegression,
    Quadratic,
    Simulation,
    SoftmaxRegression,
    UniformWithoutReplacement,
    WithReplacement,
)
from fedshuffle.analysis.objective import inspect_objective
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.experiments.build import build_algorithm_from, build_problem_and_data, build_sampler, resolve_step_sizes
from fedshuffle.data import FederatedDataset, equal_partition, objective_weights
from fedshuffle.core.errors import ConfigError
from fedshuffle.schedules import SCHEDULES, Schedule
from fedshuffle.analysis.theory import smoothness
from fedshuffle.problems.solution import solution

from conftest import assert_relative_close, params_trajectory, quadratic_dataset, build_flat, nested

CLIENTS, PER_CLIENT, DIM = 12, 20, 5


def logistic_data(seed=0, l2=1e-2):
    """12 equal clients of a heterogeneous logistic-regression problem (labels from client-shifted planes)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(CLIENTS * PER_CLIENT, DIM)) + np.repeat(rng.normal(size=(CLIENTS, DIM)), PER_CLIENT, axis=0)
    y = (x @ rng.normal(size=DIM) + rng.normal(size=len(x)) > 0).astype(float) * 2 - 1
    parts = equal_partition(len(y), CLIENTS, rng)
    data = FederatedDataset(
        torch.tensor(x), torch.tensor(y), parts, objective_weights(np.full(CLIENTS, PER_CLIENT), "size")
    )
    return LogisticRegression(DIM, l2), data


def trajectory(name, settings, sampler, rounds=24, seed=3):
    problem, data = logistic_data()
    return params_trajectory(Simulation(problem, data, build_flat(name, settings), sampler, seed=seed), rounds)


def assert_same(a, b, rtol=1e-12):
    assert_relative_close(a, b, rtol)


# -- equivalences ---------------------------------------------------------------------------------

GAMMA, BATCH = 0.05, 4  # 5 local steps of 4 samples per pass


@pytest.mark.parametrize("order", ["reshuffle", "shuffle_once"])
def test_nastya_with_server_step_gamma_n_is_fedavg(order):
    """Nastya §5.1: with η = γN, x − η·(1/C)Σ(x − y_i)/(γN) is the cohort's model average."""
    steps = PER_CLIENT // BATCH
    local = {"lr": GAMMA, "order": order, "batch_size": BATCH}
    nastya = trajectory("nastya", {**local, "server_lr": GAMMA * steps}, UniformWithoutReplacement(CLIENTS, 3))
    fedavg = trajectory("fedavg_rr", local, UniformWithoutReplacement(CLIENTS, 3))
    assert_same(nastya, fedavg)
    different = trajectory("nastya", {**local, "server_lr": 2 * GAMMA * steps}, UniformWithoutReplacement(CLIENTS, 3))
    assert float((different - fedavg).abs().max()) > 1e-3  # the server step matters


@pytest.mark.parametrize("client_order", ["reshuffle", "shuffle_once", "fixed"])
@pytest.mark.parametrize("data_order", ["reshuffle", "shuffle_once"])
def test_rr_cli_with_theorem_steps_is_cyclic_fedavg(client_order, data_order):
    """RR-CLI §3: η = γN and θ = ηR make every round a model average and the meta-epoch step the identity."""
    steps, rounds = PER_CLIENT // BATCH, CLIENTS // 3
    local = {"lr": GAMMA, "order": data_order, "batch_size": BATCH}
    eta = GAMMA * steps
    rr_cli = trajectory(
        "rr_cli", {**local, "server_lr": eta, "global_lr": eta * rounds}, Cyclic(CLIENTS, 3, client_order)
    )
    fedavg = trajectory("fedavg_rr", local, Cyclic(CLIENTS, 3, client_order))
    assert_same(rr_cli, fedavg)


def test_rr_cli_global_step_extrapolates_the_meta_epoch():
    """x_{t+1} = x_t − θ(x_t − x_t^R)/(ηR), checked against the plain meta-epoch's end point."""
    rounds, eta = CLIENTS // 3, 0.5
    local = {"lr": GAMMA, "batch_size": BATCH, "server_lr": eta}
    sampler = Cyclic(CLIENTS, 3, "shuffle_once")
    plain = trajectory("rr_cli", local, sampler, rounds=rounds)  # θ defaults to ηR
    theta = 3.0
    extrapolated = trajectory("rr_cli", {**local, "global_lr": theta}, sampler, rounds=rounds)
    x0 = torch.zeros(DIM, dtype=torch.float64)
    expected = x0 - theta / (eta * rounds) * (x0 - plain[-1])
    assert_same(extrapolated[-1], expected)
    assert_same(extrapolated[:-1], plain[:-1])  # inside the meta-epoch nothing changes


def test_rr_cli_needs_cyclic_cohorts():
    problem, data = logistic_data()
    with pytest.raises(ConfigError) as err:
        Simulation(problem, data, build_flat("rr_cli", {"lr": 0.1}), UniformWithoutReplacement(CLIENTS, 3))
    assert err.value.field == "sampler.name" and "cyclic" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_flat("nastya", {"lr": 0.1, "global_lr": 2.0})
    assert err.value.field == "server.global_lr"


# -- generalized FedAvg (Yang et al.): sampling strategies --------------------------------------------------


@pytest.mark.parametrize("strategy", ["with_replacement", "without_replacement"])
def test_generalized_fedavg_is_yang_et_al_uniform_average_and_unbiased_by_enumeration(strategy):
    """Yang, Fang & Liu (ICLR 2021), Algorithm 1 with p_i = 1/m: Δ = (1/n) Σ_{i∈S} Δ_i under both sampling
    strategies, whatever the clients' sizes, so E[Σ_{i∈S} ω_iΔ_i] = (1/m) Σ_i Δ_i — their objective (1/m) Σ F_i."""
    sizes = np.array([1, 2, 3, 6])
    w = objective_weights(sizes, "size")
    sampler = WithReplacement(4, 2) if strategy == "with_replacement" else UniformWithoutReplacement(4, 2)
    alg = build_flat("generalized_fedavg", {"lr": 0.1, "steps": 3, "server_lr": 2.0})
    report = inspect_objective(alg, sampler, sizes, w, exact=True)
    assert report.exact
    np.testing.assert_allclose(report.expected_aggregation_weights, np.full(4, 0.25), rtol=0, atol=1e-15)
    for cohort in (
        (np.array([3, 3]), np.array([0, 3])) if strategy == "with_replacement" else (np.array([0, 3]), np.array([1, 2]))
    ):
        plans = alg.local.plan([np.arange(s) for s in sizes], cohort, 0, 0)
        omega = alg.aggregator.weights(plans, w, sampler.expected_counts(), alg.local.lr, None)
        np.testing.assert_allclose(omega, [0.5, 0.5], rtol=1e-15)


def test_li_et_al_unbiased_weights_are_kept_as_an_option():
    """With ``weighting = "data"`` the same method aggregates (m/n)·w_i (Li et al. 2020's scheme), unbiased for f =
    Σ w_i f_i."""
    sizes = np.array([1, 2, 3, 6])
    w = objective_weights(sizes, "size")
    sampler = UniformWithoutReplacement(4, 2)
    alg = build_flat("generalized_fedavg", {"lr": 0.1, "steps": 3, "weighting": "data"})
    np.testing.assert_allclose(
        inspect_objective(alg, sampler, sizes, w, exact=True).expected_aggregation_weights, w, rtol=0, atol=1e-15
    )
    plans = alg.local.plan([np.arange(s) for s in sizes], np.array([1, 3]), 0, 0)
    np.testing.assert_allclose(
        alg.aggregator.weights(plans, w, sampler.expected_counts(), alg.local.lr, None), 2 * w[[1, 3]], rtol=1e-15
    )


def test_sum_one_with_replacement_is_biased_where_unbiased_is_not():
    sizes = np.array([1, 2, 3, 6])
    w = objective_weights(sizes, "size")
    sampler = WithReplacement(4, 2)  # uniform probabilities, unequal weights
    fedavg = inspect_objective(build_flat("fedavg", {"lr": 0.1, "steps": 3}), sampler, sizes, w, exact=True)
    assert fedavg.max_deviation > 0.01


# -- server optimizers and schedules ------------------------------------------------------------------


def test_adgd_on_the_server_takes_steps_of_at_least_one_over_2l():
    """Single node (Nastya §8): with one full-batch local step Nastya sends g = ∇f(x) exactly, so the
    server runs AdGD itself, whose steps stay ≥ 1/(2L) (Malitsky & Mishchenko 2020) and converge."""
    problem, data = logistic_data(l2=0.05)
    one = FederatedDataset(data.features, data.labels, [np.arange(data.num_samples)], np.ones(1))
    L = smoothness(problem, one).global_
    _, f_star = solution(problem, one)
    alg = build_flat(
        "nastya", {"lr": 1e-3, "server_optimizer": "adgd", "server_lr": 1e-3, "batch_size": data.num_samples}
    )
    sim = Simulation(problem, one, alg, FullParticipation(1))
    steps, gaps = [], []
    for _ in range(80):
        sim.step()
        steps.append(float(sim.server_state["lr"]))
        gaps.append(float(problem.weighted_loss(sim.params, one.features, one.labels, one.sample_weights())) - f_star)
    informative = [lam for lam, gap in zip(steps[1:], gaps) if gap > 1e-12]  # before round-off dominates ∇f differences
    assert len(informative) > 10 and min(informative) >= 1 / (2 * L)
    assert max(steps) > 1 / L  # AdGD exceeds 1/L where the local curvature allows it
    assert gaps[-1] < 1e-12


def test_schedules():
    assert Schedule("inverse_epochs")(7, 2.5) == pytest.approx(1 / 3)
    step = Schedule("step", (0.5, 0.75), 0.1, total_rounds=100)
    assert [step(r, 0) for r in (0, 49, 50, 74, 75, 99)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    with pytest.raises(ConfigError, match="decay_at"):  # declared by the step schedule: increasing fractions
        SCHEDULES["step"].build({"decay_at": [0.8, 0.5]}, total_rounds=10)
    with pytest.raises(ConfigError, match="decay_at: schedule 'step' needs it"):
        SCHEDULES["step"].build({}, total_rounds=10)
    with pytest.raises(
        ConfigError, match="decay_factor: not a setting of schedule 'constant'"
    ):  # the constant schedule takes none
        SCHEDULES["constant"].build({"decay_factor": 0.5}, total_rounds=10)


def test_inverse_epoch_schedule_scales_local_and_server_steps():
    """One client with one sample: x_{r+1} = x_r − η_r·γ_r·(x_r − e) with γ_r, η_r ∝ 1/(1 + r)."""
    data = quadratic_dataset([1], np.array([[1.0, -1.0]]))
    gamma, eta = 0.3, 0.5
    sim = Simulation(
        Quadratic(2),
        data,
        build_flat("fedavg_rr", {"lr": gamma, "server_lr": eta, "schedule_name": "inverse_epochs"}),
        FullParticipation(1),
    )
    x, e = np.zeros(2), np.array([1.0, -1.0])
    for r in range(6):
        sim.step()
        x = x - eta / (1 + r) * gamma / (1 + r) * (x - e)
        np.testing.assert_allclose(sim.params.numpy(), x, rtol=1e-14)


# -- theory ---------------------------------------------------------------------------------------------


def test_logistic_smoothness_constants_equal_the_hessian_at_zero_and_bound_it_elsewhere():
    problem, data = logistic_data()
    c = smoothness(problem, data)
    s = data.sample_weights()
    hess = lambda x, X, Y, w: torch.func.hessian(lambda z: problem.weighted_loss(z, X, Y, w))(x)  # noqa: E731
    top = lambda h: float(torch.linalg.eigvalsh(h)[-1])  # noqa: E731
    zero = torch.zeros(DIM, dtype=torch.float64)
    assert top(hess(zero, data.features, data.labels, s)) == pytest.approx(c.global_, rel=1e-12)
    for m, ix in enumerate(data.client_indices):
        ix = torch.as_tensor(ix)
        w = torch.full((len(ix),), 1 / len(ix), dtype=torch.float64)
        assert top(hess(zero, data.features[ix], data.labels[ix], w)) == pytest.approx(c.clients[m], rel=1e-12)
    per_sample = max(
        top(hess(zero, data.features[j : j + 1], data.labels[j : j + 1], torch.ones(1, dtype=torch.float64)))
        for j in range(data.num_samples)
    )
    assert per_sample == pytest.approx(c.sample_max, rel=1e-12)
    x = torch.randn(DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    h = hess(x, data.features, data.labels, s)
    eig = torch.linalg.eigvalsh(h)
    assert c.mu <= float(eig[0]) and float(eig[-1]) <= c.global_
    assert c.mu == problem.l2


def spec_for(dataset, **algorithm):
    return validate(
        RunSpec,
        {
            "problem": {"name": "logistic", "l2": 5e-4},
            "data": {
                "source": "libsvm",
                "dataset": dataset,
                "partition": "equal",
                "clients": 12,
                "weights": "uniform",
                "seed": 0,
            },
            **nested({"batch_size": 93, **{k: v for k, v in algorithm.items() if k != "name"}}),
            "method": {"name": algorithm["name"]},
            "sampler": {"name": "cyclic", "cohort": 3},
        },
    )


def test_phishing_split_solution_and_theory_steps(shared_data, monkeypatch):
    monkeypatch.setenv("FEDSHUFFLE_DATA", str(shared_data))
    spec = spec_for("phishing", name="rr_cli", lr="theory", server_lr="theory", global_lr="theory", lr_multiplier=5)
    problem, data = build_problem_and_data(spec)
    assert data.num_clients == 12 and set(data.sizes) == {11055 // 12}  # RR-CLI §4.2: ⌊|D|/M⌋ each
    x_star, _ = solution(problem, data)
    grad = problem.weighted_gradient(x_star, data.features, data.labels, data.sample_weights())
    assert float(grad.norm()) <= 1e-14
    sampler = build_sampler(spec.sampler, data)
    resolved, info = resolve_step_sizes(spec, problem, data, sampler)
    L = info["constants"]["L_sample_max"]
    assert L == pytest.approx(
        30 * 0.18257**2 / 4 + 5e-4, rel=1e-12
    )  # each row: 30 values of 0.18257 ≈ 1/√30, L_j = ‖a_j‖²/4 + λ
    assert info["local_steps"] == 10 and info["rounds_per_meta_epoch"] == 4
    # Theorem C.1's η = γN and θ = ηR, computed from the tuned γ = 5/L
    assert (
        resolved.local.lr == pytest.approx(1 / L)
        and resolved.server.lr == pytest.approx(50 / L)
        and resolved.server.global_lr == pytest.approx(200 / L)
    )
    assert (
        info["theory"] == pytest.approx({"lr": 1 / L, "server_lr": 10 / L, "global_lr": 40 / L})
        and info["rule"] == "rr_cli_c1"
    )
    alg = build_algorithm_from(resolved)
    assert alg.local.lr == pytest.approx(5 / L) and alg.server.lr == pytest.approx(50 / L)


def test_theory_step_sizes_are_refused_where_no_theorem_applies():
    problem, data = logistic_data()
    spec = validate(RunSpec, {"method": {"name": "fedshuffle"}, "local": {"lr": "theory"}})
    with pytest.raises(ConfigError, match="no theoretical step size for 'fedshuffle'"):
        resolve_step_sizes(spec, problem, data, FullParticipation(CLIENTS))
    with pytest.raises(ConfigError, match="resolve_step_sizes"):
        build_algorithm_from(spec)
    with pytest.raises(ConfigError) as err:
        validate(RunSpec, {"method": {"name": "nastya"}, "local": {"lr": -1.0}})
    assert "local.lr" in str(err.value)
    softmax = SoftmaxRegression(
        DIM, 2, 1e-2
    )  # a theorem applies to rr_cli, but softmax regression has no known constants
    for settings, field in (
        ({"local": {"lr": "theory"}}, "local.lr"),
        ({"local": {"lr": 0.1}, "server": {"lr": "theory"}}, "server.lr"),
    ):
        with pytest.raises(ConfigError) as err:
            resolve_step_sizes(
                validate(RunSpec, {"method": {"name": "rr_cli"}, **settings}), softmax, data, FullParticipation(CLIENTS)
            )
        assert (
            err.value.field == field
            and "smoothness constants" in err.value.message
            and "'softmax'" in err.value.message
        )


def test_nastya_theory_matches_the_stated_formula():
    problem, data = logistic_data()
    spec = validate(
        RunSpec,
        {"method": {"name": "nastya"}, "local": {"lr": "theory", "batch_size": BATCH}, "server": {"lr": "theory"}},
    )
    resolved, info = resolve_step_sizes(spec, problem, data, UniformWithoutReplacement(CLIENTS, 3))
    c = smoothness(problem, data)
    assert resolved.server.lr == pytest.approx(1 / (4 * c.sample_max))
    assert resolved.local.lr == pytest.approx(
        1 / (8 * (PER_CLIENT // BATCH) * c.sample_max * math.sqrt(c.sample_max / c.mu))
    )


@pytest.mark.parametrize("weighting", ["uniform", "data"])
def test_nastya_server_step_on_unequal_clients_matches_a_hand_computation(weighting):
    """Algorithm 1 with client sizes (3, 1, 4, 2), 2 of 4 clients, one pass of single-sample steps:
    x⁺ = x − η·(1/C)Σ_{m∈S} g_m, g_m = (x − y_m)/(γN_m) (the paper's mean); ``data`` gives Σ_S (w_m/p_m) g_m."""
    sizes = [3, 1, 4, 2]
    rng = np.random.default_rng(7)
    targets = np.repeat(rng.normal(size=(4, 2)), sizes, axis=0)  # one target per client: the pass is order-free
    parts = np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1])
    data = FederatedDataset(
        torch.tensor(targets), torch.zeros(sum(sizes)), parts, objective_weights(np.array(sizes), "size")
    )
    gamma, eta = 0.1, 0.7
    alg = build_flat(
        "nastya", {"lr": gamma, "batch_size": 1, "order": "reshuffle", "server_lr": eta, "weighting": weighting}
    )
    sim = Simulation(Quadratic(2), data, alg, UniformWithoutReplacement(4, 2), seed=1)
    for _ in range(3):
        x = sim.params.clone()
        record = sim.step()
        step = torch.zeros(2, dtype=torch.float64)
        for m in record.cohort:  # ½‖y − a_j‖² per sample: y ← y − γ(y − a_j)
            y = x.clone()
            for j in parts[m]:
                y = y - gamma * (y - torch.tensor(targets[j]))
            g = (x - y) / (gamma * sizes[m])
            step += g / 2 if weighting == "uniform" else (sizes[m] / sum(sizes)) / (2 / 4) * g
        torch.testing.assert_close(sim.params, x - eta * step, rtol=0, atol=1e-13)


def theory_spec(method, multiplier=1.0, lr="theory", **server):
    """A spec on :func:`logistic_data`'s 12 clients (5 steps of 4 samples per pass), 'theory' server steps."""
    server = {"lr": "theory", **({"global_lr": "theory"} if method == "rr_cli" else {}), **server}
    return validate(
        RunSpec,
        {
            "method": {"name": method},
            "local": {"lr": lr, "batch_size": BATCH, "lr_multiplier": multiplier},
            "server": server,
        },
    )


@pytest.mark.parametrize("multiplier", [1, 2, 15])
def test_tuned_rr_cli_server_and_meta_epoch_steps_follow_the_tuned_local_step(multiplier):
    """RR-CLI Theorem C.1: γ = m/L_max, η = γN, θ = ηR with N = 20/4 = 5 local steps, R = 12/3 = 4 rounds."""
    problem, data = logistic_data()
    sampler = Cyclic(CLIENTS, 3)
    L, N, R = smoothness(problem, data).sample_max, PER_CLIENT // BATCH, 4
    resolved, info = resolve_step_sizes(theory_spec("rr_cli", multiplier), problem, data, sampler)
    alg = build_algorithm_from(resolved)
    gamma = multiplier / L
    assert alg.local.lr == pytest.approx(gamma, rel=1e-14)
    assert alg.server.lr == pytest.approx(gamma * N, rel=1e-14)
    assert alg.server_for(sampler).global_lr == pytest.approx(gamma * N * R, rel=1e-14)
    assert info["follows"] == "local" and info["used"]["server_lr"] == pytest.approx(gamma * N, rel=1e-14)
    # the old reading: the multiplier scales γ alone
    fixed, _ = resolve_step_sizes(theory_spec("rr_cli", multiplier, theory_follows="fixed"), problem, data, sampler)
    assert (fixed.server.lr, fixed.server.global_lr) == pytest.approx((N / L, N * R / L), rel=1e-14)
    # a number for γ: the relations use it (× multiplier)
    given, _ = resolve_step_sizes(theory_spec("rr_cli", multiplier, lr=0.03), problem, data, sampler)
    assert (given.server.lr, given.server.global_lr) == pytest.approx(
        (0.03 * multiplier * N, 0.03 * multiplier * N * R), rel=1e-14
    )


def test_tuned_rr_cli_with_following_steps_averages_the_cohort_and_differs_from_the_fixed_reading():
    """With η = γN every round ends at the cohort's model average (RR-CLI §3), whatever the multiplier: RR-CLI ×3
    equals plain averaging (FedAvg over cyclic cohorts) at γ = 3/L; the fixed reading does not move as far."""
    problem, data = logistic_data()
    L = smoothness(problem, data).sample_max
    runs = {}
    for follows in ("local", "fixed"):
        resolved, _ = resolve_step_sizes(
            theory_spec("rr_cli", 3, theory_follows=follows), problem, data, Cyclic(CLIENTS, 3)
        )
        runs[follows] = params_trajectory(
            Simulation(problem, data, build_algorithm_from(resolved), Cyclic(CLIENTS, 3), seed=3), 8
        )
    averaging = params_trajectory(
        Simulation(
            problem,
            data,
            build_flat(
                "fedavg_rr", {"lr": 3 / L, "batch_size": BATCH, "order": "shuffle_once", "weighting": "uniform"}
            ),
            Cyclic(CLIENTS, 3),
            seed=3,
        ),
        8,
    )
    assert_same(runs["local"], averaging, rtol=1e-10)
    assert float((runs["fixed"] - averaging).abs().max()) > 1e-3


def test_nastya_can_take_rr_cli_theorem_c1_steps_and_a_rule_must_cover_the_method():
    problem, data = logistic_data()
    sampler = UniformWithoutReplacement(CLIENTS, 3)
    L, N = smoothness(problem, data).sample_max, PER_CLIENT // BATCH
    resolved, info = resolve_step_sizes(theory_spec("nastya", 2, theory_rule="rr_cli_c1"), problem, data, sampler)
    assert (resolved.local.lr, resolved.server.lr) == pytest.approx((1 / L, 2 * N / L), rel=1e-14) and info[
        "rule"
    ] == "rr_cli_c1"
    # Theorem C.2's η ≤ 1/(4L) is a bound, not a relation to γ: it does not follow the multiplier
    own, info = resolve_step_sizes(theory_spec("nastya", 2), problem, data, sampler)
    assert own.server.lr == pytest.approx(1 / (4 * L), rel=1e-14) and info["rule"] == "rr_cli_c2"
    with pytest.raises(ConfigError, match="server.theory_rule.*accepted for fedavg: karimireddy_i"):
        resolve_step_sizes(
            validate(
                RunSpec,
                {"method": {"name": "fedavg"}, "local": {"lr": "theory"}, "server": {"theory_rule": "rr_cli_c1"}},
            ),
            problem,
            data,
            sampler,
        )
    with pytest.raises(ConfigError, match="server.theory_rule"):
        validate(RunSpec, {"method": {"name": "nastya"}, "server": {"theory_rule": "c1"}})
