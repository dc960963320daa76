"""Neural networks as problems: the papers' registered models and any user nn.Module.

Gradients against finite differences (fp64), identical trajectories on every executor (dropout
included), the Python API with a user-defined module, what is refused (BatchNorm), and the device path.
"""

import pickle

import numpy as np
import pytest
import torch

from conftest import assert_relative_close, build_flat, params_trajectory
from fedshuffle import Simulation, UniformWithoutReplacement
from fedshuffle.core.errors import ConfigError
from fedshuffle.data import FederatedDataset, objective_weights
from fedshuffle.data.catalog import Samples
from fedshuffle.executors.local import SequentialExecutor, ThreadedExecutor, VectorizedExecutor
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.problems import PROBLEMS, ModuleProblem, batchnorm_to_groupnorm

SIZES = [3, 5, 4, 6]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread (no OpenMP hand-offs); the setting is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def samples(kind: str, n: int = sum(SIZES), seed: int = 0) -> Samples:
    """Tiny samples of each input kind: RGB and gray images, token sequences, flat vectors."""
    rng = np.random.default_rng(seed)
    if kind == "tokens":
        return Samples(rng.integers(0, 7, (n, 6)), rng.integers(0, 7, (n, 6)), 7)
    shape = {"rgb": (3, 16, 16), "rgb8": (3, 8, 8), "gray": (1, 16, 16), "flat": (10,)}[kind]
    return Samples(rng.random((n, *shape)), rng.integers(0, 3, n), 3)


#: every registered model on a tiny input: (samples kind, settings)
MODELS = {
    "softmax": ("flat", {"l2": 1e-2}),
    "mlp": ("flat", {"hidden": [6]}),
    "2nn": ("gray", {}),
    "mnist_cnn": ("gray", {}),
    "lenet5": ("rgb", {"l2": 1e-3}),
    "cnn": ("rgb8", {}),
    "char_lstm": ("tokens", {"embedding": 3, "lstm_hidden": 5}),
    "resnet18": ("rgb8", {"resnet_width": 4, "norm_groups": 2}),
}


def build(name: str, n: int = sum(SIZES)):
    kind, settings = MODELS[name]
    s = samples(kind, n)
    problem = PROBLEMS[name].build(settings, samples=s)
    features = torch.as_tensor(s.features.reshape(n, -1))
    return problem, (features.double() if features.is_floating_point() else features), torch.as_tensor(s.labels)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_match_finite_differences(name):
    """⟨∇f(x), v⟩ = (f(x + εv) − f(x − εv))/2ε + O(ε²) along random unit directions, in fp64 (eval mode)."""
    problem, features, labels = build(name, 8)
    x = problem.init_params(torch.Generator().manual_seed(1), torch.float64)
    w = torch.rand(8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    g = problem.weighted_gradient(x, features, labels, w)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        v = torch.randn(problem.dim, dtype=torch.float64, generator=gen)
        v /= v.norm()
        eps = 1e-6
        fd = (
            problem.weighted_loss(x + eps * v, features, labels, w)
            - problem.weighted_loss(x - eps * v, features, labels, w)
        ) / (2 * eps)
        assert abs(float(g @ v) - float(fd)) <= 1e-6 * max(1.0, abs(float(fd))), (float(g @ v), float(fd))
    # the batched (per-client) gradient is the same derivative: rows = two clients' weighted minibatches
    rows = torch.stack([x, x])
    batched = problem.batched_gradient(
        rows, features.reshape(2, 4, -1), labels.reshape(2, 4, *labels.shape[1:]), w.reshape(2, 4)
    )
    assert_relative_close(batched.sum(0), g, 1e-12)


def dataset(name: str) -> tuple:
    problem, features, labels = build(name)
    parts = np.split(np.arange(sum(SIZES)), np.cumsum(SIZES)[:-1])
    return problem, FederatedDataset(features, labels, parts, objective_weights(np.array(SIZES), "size"))


def trajectory(name: str, executor, method: str = "fedavg_rr", rounds: int = 2, **settings):
    problem, data = dataset(name)
    algorithm = build_flat(method, {"lr": 0.05, "epochs": 1, "batch_size": 2, **settings})
    return params_trajectory(
        Simulation(problem, data, algorithm, UniformWithoutReplacement(len(SIZES), 3), seed=4, executor=executor),
        rounds,
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_executors_give_the_same_trajectory(name):
    """Sequential (one client at a time), vectorized (chunks of 2 and the whole cohort) and threaded (2 clients at a
    time) agree to 1e-10 in fp64; threaded refuses a module with dropout, naming the executors it accepts."""
    reference = trajectory(name, SequentialExecutor())
    assert torch.isfinite(reference).all() and not torch.equal(reference[0], reference[1])
    assert_relative_close(trajectory(name, VectorizedExecutor(chunk_size=2)), reference, 1e-10)
    assert_relative_close(trajectory(name, VectorizedExecutor()), reference, 1e-10)
    threads = torch.get_num_threads()
    if dataset(name)[0].stochastic:
        with pytest.raises(
            ConfigError,
            match="run.executor: 'threaded' cannot run .*dropout.*accepted for it: sequential, vectorized, ray",
        ):
            trajectory(name, ThreadedExecutor(2))
    else:
        assert_relative_close(trajectory(name, ThreadedExecutor(2)), reference, 1e-10)
    assert torch.get_num_threads() == threads  # the operator threads are given back


@pytest.mark.parametrize("name", sorted(MODELS))
def test_in_place_step_equals_the_flat_step(name):
    """A plain local step done in place (modules: piece by piece on the parameters) is y − η·g of the flat gradient,
    per client, with padding rows, the l2 term (λ = 0.1) and each client's own step size and dropout seed."""
    problem, features, labels = build(name, 8)
    problem.l2 = 0.1
    gen = torch.Generator().manual_seed(7)
    y = torch.stack([problem.init_params(gen, torch.float64) for _ in range(2)])
    f, lab = features.reshape(2, 4, *features.shape[1:]), labels.reshape(2, 4, *labels.shape[1:])
    w = torch.tensor([[0.25] * 4, [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    lrs, seeds = torch.tensor([[0.1], [0.3]], dtype=torch.float64), [3, 4]
    expected = y - lrs * problem.local_gradient(y, f, lab, w, seeds)
    problem.descend(y, f, lab, w, lrs, seeds)
    assert_relative_close(y, expected, 1e-12)


@pytest.mark.parametrize(
    "settings", [{}, {"local_momentum": 0.5, "clip_norm": 1.0, "weight_decay": 1e-2}, {"prox_mu": 0.5}]
)
def test_sequential_fast_path_gives_the_reference_trajectory(settings):
    """The sequential executor on a dropout CNN, with the in-place step, against the flat reference step (y − η·d of
    the assembled gradient) — with and without step transforms (clip, weight decay, momentum, prox)."""
    from fedshuffle.problems.base import Problem

    problem, data = dataset("cnn")
    algorithm = build_flat("fedavg", {"lr": 0.05, "steps": 3, "batch_size": 2, **settings})
    fast = params_trajectory(
        Simulation(
            problem, data, algorithm, UniformWithoutReplacement(len(SIZES), 3), seed=4, executor=SequentialExecutor()
        ),
        2,
    )
    problem.descend = lambda *args: Problem.descend(problem, *args)
    reference = params_trajectory(
        Simulation(
            problem, data, algorithm, UniformWithoutReplacement(len(SIZES), 3), seed=4, executor=SequentialExecutor()
        ),
        2,
    )
    assert not torch.equal(reference[0], reference[1])
    assert_relative_close(fast, reference, 1e-10)


@pytest.mark.parametrize(
    "method, settings",
    [
        ("scaffold", {"option": "I"}),
        ("fedshuffle_mvr", {}),
        ("fedavg", {"steps": 3, "local_momentum": 0.5, "clip_norm": 1.0}),
    ],
)
def test_stateful_methods_with_dropout_agree_across_executors(method, settings):
    """Full local gradients (eval mode) and center gradients (FedShuffleMVR, same dropout mask) of a dropout CNN."""
    reference = trajectory("cnn", SequentialExecutor(), method, **settings)
    assert_relative_close(trajectory("cnn", VectorizedExecutor(chunk_size=2), method, **settings), reference, 1e-10)


def test_dropout_masks_follow_the_step_seed():
    """Train-mode gradients of the dropout CNN depend on the seed only; eval-mode gradients have no dropout."""
    problem, features, labels = build("cnn", 4)
    assert problem.stochastic
    x = problem.init_params(torch.Generator().manual_seed(0), torch.float64).unsqueeze(0)
    f, y, w = features.reshape(1, 4, -1), labels.reshape(1, 4), torch.full((1, 4), 0.25, dtype=torch.float64)
    a, b, c = (problem.local_gradient(x, f, y, w, [s]) for s in (11, 11, 12))
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert not torch.allclose(a, problem.batched_gradient(x, f, y, w))
    torch.manual_seed(5)
    state = torch.get_rng_state()
    problem.local_gradient(x, f, y, w, [13])
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left as it was


def test_vmap_path_equals_the_per_client_path():
    """vectorize=True (one vmap over clients, used on CUDA) gives the loop's gradients, padding rows included."""
    problem, features, labels = build("lenet5", 6)
    vectorized = ModuleProblem(problem.module, sample_shape=problem.sample_shape, l2=problem.l2, vectorize=True)
    x = problem.init_params(torch.Generator().manual_seed(0), torch.float64)
    rows = torch.stack([x, 2 * x])
    w = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    f, y = features.reshape(2, 3, -1), labels.reshape(2, 3)
    assert_relative_close(vectorized.local_gradient(rows, f, y, w), problem.local_gradient(rows, f, y, w), 1e-12)


class TiedNet(torch.nn.Module):
    """A user's model: a tied embedding/output matrix, a constant buffer, dropout and a frozen layer."""

    def __init__(self, features: int = 10, classes: int = 3, width: int = 16) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(features, width)
        self.proj = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, classes, bias=False)
        self.back = torch.nn.Linear(width, classes, bias=False)
        self.back.weight = self.head.weight  # tied
        self.frozen = torch.nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.tensor(2.0))
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        h = torch.tanh(self.inp(x) * self.scale)
        h = self.drop(torch.tanh(self.proj(h) + 0.1 * self.frozen(h)))
        return self.head(h) + 0.5 * self.back(torch.tanh(h))


def test_a_user_module_trains_through_the_python_api():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 10)) * 2
    labels = rng.integers(0, 3, 240)
    features = torch.tensor(centers[labels] + rng.normal(size=(240, 10)))
    parts = np.array_split(rng.permutation(240), 8)
    data = FederatedDataset(
        features, torch.tensor(labels), parts, objective_weights(np.array([len(p) for p in parts]), "size")
    )
    problem = ModuleProblem(TiedNet())
    head = problem.module.head.weight.numel()
    assert (
        problem.dim == sum(p.numel() for p in problem.module.parameters() if p.requires_grad)
        and "back.weight" not in problem.names
    )
    assert problem.dim == 10 * 16 + 16 + 16 * 16 + 16 + head
    sim = Simulation(
        problem, data, build_flat("fedavg_rr", {"lr": 0.1, "batch_size": 10}), UniformWithoutReplacement(8, 4), seed=0
    )
    s = data.sample_weights()
    before = float(problem.weighted_loss(sim.params, data.features, data.labels, s))
    for _ in range(10):
        sim.step()
    assert float(problem.weighted_loss(sim.params, data.features, data.labels, s)) < 0.5 * before
    assert problem.accuracy(sim.params, data.features, data.labels) > 0.9
    assert float(problem.module.scale) == 2.0  # buffers are constants
    copy = pickle.loads(pickle.dumps(problem))  # as the Ray executor ships it
    assert torch.equal(
        copy.weighted_gradient(sim.params, data.features, data.labels, s),
        problem.weighted_gradient(sim.params, data.features, data.labels, s),
    )


def test_batchnorm_is_refused_and_converted_to_groupnorm():
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 14 * 14, 2),
    )
    with pytest.raises(ConfigError, match=r"BatchNorm2d at '1'.*GroupNorm"):
        ModuleProblem(net)
    problem = ModuleProblem(batchnorm_to_groupnorm(net, groups=2), sample_shape=(3, 16, 16))
    assert isinstance(problem.module[1], torch.nn.GroupNorm) and problem.module[1].num_groups == 2
    with pytest.raises(ConfigError, match="one loss per sample"):
        x = problem.init_params(torch.Generator().manual_seed(0), torch.float64)
        ModuleProblem(net, torch.nn.CrossEntropyLoss(), sample_shape=(3, 16, 16)).weighted_loss(
            x, torch.rand(2, 768, dtype=torch.float64), torch.tensor([0, 1]), torch.ones(2, dtype=torch.float64)
        )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_follows_the_parameters_device(name):
    """``run.device = "cuda"`` is a valid setting for every model, and the model runs where its parameters are
    (checked on PyTorch's data-less "meta" device: the module, inputs and outputs all move there)."""
    kind, settings = MODELS[name]
    spec = validate(RunSpec, {"problem": {"name": name, **settings}, "run": {"device": "cuda"}})
    assert spec.run.device == "cuda" and spec.problem.name == name
    problem, features, labels = build(name, 4)
    x = problem.init_params(torch.Generator().manual_seed(0), torch.float64).to("meta")
    w = torch.full((4,), 0.25, dtype=torch.float64, device="meta")
    assert problem.weighted_loss(x, features.to("meta"), labels.to("meta"), w).device.type == "meta"
    assert problem.weighted_gradient(x, features.to("meta"), labels.to("meta"), w).device.type == "meta"
