"""Stateful clients: FedCDR's fixed point, its prox, SCAFFOLD's exactness, the state store, bad input."""

import io

import numpy as np
import pytest
import torch

from fedshuffle import Cyclic, FullParticipation, LogisticRegression, Quadratic, Simulation, UniformWithoutReplacement
from fedshuffle.data import FederatedDataset, contiguous_partition, objective_weights
from fedshuffle.core.errors import ConfigError
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.state import JOURNAL, ClientStateStore
from fedshuffle.problems.solution import solution

from conftest import params_trajectory, build_flat


def heterogeneous_quadratic(spread, sizes=(3, 1, 4, 2, 5, 1), dim=3, seed=0):
    """Clients whose targets scatter around client centers that are ``spread`` apart; uniform weights."""
    rng = np.random.default_rng(seed)
    centers = spread * rng.normal(size=(len(sizes), dim))
    targets = np.concatenate([c + rng.normal(size=(s, dim)) for c, s in zip(centers, sizes)])
    data = FederatedDataset(
        torch.tensor(targets),
        torch.zeros(len(targets)),
        contiguous_partition(list(sizes)),
        objective_weights(np.array(sizes), "uniform"),
    )
    x_star = sum(
        w * targets[ix].mean(0) for w, ix in zip(data.weights, data.client_indices)
    )  # argmin Σ w_i f_i, closed form
    return Quadratic(dim), data, torch.tensor(x_star)


@pytest.mark.parametrize("spread", [0.0, 1.0, 10.0, 100.0])
@pytest.mark.parametrize("cohort", [6, 2], ids=["full", "cyclic-2-of-6"])
def test_fedcdr_reaches_the_exact_minimizer_for_any_heterogeneity(spread, cohort):
    problem, data, x_star = heterogeneous_quadratic(spread)
    alg = build_flat("fedcdr", {"lr": 0.1, "alpha": 1.0, "eta": 2.0, "initialization": "lazy"})
    sim = Simulation(problem, data, alg, Cyclic(6, cohort, "reshuffle"), seed=1)
    for _ in range(60 * (6 // cohort)):
        sim.step()
    assert float((sim.params - x_star).norm()) <= 1e-9 * max(1.0, spread)
    fedavg = Simulation(
        problem,
        data,
        build_flat("fedavg_rr", {"lr": 0.1, "epochs": 3, "normalization": "sum_one"}),
        FullParticipation(6),
        seed=1,
    )
    for _ in range(200):
        fedavg.step()
    if spread > 0:  # the local-steps baseline settles elsewhere, and further as heterogeneity grows
        assert float((fedavg.params - x_star).norm()) > 1e-3 * spread


def test_fedcdr_keeps_the_server_model_equal_to_the_weighted_mean_of_its_clients():
    """x = Σ_i w_i x̂_i at every round (clients not yet seen count as x⁰), the invariant of eq. (23)."""
    problem, data, _ = heterogeneous_quadratic(3.0)
    sim = Simulation(
        problem,
        data,
        build_flat("fedcdr", {"lr": 0.1, "alpha": 0.7, "eta": 0.5, "initialization": "lazy"}),
        Cyclic(6, 2),
        seed=3,
    )
    x0 = sim.params.clone()
    for _ in range(7):
        sim.step()
        xhat = sim.store.get("xhat", np.arange(6)).to(torch.float64)
        xhat[~torch.from_numpy(sim.store.created)] = x0
        torch.testing.assert_close(sim.params, torch.as_tensor(data.weights) @ xhat, rtol=1e-12, atol=1e-12)


def test_inner_solver_prox_agrees_with_the_closed_form_within_its_reported_residual():
    problem, data, _ = heterogeneous_quadratic(5.0)
    eta = 0.5
    alg = build_flat(
        "fedcdr", {"lr": 0.05, "epochs": 200, "batch_size": 5, "eta": eta, "exact_prox": False, "prox_solver": "sgd"}
    )
    sim = Simulation(problem, data, alg, Cyclic(6, 6), seed=0)
    clients = np.arange(6)
    centers = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    trainer = sim.trainer(sim.round_info())
    approx, cost = alg.method._prox(trainer, centers, clients, trainer.plan(clients, 0))
    exact = problem.prox(centers, sim.data, clients, eta)
    residual = sim.executor.client_gradients(problem, sim.data, approx, clients) + (approx - centers) / eta
    assert cost > 0 and float(residual.norm(dim=1).max()) < 1e-6
    assert torch.all((approx - exact).norm(dim=1) <= eta * residual.norm(dim=1) + 1e-12)


def test_fedcdr_reports_its_prox_residual_on_problems_without_a_closed_form():
    problem = LogisticRegression(3, 0.1)
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(40, 3)))
    data = FederatedDataset(
        x,
        torch.tensor(np.sign(rng.normal(size=40))),
        np.split(np.arange(40), 4),
        objective_weights(np.full(4, 10), "uniform"),
    )
    few = Simulation(
        problem,
        data,
        build_flat("fedcdr", {"lr": 0.05, "epochs": 1, "batch_size": 5, "prox_solver": "sgd"}),
        Cyclic(4, 2),
        seed=0,
    )
    many = Simulation(
        problem,
        data,
        build_flat("fedcdr", {"lr": 0.05, "epochs": 60, "batch_size": 5, "prox_solver": "sgd"}),
        Cyclic(4, 2),
        seed=0,
    )
    few.step(), many.step()
    assert many.last_extras["prox_residual"] < 0.1 * few.last_extras["prox_residual"]


@pytest.mark.parametrize("option", ["I", "II"])
def test_scaffold_reaches_x_star_where_fedavg_does_not(option):
    """Heterogeneous logistic regression, full participation, 5 full-batch local steps (deterministic)."""
    rng = np.random.default_rng(1)
    sizes = [20, 5, 30, 10]
    x = np.concatenate([rng.normal(loc=3 * rng.normal(size=4), size=(s, 4)) for s in sizes])
    y = np.sign(x @ rng.normal(size=4) + rng.normal(size=len(x)))
    data = FederatedDataset(
        torch.tensor(x), torch.tensor(y), contiguous_partition(sizes), objective_weights(np.array(sizes), "uniform")
    )
    problem = LogisticRegression(4, 0.05)
    x_star, _ = solution(problem, data)
    local = {"lr": 0.3, "steps": 5, "batch_size": 30, "order": "reshuffle"}
    scaffold = Simulation(
        problem, data, build_flat("scaffold", {**local, "option": option}), FullParticipation(4), seed=0
    )
    fedavg = Simulation(
        problem, data, build_flat("fedavg", {**local, "normalization": "unbiased"}), FullParticipation(4), seed=0
    )
    for _ in range(400):
        scaffold.step(), fedavg.step()
    assert float((scaffold.params - x_star).norm()) < 1e-8
    assert float((fedavg.params - x_star).norm()) > 1e-3
    record = scaffold.step()
    assert record.bytes_up == 2 * 4 * scaffold.bytes_per_model  # Δy_i and Δc_i


@pytest.mark.parametrize("limit", [1 << 30, 0], ids=["in-memory", "memory-mapped"])
@pytest.mark.parametrize("method", ["scaffold", "fedcdr"])
def test_client_state_survives_checkpoint_and_resume_bit_for_bit(tmp_path, method, limit):
    problem, data, _ = heterogeneous_quadratic(2.0)
    settings = (
        {"lr": 0.1, "steps": 3}
        if method == "scaffold"
        else {"lr": 0.1, "eta": 0.7, "exact_prox": False, "epochs": 2, "batch_size": 2}
    )
    make = lambda folder: Simulation(
        problem,
        data,
        build_flat(method, settings),
        Cyclic(6, 2),
        seed=4,
        state_memory_limit=limit,
        state_dir=str(folder),
    )  # noqa: E731
    reference = params_trajectory(make(tmp_path / "ref"), 12)
    run = make(tmp_path / "run")
    params_trajectory(run, 5)
    buf = io.BytesIO()
    torch.save(run.state_dict(), buf)  # the checkpoint
    run.commit_checkpoint()
    params_trajectory(run, 4)  # work after the checkpoint, lost in the crash
    if limit == 0:
        run.state_dict()  # a crash after writing a newer journal but before its checkpoint
        assert (tmp_path / "run" / JOURNAL).exists()
    resumed = make(tmp_path / "run")
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    assert torch.equal(params_trajectory(resumed, 7), reference[5:])
    assert run.store.mapped == (limit == 0)


def test_memory_mapped_store_creates_rows_lazily_and_holds_only_dirty_rows(tmp_path):
    store = ClientStateStore(1_000_000, {"c": 1000}, torch.float32, memory_limit=1 << 20, directory=tmp_path)
    assert store.mapped and store.resident_bytes == 0
    clients = np.array([3, 999_999, 17])
    store.set("c", clients, torch.ones(3, 1000))
    assert store.created.sum() == 3 and store.resident_bytes == 3 * 4000
    torch.testing.assert_close(store.get("c", np.array([17, 5])), torch.stack([torch.ones(1000), torch.zeros(1000)]))
    store.state_dict()
    store.commit()
    assert store.resident_bytes == 0 and float(store.get("c", np.array([999_999])).sum()) == 1000
    assert (tmp_path / "c.bin").stat().st_blocks * 512 < 1 << 20  # a sparse file: 4 GB long, a few pages on disk


def test_bad_stateful_settings_name_their_field():
    problem, data, _ = heterogeneous_quadratic(1.0)
    for settings, field in (
        ({"alpha": 2.0}, "method.alpha"),
        ({"alpha": 0.0}, "method.alpha"),
        ({"eta": 0.0}, "method.eta"),
        ({"prox_mu": 1.0}, "local.prox_mu"),
    ):
        with pytest.raises(ConfigError) as err:
            build_flat("fedcdr", {"lr": 0.1, **settings})
        assert err.value.field == field
    with pytest.raises(ConfigError) as err:
        Simulation(problem, data, build_flat("fedcdr", {"lr": 0.1}), UniformWithoutReplacement(6, 2))
    assert err.value.field == "sampler.name"
    with pytest.raises(ConfigError) as err:
        Cyclic(6, 4)
    assert err.value.field == "cohort" and "divide" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_flat("scaffold", {"lr": 0.1, "option": "III"})
    assert err.value.field == "method.option"
    with pytest.raises(ConfigError) as err:
        build_flat("fedavg", {"lr": 0.1, "eta": 3.0})
    assert err.value.field == "method.eta"


def test_stateful_methods_run_on_the_vectorized_executor_with_a_lazy_population():
    from fedshuffle.data import LazyFederatedDataset

    problem, data, _ = heterogeneous_quadratic(1.0)
    x = data.features.numpy()
    lazy = LazyFederatedDataset(
        data.sizes, data.weights, lambda i: (x[data.client_indices[i]], np.zeros(len(data.client_indices[i]))), (3,)
    )
    alg = build_flat("fedcdr", {"lr": 0.1, "exact_prox": False, "epochs": 2, "batch_size": 2})
    a = params_trajectory(Simulation(problem, data, alg, Cyclic(6, 3), seed=2), 6)
    b = params_trajectory(Simulation(problem, lazy, alg, Cyclic(6, 3), seed=2, executor=VectorizedExecutor()), 6)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_inspector_refuses_stateful_methods_instead_of_misreporting():
    from fedshuffle.analysis.objective import inspect_objective

    for name in ("scaffold", "fedcdr"):
        with pytest.raises(ConfigError, match="keeps client state"):
            inspect_objective(build_flat(name, {"lr": 0.1}), Cyclic(3, 1), np.array([1, 2, 3]), np.ones(3) / 3)


def unequal_logistic(sizes=(5, 9, 3, 7, 6, 4), dim=4, seed=2, test_sizes=None):
    """Six clients of unequal sizes with client-shifted features; labels ±1 from one plane. ``test_sizes``: each
    client's own
    test samples, drawn as its training ones (contiguous blocks of the test set)."""
    rng = np.random.default_rng(seed)
    shift, plane = rng.normal(size=(len(sizes), dim)), rng.normal(size=dim)

    def draw(counts):
        x = rng.normal(size=(sum(counts), dim)) + np.repeat(shift, counts, axis=0)
        return torch.tensor(x), torch.tensor(np.sign(x @ plane + 0.3 * rng.normal(size=len(x))))

    x, y = draw(sizes)
    test = draw(test_sizes) if test_sizes is not None else (None, None)
    data = FederatedDataset(
        x,
        y,
        contiguous_partition(list(sizes)),
        objective_weights(np.array(sizes), "uniform"),
        *test,
        test_client_sizes=test_sizes,
    )
    return LogisticRegression(dim, 1e-2), data


@pytest.mark.parametrize("method", ["fedcdr", "feddyn"])
def test_local_model_metrics_equal_the_weighted_losses_of_the_stored_client_models(method):
    """local_loss = Σ (|D_i|/|D|) f_i(x_i) and local_loss_uniform = (1/n)Σ f_i(x_i) over the stored rows, a client
    not yet seen at x⁰; the accuracies likewise, and on each client's own test samples (one client has none).
    After 2 rounds of 2 clients of 6, two clients are still unseen."""
    from fedshuffle.metrics import local_model_scores

    test_sizes = np.array([2, 0, 3, 1, 2, 4])
    problem, data = unequal_logistic(test_sizes=test_sizes)
    settings = {"lr": 0.1, "eta": 0.5, "prox_solver": "lbfgs"} if method == "fedcdr" else {"lr": 0.1, "alpha": 0.1}
    sampler = Cyclic(6, 2) if method == "fedcdr" else UniformWithoutReplacement(6, 2)
    sim = Simulation(problem, data, build_flat(method, settings), sampler, seed=4)
    x0 = sim.params.clone() + 0.0
    for _ in range(2):
        sim.step()
    assert sim.store.created.sum() == 4
    field = "x" if method == "fedcdr" else "model"
    sizes = np.asarray(data.sizes, dtype=float)
    losses, accuracies, test_losses, test_hits = [], [], [], []
    test_start = np.concatenate([[0], np.cumsum(test_sizes)])
    for i, ix in enumerate(data.client_indices):
        own = sim.store.get(field, np.array([i]))[0].double() if sim.store.created[i] else x0
        z = data.labels[ix] * (data.features[ix] @ own)
        losses.append(float(torch.nn.functional.softplus(-z).mean() + 0.5 * 1e-2 * own.pow(2).sum()))
        accuracies.append(float((z > 0).double().mean()))
        held = slice(test_start[i], test_start[i + 1])
        z_test = data.test_labels[held] * (data.test_features[held] @ own)
        test_losses.append(float((torch.nn.functional.softplus(-z_test) + 0.5 * 1e-2 * own.pow(2).sum()).sum()))
        test_hits.append(float((z_test > 0).double().sum()))
    scores = local_model_scores(sim)
    has_test = test_sizes > 0
    assert scores["local_test_loss"] == pytest.approx(sum(test_losses) / test_sizes.sum(), rel=1e-12)
    assert scores["local_test_accuracy"] == pytest.approx(sum(test_hits) / test_sizes.sum(), rel=1e-12)
    assert scores["local_test_accuracy_uniform"] == pytest.approx(
        np.mean(np.array(test_hits)[has_test] / test_sizes[has_test]), rel=1e-12
    )
    assert scores["local_loss"] == pytest.approx(sizes @ np.array(losses) / sizes.sum(), rel=1e-12)
    assert scores["local_loss_uniform"] == pytest.approx(np.mean(losses), rel=1e-12)
    assert scores["local_accuracy"] == pytest.approx(sizes @ np.array(accuracies) / sizes.sum(), rel=1e-12)
    assert scores["local_accuracy_uniform"] == pytest.approx(np.mean(accuracies), rel=1e-12)
    assert scores["local_loss"] != pytest.approx(
        float(problem.weighted_loss(sim.params, data.features, data.labels, data.sample_weights())), rel=1e-3
    )
    if method == "feddyn":  # θ_i = x − Δ_i: the model the client trained this round
        assert float((sim.store.get("model", np.arange(6))[sim.store.created] - x0).abs().max()) > 1e-3


def test_per_client_test_blocks_are_checked_and_come_from_fedprox_synthetic():
    """A test split per client must give every client its count of the test samples (one line naming data);
    FedProx's Synthetic devices bring theirs (the last tenth of each device), pooled sources none."""
    from fedshuffle.data.catalog import federate, load_samples
    from fedshuffle.data.sources.synthetic import FedProxSynthetic

    good = unequal_logistic(test_sizes=np.array([2, 0, 3, 1, 2, 4]))[1]
    for bad in ([2, 0, 3, 1, 2], [2, 0, 3, 1, 2, 5], [3, -1, 3, 1, 2, 4]):
        with pytest.raises(ConfigError, match="test_client_sizes"):
            FederatedDataset(
                good.features,
                good.labels,
                good.client_indices,
                good.weights,
                good.test_features,
                good.test_labels,
                test_client_sizes=bad,
            )
    settings = {"source": "fedprox_synthetic", "clients": 7, "synthetic_alpha": 0.5, "synthetic_beta": 0.5}
    samples, rng = load_samples(settings, 3)
    data = federate(samples, settings, rng)
    devices = FedProxSynthetic(0.5, 0.5, 7, 3)
    assert list(data.test_client_sizes) == [len(devices.test(k)[1]) for k in range(7)]
    rows = data.client_test_rows()[4]
    assert torch.equal(data.test_features[rows], torch.as_tensor(devices.test(4)[0]))
    assert unequal_logistic()[1].client_test_rows() is None


def test_local_model_metrics_are_absent_for_methods_without_client_models():
    from fedshuffle.metrics import local_model_scores

    problem, data = unequal_logistic()
    for method, settings in (("scaffold", {"lr": 0.1}), ("fedavg", {"lr": 0.1})):
        sim = Simulation(problem, data, build_flat(method, settings), UniformWithoutReplacement(6, 2), seed=0)
        sim.step()
        assert local_model_scores(sim) == {}


def test_fedcdr_default_prox_is_the_local_sgd_warm_started_from_the_previous_local_model():
    """§6.1: the prox by the local SGD epochs; started from x_i. One full-batch step per prox on the quadratic
    f_i = mean ½‖z − a_j‖² (∇f_i(z) = z − ā_i): x_i⁰ = x⁰ − γ(x⁰ − ā_i) at the first round, then
    x_i = s − γ((s − ā_i) + (s − y_i)/η) from s = x_i⁰ (warm) or s = y_i (warm_start = false)."""
    problem, data, _ = heterogeneous_quadratic(2.0)
    gamma, eta, alpha = 0.2, 0.5, 1.0
    means = torch.stack([data.features[ix].mean(0) for ix in data.client_indices])
    for warm in (True, False):
        settings = {"lr": gamma, "epochs": 1, "batch_size": 100, "eta": eta, "alpha": alpha, "exact_prox": False}
        sim = Simulation(
            problem,
            data,
            build_flat("fedcdr", settings if warm else {**settings, "warm_start": False}),
            Cyclic(6, 6),
            seed=0,
        )
        x0 = sim.params.clone()
        sim.step()
        first = x0 - gamma * (x0 - means)
        y = x0 + alpha * (x0 - first)
        start = first if warm else y
        expected = start - gamma * ((start - means) + (start - y) / eta)
        torch.testing.assert_close(sim.store.get("x", np.arange(6)).double(), expected, rtol=1e-12, atol=1e-12)
