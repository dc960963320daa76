"""The method protocol: FedDyn's exactness, wrappers around stateful methods, the client half alone, the registry
walk."""

import numpy as np
import pytest
import torch

from conftest import build_flat, params_trajectory
from fedshuffle import FullParticipation, LogisticRegression, Simulation, UniformWithoutReplacement
from fedshuffle.problems.solution import solution
from fedshuffle.core.errors import ConfigError
from fedshuffle.data import FederatedDataset, contiguous_partition, objective_weights
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.methods import Trainer
from fedshuffle.methods.algorithm import build_algorithm


def heterogeneous_logistic(weights="uniform"):
    rng = np.random.default_rng(1)
    sizes = [20, 5, 30, 10]
    x = np.concatenate([rng.normal(loc=3 * rng.normal(size=4), size=(s, 4)) for s in sizes])
    y = np.sign(x @ rng.normal(size=4) + rng.normal(size=len(x)))
    data = FederatedDataset(
        torch.tensor(x), torch.tensor(y), contiguous_partition(sizes), objective_weights(np.array(sizes), weights)
    )
    return LogisticRegression(4, 0.05), data


@pytest.mark.parametrize("weights", ["uniform", "size"])
def test_feddyn_reaches_the_exact_minimizer_where_fedavg_with_the_same_local_work_does_not(weights):
    """Acar et al., ICLR 2021: under full participation FedDyn's fixed point is x* = argmin Σ w_i f_i."""
    problem, data = heterogeneous_logistic(weights)
    x_star, _ = solution(problem, data)
    local = {
        "lr": 0.3,
        "steps": 5,
        "batch_size": 30,
        "order": "reshuffle",
    }  # 5 full-batch steps: deterministic local work
    feddyn = Simulation(problem, data, build_flat("feddyn", {**local, "alpha": 0.3}), FullParticipation(4), seed=0)
    fedavg = Simulation(
        problem, data, build_flat("fedavg", {**local, "normalization": "unbiased"}), FullParticipation(4), seed=0
    )
    for _ in range(300):
        feddyn.step(), fedavg.step()
    assert float((feddyn.params - x_star).norm()) <= 1e-8
    assert float((fedavg.params - x_star).norm()) > 1e-3


def test_feddyn_server_state_is_the_weighted_sum_of_its_clients_gradients():
    """h = Σ_i w_i ∇L_i under full participation (the invariant behind its fixed point)."""
    problem, data = heterogeneous_logistic("size")
    sim = Simulation(
        problem,
        data,
        build_flat("feddyn", {"lr": 0.1, "steps": 3, "batch_size": 4, "alpha": 0.5}),
        FullParticipation(4),
        seed=2,
    )
    for _ in range(5):
        sim.step()
    grads = sim.store.get("gradient", np.arange(4)).to(torch.float64)
    torch.testing.assert_close(sim.method_state["h"], torch.as_tensor(data.weights) @ grads, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "method, extra",
    [
        ("scaffold", {"steps": 3}),
        ("fedcdr", {"exact_prox": False, "epochs": 1, "batch_size": 4}),
        ("feddyn", {"steps": 3}),
    ],
)
def test_global_momentum_and_adaptive_servers_act_on_stateful_methods(method, extra):
    problem, data = heterogeneous_logistic()
    sampler = FullParticipation(4)
    if method == "fedcdr":
        from fedshuffle import Cyclic

        sampler = Cyclic(4, 2)
    plain = build_flat(method, {"lr": 0.1, **extra})
    wrapped = build_flat(
        method,
        {
            "lr": 0.1,
            **extra,
            "global_momentum": 0.9,
            "momentum_estimator": "approx",
            "server_optimizer": "adam",
            "server_lr": 0.05,
        },
    )
    assert wrapped.method.name == method and wrapped.method.state_fields == plain.method.state_fields
    a = params_trajectory(Simulation(problem, data, plain, sampler, seed=0), 4)
    b = params_trajectory(Simulation(problem, data, wrapped, sampler, seed=0), 4)
    assert torch.isfinite(b).all() and float((a - b).abs().max()) > 1e-6


@pytest.mark.parametrize("method", ["fedshuffle", "scaffold", "feddyn", "fedshuffle_mvr"])
def test_the_client_half_runs_alone_on_one_clients_own_data(method):
    """What a device does: its broadcast, its plan, its own rows and its own data give the simulation's payload row."""
    problem, data = heterogeneous_logistic()
    sim = Simulation(
        problem,
        data,
        build_flat(method, {"lr": 0.1, "steps": 3, "batch_size": 4}),
        UniformWithoutReplacement(4, 2),
        seed=3,
    )
    for _ in range(2):
        sim.step()
    rnd = sim.round_info()
    state = sim.method_state
    points = sim.method.gradient_requests(rnd, sim.params, state)
    if points:
        state = sim.method.absorb_gradients(
            rnd, sim.params, state, [sim.trainer(rnd).gradients(p, rnd.cohort) for p in points]
        )
    broadcast = sim.method.configure(rnd, sim.params, state)
    cohort_result = sim.method.client_update(broadcast, rnd.plans, sim._read_rows(rnd.cohort), sim.trainer(rnd))
    for k, client in enumerate(rnd.cohort):
        own = data.client_indices[client]
        alone = FederatedDataset(data.features[own], data.labels[own], [np.arange(len(own))], np.ones(1))
        plan = rnd.plans[k]
        local_plan = type(plan)(
            0,
            np.where(plan.batches >= 0, np.searchsorted(own, plan.batches), -1),
            plan.lr,
            plan.planned_steps,
            plan.a_l1,
        )
        trainer = Trainer(problem, alone, sim.executor, sim.algorithm.local, sim.seed, rnd.index, rnd.lr_scale)
        rows = {name: value[k : k + 1] for name, value in sim._read_rows(rnd.cohort).items()}
        result = sim.method.client_update(broadcast, [local_plan], rows, trainer)
        for name, value in result.payload.items():
            torch.testing.assert_close(value[0], cohort_result.payload[name][k], rtol=1e-12, atol=1e-14)


def build_spec(raw):
    spec = validate(RunSpec, raw)
    return build_algorithm(spec.method.name, spec.algorithm_settings(), 10)


def test_a_setting_of_another_method_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        build_spec({"method": {"name": "fedavg", "eta": 3.0}, "local": {"lr": 0.1}})
    assert err.value.field == "method.eta" and "fedcdr" in err.value.message


@pytest.mark.parametrize("name, cohort", [("uniform", 9), ("with_replacement", 2.5)])
def test_a_cohort_the_clients_cannot_give_is_refused_naming_it(name, cohort):
    """More clients than there are, a non-integer number of draws: refused when the sampler meets the data."""
    from fedshuffle.experiments.build import build_sampler

    data = heterogeneous_logistic()[1]
    with pytest.raises(ConfigError) as err:
        build_sampler(validate(RunSpec, {"sampler": {"name": name, "cohort": cohort}}).sampler, data)
    assert err.value.field in ("sampler.cohort", "sampler.probabilities"), err.value
