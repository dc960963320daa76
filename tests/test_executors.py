"""Every method on every executor: the same trajectory as the sequential reference, fp64, 1e-10."""

import numpy as np
import pytest
import torch

from fedshuffle import MLP, Cyclic, LogisticRegression, Simulation, UniformWithoutReplacement
from fedshuffle.data import FederatedDataset, objective_weights
from fedshuffle.core.errors import ConfigError
from fedshuffle.executors.local import SequentialExecutor, ThreadedExecutor, VectorizedExecutor
from fedshuffle.executors.ray import RayExecutor

from conftest import assert_relative_close, params_trajectory, build_flat

SIZES = [3, 7, 5, 11, 2, 6]
ROUNDS = 8

#: Per method, settings that exercise what the method is about (every registered method, whatever its
#: settings, is also walked by fedshuffle.testing.check_method in test_checks.py): unequal sizes everywhere, plus random
#: epochs, stragglers, clipping, weight decay, local momentum or prox where the method allows them.
SETTINGS = {
    "fedavg": {"steps": 4, "batch_size": 2, "clip_norm": 0.5, "weight_decay": 1e-2},
    "fedavg_rr": {"epochs": [1, 3], "batch_size": 2, "local_momentum": 0.5},
    "fedavg_min": {"epochs": 2, "batch_size": 2},
    "fedavg_mean": {"epochs": 2, "straggler_probability": 0.5},
    "fednova": {"steps": 5, "prox_mu": 0.1},
    "fednova_rr": {"epochs": [1, 2], "local_momentum": 0.3, "straggler_probability": 0.3},
    "fedshuffle": {"epochs": 2, "batch_size": 3, "clip_norm": 1.0},
    "fedshuffle_gen": {"epochs": [1, 2], "drop_last_steps": 1},
    "fedshuffle_mvr": {"batch_size": 2},
    "nastya": {"batch_size": 2, "server_lr": 0.5, "server_optimizer": "adam"},
    "rr_cli": {"batch_size": 2, "server_lr": 0.5, "global_lr": 2.0},
    "generalized_fedavg": {"steps": 3, "server_lr": 2.0, "server_optimizer": "yogi"},
    "fedprox": {"epochs": 2, "batch_size": 2, "prox_mu": 0.5},
    "scaffold": {"steps": 3, "batch_size": 2, "option": "I"},
    "fedcdr": {"epochs": 2, "batch_size": 2, "alpha": 0.8, "eta": 2.0},
    "feddyn": {"epochs": 2, "batch_size": 2, "alpha": 0.3},
}

#: every method, plus global momentum and an adaptive server optimizer around the stateful methods
CASES = {
    **{m: (m, settings) for m, settings in SETTINGS.items()},
    "scaffold+mvr+adam": (
        "scaffold",
        {**SETTINGS["scaffold"], "global_momentum": 0.9, "server_optimizer": "adam", "server_lr": 0.05},
    ),
    "fedcdr+momentum+yogi": (
        "fedcdr",
        {
            **SETTINGS["fedcdr"],
            "global_momentum": 0.5,
            "momentum_estimator": "approx",
            "server_optimizer": "yogi",
            "server_lr": 0.05,
        },
    ),
    "feddyn+mvr+heavy_ball": ("feddyn", {**SETTINGS["feddyn"], "global_momentum": 0.9, "server_momentum": 0.5}),
}


def dataset(classes=2, seed=0):
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.normal(size=(sum(SIZES), 4)))
    labels = rng.integers(0, classes, sum(SIZES))
    y = torch.tensor(labels * 2.0 - 1.0) if classes == 2 else torch.tensor(labels)
    parts = np.split(np.arange(sum(SIZES)), np.cumsum(SIZES)[:-1])
    return FederatedDataset(x, y, parts, objective_weights(np.array(SIZES), "size"))


def trajectory(case, executor, problem=None, data=None):
    problem = problem or LogisticRegression(4, 1e-2)
    data = data or dataset()
    method, settings = CASES[case]
    sampler = Cyclic(6, 3) if method in ("rr_cli", "fedcdr") else UniformWithoutReplacement(6, 3)
    sim = Simulation(problem, data, build_flat(method, {"lr": 0.1, **settings}), sampler, seed=5, executor=executor)
    return params_trajectory(sim, ROUNDS)


def assert_close(a, b, rtol=1e-10):
    assert_relative_close(a, b, rtol)


@pytest.mark.parametrize("method", sorted(CASES))
def test_vectorized_and_threaded_equal_sequential(method):
    reference = trajectory(method, SequentialExecutor())
    assert_close(trajectory(method, VectorizedExecutor()), reference)
    assert_close(trajectory(method, VectorizedExecutor(chunk_size=2)), reference)  # chunked cohorts too
    assert_close(trajectory(method, ThreadedExecutor(2)), reference)  # clients in two threads


@pytest.mark.parametrize("method", ["fedavg_rr", "fedshuffle_mvr", "fednova"])
def test_vectorized_equals_sequential_for_a_network(method):
    """The vmap(grad) path: a small MLP on 3 classes."""
    problem, data = MLP(4, [5], 3, 1e-3), dataset(classes=3)
    assert_close(
        trajectory(method, VectorizedExecutor(), problem, data), trajectory(method, SequentialExecutor(), problem, data)
    )


@pytest.mark.parametrize(
    ("budget_mb", "dim", "batch", "steps"), [(1, 10_000, 1, 4), (1, 300, 5, 2), (64, 10_000, 3, 7)]
)
def test_the_chunk_is_as_many_clients_as_fit_in_the_memory_budget(budget_mb, dim, batch, steps):
    """The chosen chunk's clients fit in the budget by the executor's own estimate, and one client more does not; a
    chunk needs no less per client for a larger model, minibatch or plan."""
    data, budget = dataset(), budget_mb << 20
    executor = VectorizedExecutor(memory_budget=budget)
    size, one = executor.chunk_for(data, dim, batch, steps), executor.client_bytes(data, dim, batch, steps)
    assert size >= 1 and size * one <= budget < (size + 1) * one
    for larger in ((2 * dim, batch, steps), (dim, 2 * batch, steps), (dim, batch, 2 * steps)):
        assert executor.client_bytes(data, *larger) > one and executor.chunk_for(data, *larger) <= size


def test_a_client_larger_than_the_budget_is_a_chunk_of_its_own_and_a_given_chunk_size_is_kept():
    data = dataset()
    assert VectorizedExecutor(memory_budget=1 << 20).chunk_for(data, dim=10**6, batch=1) == 1
    assert VectorizedExecutor(chunk_size=7).chunk_for(data, dim=10_000, batch=1) == 7
    with pytest.raises(ConfigError, match="run.chunk_size"):
        VectorizedExecutor(chunk_size=0)


def test_full_local_gradients_agree():
    problem, data = LogisticRegression(4, 1e-2), dataset()
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    clients = np.array([0, 3, 4, 3])
    assert_close(
        VectorizedExecutor(chunk_size=3).client_gradients(problem, data, x, clients),
        SequentialExecutor().client_gradients(problem, data, x, clients),
    )


@pytest.fixture(scope="module")
def ray_executor():
    ray = pytest.importorskip("ray")
    executor = RayExecutor(workers=2)
    yield executor
    ray.shutdown()


@pytest.mark.parametrize("method", sorted(CASES))
def test_ray_equals_sequential(ray_executor, method):
    assert_close(trajectory(method, ray_executor), trajectory(method, SequentialExecutor()))


def test_lazy_dataset_gives_the_in_memory_trajectory():
    """Clients generated on demand (LazyFederatedDataset) run exactly as the same data held in memory."""
    from fedshuffle.data import LazyFederatedDataset

    data = dataset()
    x, y = data.features.numpy(), data.labels.numpy()
    lazy = LazyFederatedDataset(
        data.sizes, data.weights, lambda i: (x[data.client_indices[i]], y[data.client_indices[i]]), (4,)
    )
    for method in ("fedshuffle", "fedshuffle_mvr", "fedavg"):
        reference = trajectory(method, SequentialExecutor())
        for executor in (SequentialExecutor(), VectorizedExecutor(chunk_size=2)):
            assert_close(trajectory(method, executor, data=lazy), reference, rtol=1e-13)
    rows = np.array([0, 4, 10, 33])
    f, lab = lazy.gather(rows)
    assert torch.equal(f, data.features[rows]) and torch.equal(lab, data.labels[rows])


def test_device_setting_is_validated():
    problem, data = LogisticRegression(4, 1e-2), dataset()
    alg = build_flat("fedavg", {"lr": 0.1})
    with pytest.raises(ConfigError, match="run.device"):
        Simulation(problem, data, alg, UniformWithoutReplacement(6, 3), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            Simulation(problem, data, alg, UniformWithoutReplacement(6, 3), device="cuda")


def test_auto_picks_by_problem_and_device():
    """'auto': batched closed forms → vectorized; modules on a multi-threaded CPU → threaded, with one thread →
    sequential (in-place steps); dropout modules anywhere and recurrent ones on CUDA → sequential; other modules on
    CUDA → vectorized. The choice is recorded on the executor."""
    from fedshuffle.executors import ThreadedExecutor, choose, make_executor
    from fedshuffle.problems import CNN, CharLSTM, ModuleProblem

    lstm, cnn, dropout = ModuleProblem(CharLSTM(7, 3, 5, 1)), CNN((3, 8, 8), 3, dropout=False), CNN((3, 8, 8), 3)
    assert choose(LogisticRegression(4, 0.1))[0] == choose(MLP(4, [3], 2))[0] == "vectorized"
    assert choose(cnn, threads=2)[0] == choose(lstm, threads=4)[0] == "threaded"
    assert (
        choose(cnn, threads=1)[0]
        == choose(dropout, threads=2)[0]
        == choose(lstm, "cuda")[0]
        == choose(dropout, "cuda")[0]
        == "sequential"
    )
    assert choose(cnn, "cuda")[0] == "vectorized"
    executor = make_executor("auto", LogisticRegression(4, 0.1))
    assert isinstance(executor, VectorizedExecutor) and executor.chosen.startswith("auto: vectorized")
    threaded = make_executor("auto", cnn, threads=3)
    assert (
        isinstance(threaded, ThreadedExecutor)
        and threaded.threads == 3
        and threaded.chosen.startswith("auto: threaded — cnn on the CPU: 3 clients at a time")
    )
    with pytest.raises(ConfigError, match="run.executor.*auto, sequential, vectorized, threaded, ray"):
        make_executor("gpu")


@pytest.mark.parametrize("problem_name", ["quadratic", "logistic", "softmax", "mlp"])
def test_compiled_backend_gives_the_reference_trajectory(problem_name):
    """The numba backend of the local loop (fedshuffle.local.fused) against the sequential torch reference, fp64,
    1e-10: every step transform (clip, weight decay, local momentum; prox; SCAFFOLD's offset with FedShuffleMVR's
    corrected drift) on each linear problem, and the MLP (two hidden layers, λ > 0) with FedCDR's prox and SCAFFOLD."""
    pytest.importorskip("numba")
    from fedshuffle import Quadratic, SoftmaxRegression
    from fedshuffle.local import fused

    problem, data = {
        "quadratic": (Quadratic(4), dataset()),
        "logistic": (LogisticRegression(4, 1e-2), dataset()),
        "softmax": (SoftmaxRegression(4, 3, 1e-2), dataset(classes=3)),
        "mlp": (MLP(4, [5, 3], 3, 1e-2), dataset(classes=3)),
    }[problem_name]
    assert fused.problem_code(problem) is not None
    cases = {
        "quadratic": ("fedavg_rr", "fednova"),
        "logistic": ("fedavg", "scaffold+mvr+adam"),
        "softmax": ("scaffold+mvr+adam",),
        "mlp": ("fedcdr", "scaffold+mvr+adam", "fedavg_rr"),
    }[problem_name]
    compiled_calls = []
    original = fused.run

    def counted(*args):
        compiled_calls.append(1)
        return original(*args)

    for case in cases:  # local momentum, prox; clip and weight decay, offset and corrected drift; softmax with the most
        reference = trajectory(case, SequentialExecutor(), problem, data)
        compiled_calls.clear()
        fused.run = counted
        try:
            vectorized = trajectory(case, VectorizedExecutor(), problem, data)
        finally:
            fused.run = original
        assert compiled_calls, f"{case}: the compiled loop did not run"
        assert_close(vectorized, reference)


def test_compiled_backend_runs_a_small_float32_mlp_and_leaves_larger_ones_to_torch():
    """FedCDR's 60-32-10 MLP in float32: the compiled loop's updates equal the torch loop's to float32 rounding (1e-5
    relative after 40 steps of SGD with a prox term); a step over fused.MLP_STEP_LIMIT (Yang et al.'s 2NN at batch 50)
    stays on the torch loop, and so does a stochastic or float16 run."""
    pytest.importorskip("numba")
    from fedshuffle.local import fused
    from fedshuffle.local.loop import LocalWork, run_local
    from fedshuffle.local.plan import ClientPlan
    from fedshuffle.local.steps import Prox, StepChain

    rng = np.random.default_rng(1)
    problem = MLP(60, [32], 10)
    x = torch.from_numpy(rng.standard_normal((300, 60)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 300))
    plans = [
        ClientPlan(c, rng.integers(0, 300, (steps, 10)), 0.05, steps, float(steps))
        for c, steps in enumerate((40, 7, 23))
    ]
    plans[1].batches[-1, 4:] = -1  # a short last batch
    start = problem.init_params(torch.Generator().manual_seed(0), torch.float32).expand(3, -1).contiguous()
    work = LocalWork(plans, start, StepChain([Prox(0.1)]), center=start + 0.01)
    assert fused.usable(problem, x, work)
    torch_deltas, compiled_deltas = run_local(problem, x, y, work), run_local(problem, x, y, work, compiled=True)
    assert compiled_deltas.dtype == torch.float32
    assert not torch.equal(torch_deltas, compiled_deltas)  # the compiled loop did run: its rounding differs
    assert_relative_close(compiled_deltas, torch_deltas, 1e-5)
    wide = MLP(784, [200, 200], 10)
    wide_plans = [ClientPlan(0, np.zeros((2, 50), dtype=np.int64), 0.1, 2, 2.0)]
    wide_work = LocalWork(wide_plans, torch.zeros(wide.dim))
    assert wide.dim * 50 > fused.MLP_STEP_LIMIT and not fused.usable(wide, torch.zeros(1, 784), wide_work)
    assert not fused.usable(problem, x.half(), LocalWork(plans, start.half()))
    assert not fused.usable(problem, x.double(), work)  # features of another dtype than the model
    stochastic = MLP(60, [32], 10)
    stochastic.stochastic = True
    assert not fused.usable(stochastic, x, work)


def test_a_diverging_mlp_gives_non_finite_updates_on_the_compiled_loop_as_on_the_torch_loop():
    """A step size that blows the MLP up: both loops return non-finite updates (the run is then stopped as diverged),
    the compiled one never raises (a division by zero in its softmax gives inf or NaN, as in NumPy)."""
    pytest.importorskip("numba")
    from fedshuffle.local.loop import LocalWork, run_local
    from fedshuffle.local.plan import ClientPlan

    rng = np.random.default_rng(0)
    problem = MLP(60, [32], 10)
    x = torch.from_numpy(5 * rng.standard_normal((100, 60)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 100))
    work = LocalWork(
        [ClientPlan(0, rng.integers(0, 100, (200, 10)), 1e10, 200, 200.0)],
        problem.init_params(torch.Generator().manual_seed(0), torch.float32),
    )
    for compiled in (False, True):
        assert not torch.isfinite(run_local(problem, x, y, work, compiled=compiled)).all(), f"compiled={compiled}"


@pytest.mark.parametrize("method", ["fedavg", "fednova_rr", "fedshuffle", "generalized_fedavg"])
def test_summed_updates_equal_the_stacked_ones(method, monkeypatch):
    """A method with the default halves gets Σ ω_iΔ_i from the executor as the updates are produced (never the
    (C, d) stack): the same trajectory and the same bytes counted as up to each member sending its own Δ_i."""
    from fedshuffle.methods.base import Method

    def run(executor):
        sim = Simulation(
            LogisticRegression(4, 1e-2),
            dataset(),
            build_flat(method, {"lr": 0.1, **SETTINGS[method]}),
            UniformWithoutReplacement(6, 3),
            seed=5,
            executor=executor,
        )
        return params_trajectory(sim, ROUNDS), sim.counters.bytes_up

    assert Simulation(
        LogisticRegression(4, 1e-2),
        dataset(),
        build_flat(method, {"lr": 0.1, **SETTINGS[method]}),
        UniformWithoutReplacement(6, 3),
    ).method.sums_updates
    summed = {
        name: run(executor)
        for name, executor in {
            "sequential": SequentialExecutor(),
            "vectorized": VectorizedExecutor(chunk_size=2),
            "threaded": ThreadedExecutor(2),
        }.items()
    }
    assert torch.equal(run(ThreadedExecutor(2))[0], summed["threaded"][0])  # the threads' timing does not change a bit
    monkeypatch.setattr(Method, "sums_updates", property(lambda self: False))
    stacked, up = run(SequentialExecutor())
    for name, (trajectory_, bytes_up) in summed.items():
        assert_close(trajectory_, stacked, 1e-12)
        assert bytes_up == up > 0


def test_an_executor_registered_from_user_code_is_configured_and_checked_by_its_declared_settings():
    """A new executor's settings come from [run] when it is chosen and are refused naming it otherwise; the public
    check walks its bad values and compares its trajectory with the sequential one, failing for one that is off."""
    from typing import Annotated

    from pydantic import Field

    from fedshuffle import testing
    from fedshuffle.executors import EXECUTORS
    from fedshuffle.experiments.build import build_executor
    from fedshuffle.experiments.schema import RunSpec, validate

    def lanes_executor(lanes: Annotated[int, Field(ge=1, le=4, description="clients per chunk")] = 2):
        return VectorizedExecutor(chunk_size=lanes)

    class Off(SequentialExecutor):
        def run(self, problem, data, work, weights=None):
            return 1.001 * super().run(problem, data, work, weights)

    EXECUTORS.add("lanes", lanes_executor, "chunks of a fixed number of clients (tests only)")
    EXECUTORS.add("off", Off, "the sequential updates, 0.1% too long (tests only)")
    try:
        testing.check_executor("lanes", {"lanes": 3})
        assert build_executor(validate(RunSpec, {"run": {"executor": "lanes", "lanes": 3}}).run).chunk_size == 3
        with pytest.raises(ConfigError) as err:
            validate(RunSpec, {"run": {"executor": "sequential", "lanes": 3}})
        assert err.value.field == "run.lanes" and "executor 'lanes'" in err.value.message
        with pytest.raises(AssertionError, match="the off executor is .* away from the sequential one"):
            testing.check_executor("off")
    finally:
        EXECUTORS.remove("lanes")
        EXECUTORS.remove("off")


def test_the_sequential_executor_refuses_every_other_executors_setting_naming_it(tmp_path):
    """Exit 2 naming the setting and the executors that take it."""
    from typer.testing import CliRunner

    from fedshuffle.cli import app
    from fedshuffle.executors import EXECUTORS

    result = CliRunner().invoke(
        app,
        [
            "run",
            "quickstart",
            "--set",
            "run.executor=sequential",
            "--set",
            "run.chunk_size=4",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 2 and "run.chunk_size" in result.output and "executor 'vectorized'" in result.output
    assert not (tmp_path / "out").exists()
    every = {s for e in EXECUTORS.entries() for s in e.setting_names()}
    assert every >= {"chunk_size", "memory_budget_mb", "threads", "ray_workers", "ray_address", "ray_retries"}


def test_identities_written_with_every_executors_settings_still_match_the_runs_that_take_only_their_own():
    """A results folder written when every run recorded every executor's settings (at their defaults) continues."""
    from fedshuffle.experiments.folders import differences, identity
    from fedshuffle.experiments.schema import RunSpec, validate

    every = {"chunk_size": None, "memory_budget_mb": 1024, "threads": None, "ray_workers": 2, "ray_retries": 3}
    for run in ({"executor": "sequential"}, {"executor": "vectorized", "chunk_size": 4}):
        now = identity(validate(RunSpec, {"run": run}).model_dump())
        before = {**{f"run.{k}": v for k, v in every.items()}, **now}
        assert differences(before, now) == [] and differences(now, before) == []
    now = identity(validate(RunSpec, {"run": {"executor": "vectorized", "chunk_size": 4}}).model_dump())
    assert differences({**now, "run.chunk_size": None}, now) == ["run.chunk_size: null there, 4 now"]


def test_an_executor_or_sink_defined_in_the_script_is_refused_for_worker_processes():
    """Worker processes build the run's executor and sinks too: one defined in the script being run is refused."""
    from fedshuffle import plugins
    from fedshuffle.executors import EXECUTORS
    from fedshuffle.experiments.schema import RunSpec, validate
    from fedshuffle.experiments.sinks import SINKS
    from fedshuffle.experiments.sweep import _parts

    def scripted(device):
        return SequentialExecutor()

    def printed(root):
        return None

    scripted.__module__ = printed.__module__ = "__main__"
    EXECUTORS.add("scripted", scripted, "the sequential executor, defined in a script (tests only)")
    SINKS.add("printed", printed, "nothing, defined in a script (tests only)")
    try:
        plugins.check_reachable(_parts(validate(RunSpec, {"run": {"sinks": ["tensorboard"]}})))
        for run, field in (({"executor": "scripted"}, "run.executor"), ({"sinks": ["printed"]}, "run.sinks")):
            with pytest.raises(ConfigError) as err:
                plugins.check_reachable(_parts(validate(RunSpec, {"run": run})))
            assert err.value.field == field and "defined in the script being run" in err.value.message
    finally:
        EXECUTORS.remove("scripted")
        SINKS.remove("printed")
