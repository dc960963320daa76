"""One-pass evaluation: every problem's scores (f, ‖∇f‖², accuracy; test loss and accuracy) equal, to 1e-12 in
float64, the five separate passes they replace — weighted loss, autodiff gradient, accuracy, test losses' mean
and test accuracy — computed here the old way."""

import numpy as np
import pytest
import torch
from torch.func import grad

from fedshuffle import metrics
from fedshuffle.data import FederatedDataset, contiguous_partition, objective_weights
from fedshuffle.problems import MLP, CharLSTM, LogisticRegression, ModuleProblem, Quadratic, SoftmaxRegression, lenet5

SIZES = [7, 11, 14]


def dataset(features: torch.Tensor, labels: torch.Tensor, test_features=None, test_labels=None) -> FederatedDataset:
    sizes = np.array(SIZES)
    return FederatedDataset(
        features,
        labels,
        contiguous_partition(SIZES),
        objective_weights(sizes, "size"),
        test_features=test_features,
        test_labels=test_labels,
    )


def cases():
    g = torch.Generator().manual_seed(0)
    n, d, k = sum(SIZES), 6, 4
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    xt = torch.randn(9, d, generator=g, dtype=torch.float64)
    classes, test_classes = torch.randint(0, k, (n,), generator=g), torch.randint(0, k, (9,), generator=g)
    signs = torch.randint(0, 2, (n,), generator=g) * 2.0 - 1
    test_signs = torch.randint(0, 2, (9,), generator=g) * 2.0 - 1
    images = torch.randn(n, 3 * 16 * 16, generator=g, dtype=torch.float64)
    test_images = torch.randn(5, 3 * 16 * 16, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 7, (n, 5), generator=g).double()
    test_tokens = torch.randint(0, 7, (4, 5), generator=g).double()
    next_tokens, test_next = (
        torch.randint(-1, 7, (n, 5), generator=g),
        torch.randint(0, 7, (4, 5), generator=g),
    )  # -1: padding, not scored
    yield "quadratic", Quadratic(d), dataset(x, torch.zeros(n))
    yield "logistic", LogisticRegression(d, 0.3), dataset(x, signs.double(), xt, test_signs.double())
    yield "softmax", SoftmaxRegression(d, k, 0.2), dataset(x, classes, xt, test_classes)
    yield "mlp", MLP(d, (5, 3), k, 0.1), dataset(x, classes, xt, test_classes)
    lenet = ModuleProblem(lenet5((3, 16, 16), k), sample_shape=(3, 16, 16), l2=0.05, eval_batch=10)
    yield "lenet5 (slices of 10)", lenet, dataset(images, classes, test_images, test_classes[:5])
    lstm = ModuleProblem(CharLSTM(7, embedding=3, hidden=4, layers=1), l2=0.01, eval_batch=8)
    yield "char_lstm", lstm, dataset(tokens, next_tokens, test_tokens, test_next)


def old_scores(problem, data, params):
    """The five passes of the evaluation before it was one pass (the generic autodiff gradient)."""
    s = data.sample_weights()
    X, Y = data.features, data.labels
    out = {
        "loss": float(problem.weighted_loss(params, X, Y, s)),
        "grad_norm_sq": float(grad(lambda p: (problem.losses(p, X, Y) * s).sum())(params).pow(2).sum()),
        "train_accuracy": problem.accuracy(params, X, Y),
    }
    if data.test_features is not None:
        out["test_loss"] = float(problem.losses(params, data.test_features, data.test_labels).mean())
        out["test_accuracy"] = problem.accuracy(params, data.test_features, data.test_labels)
    return out


def in_chunks_of(problem, rows: int) -> list[int]:
    """Make ``problem`` score in chunks of ``rows`` samples; returns the list its chunks' sizes are appended to."""
    sizes: list[int] = []
    if isinstance(problem, ModuleProblem):
        problem.eval_batch = rows
        evaluate = problem._evaluate
        problem._evaluate = lambda params, features, labels, each, index=None: evaluate(
            params, features, labels, lambda b, o, i: (sizes.append(o.shape[0]), each(b, o, i)), index
        )
        return sizes
    chunk_scores = problem.chunk_scores
    problem.chunk_rows = lambda features: rows

    def counted(params, features, *rest):
        sizes.append(features.shape[0])
        return chunk_scores(params, features, *rest)

    problem.chunk_scores = counted
    return sizes


@pytest.mark.parametrize("chunk", [None, 4], ids=["one chunk", "chunks of 4"])
@pytest.mark.parametrize("name, problem, data", list(cases()), ids=[c[0] for c in cases()])
def test_one_pass_scores_equal_the_separate_passes(name, problem, data, chunk):
    """Also in chunks of 4 samples (train and test sets of 32 and 9 samples: 8 and 3 chunks), the sums added chunk
    by chunk."""
    params = problem.init_params(torch.Generator().manual_seed(1), torch.float64) + 0.1 * torch.randn(
        problem.dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    expected = old_scores(problem, data, params)
    sizes = in_chunks_of(problem, chunk) if chunk else []
    got = metrics.ModelScores(problem, data)(params)
    if chunk:
        test_rows = 0 if data.test_features is None else data.test_features.shape[0]
        assert max(sizes) == chunk and sum(sizes) == data.features.shape[0] + test_rows
    for key, value in expected.items():
        if value is None:
            assert got[key] is None, key
        else:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-14), f"{name}: {key}"
    assert expected["grad_norm_sq"] > 1e-6  # the gradient compared is not trivially zero
    if data.test_features is not None:
        assert set(expected) == {"loss", "grad_norm_sq", "train_accuracy", "test_loss", "test_accuracy"}
        assert 0.0 <= got["test_accuracy"] <= 1.0


def test_scores_without_the_gradient_skip_it():
    problem = SoftmaxRegression(3, 3, 0.1)
    data = dataset(torch.randn(sum(SIZES), 3, dtype=torch.float64), torch.randint(0, 3, (sum(SIZES),)))
    scores = problem.scores(
        torch.zeros(problem.dim, dtype=torch.float64), data.features, data.labels, data.sample_weights(), gradient=False
    )
    assert scores.grad_norm_sq is None and scores.loss == pytest.approx(
        np.log(3), rel=1e-12
    )  # uniform softmax: CE = log K


def test_a_run_without_the_gradient_norm_leaves_only_that_column_empty(tmp_path):
    """run.grad_norm = false: grad_norm_sq empty in every row, every other metric the same bits as with it."""
    import fedshuffle as fs

    config = {
        "problem": {"name": "mlp", "hidden": [4]},
        "data": {"source": "synthetic", "samples": 120, "features": 5, "classes": 3, "partition": "iid", "clients": 4},
        "local": {"lr": 0.1},
        "sampler": {"name": "full"},
        "run": {"rounds": 4, "eval_every": 2, "executor": "vectorized"},
    }
    runs = {}
    for flag in (True, False):
        config["run"]["grad_norm"] = flag
        runs[flag] = fs.experiment(config).run(tmp_path / str(flag), seeds=[0], progress=False).curves
    with_norm, without = runs[True], runs[False]
    assert with_norm["grad_norm_sq"].notna().all() and without["grad_norm_sq"].isna().all()
    for column in ("loss", "train_accuracy", "round", "sample_gradients"):
        assert with_norm[column].tolist() == without[column].tolist(), column


# -- x* cached by the run's settings ------------------------------------------------------------------


def test_the_solution_key_follows_the_settings_that_make_the_data_and_the_problem():
    from fedshuffle.problems.solution import solution_key

    spec = {
        "problem": {"name": "logistic", "l2": 0.1},
        "data": {"source": "libsvm", "dataset": "a3a", "seed": 0, "data_dirs": []},
        "run": {"dtype": "float64", "seed": 3},
    }

    def changed(section, key, value, files=None):
        return solution_key({**spec, section: {**spec[section], key: value}}, files or {})

    key = solution_key(spec, {})
    assert (
        key == changed("data", "data_dirs", ["/elsewhere"]) == changed("run", "seed", 4)
    )  # where data is looked for, the run's seed: same x*
    assert (
        len(
            {
                key,
                changed("data", "seed", 1),
                changed("problem", "l2", 0.2),
                changed("run", "dtype", "float32"),
                solution_key(spec, {"data.path": "ab" * 32}),
            }
        )
        == 5
    )
    unseeded = {**spec, "data": {**spec["data"], "seed": None}}  # split by the run's seed: one x* per seed
    assert solution_key(unseeded, {}) != solution_key({**unseeded, "run": {**spec["run"], "seed": 4}}, {})


def test_a_cached_solution_is_found_by_its_key_without_reading_the_data(monkeypatch):
    from fedshuffle.problems import solution as cache

    problem = LogisticRegression(6, 0.3)
    data = next(case[2] for case in cases() if case[0] == "logistic")
    solved = cache.solution(problem, data, "config-test")
    assert float(problem.weighted_gradient(solved[0], data.features, data.labels, data.sample_weights()).norm()) < 1e-12
    cache._SOLUTIONS.clear()
    monkeypatch.setattr(FederatedDataset, "to", lambda *a: pytest.fail("the dataset was copied although x* is cached"))
    again = cache.solution(problem, data, "config-test")  # from <cache>/solutions/config-test.npz
    assert torch.equal(again[0], solved[0]) and again[1] == solved[1]


# -- the rows scored: those that clients hold ----------------------------------------------------------


def test_the_train_metrics_score_the_rows_clients_hold_and_no_other():
    """A training tensor with rows that no client holds (weight 0): f, ‖∇f‖² and the train accuracy are those of the
    same clients' samples alone, the accuracy counting each held sample once (here 2 of the 3 unheld rows are
    classified right and every held one wrong, so counting them would move the accuracy)."""
    problem = SoftmaxRegression(2, 2, 0.1)
    params = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0], dtype=torch.float64)  # class 0 where x_0 > x_1
    held = torch.tensor([[1.0, 0.0], [2.0, 0.5], [0.0, 1.0], [0.5, 3.0]], dtype=torch.float64)
    held_labels = torch.tensor([1, 1, 0, 0])  # all wrong
    unheld = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 0.0]], dtype=torch.float64)
    features = torch.cat([unheld[:1], held[:2], unheld[1:], held[2:]])
    labels = torch.cat([torch.tensor([0]), held_labels[:2], torch.tensor([1, 1]), held_labels[2:]])
    clients = [np.array([1, 2]), np.array([5, 6])]  # rows 0, 3, 4 belong to no client
    sparse = FederatedDataset(features, labels, clients, objective_weights(np.array([2, 2]), "size"))
    weights = objective_weights(np.array([2, 2]), "size")
    compact = FederatedDataset(held, held_labels, [np.array([0, 1]), np.array([2, 3])], weights)
    assert sparse.held_rows().tolist() == [1, 2, 5, 6] and compact.held_rows() is None
    got, expected = metrics.ModelScores(problem, sparse)(params), metrics.ModelScores(problem, compact)(params)
    assert got["train_accuracy"] == expected["train_accuracy"] == 0.0
    assert problem.accuracy(params, features, labels) == pytest.approx(2 / 7)  # all rows: the unheld ones would count
    for key in ("loss", "grad_norm_sq"):
        assert got[key] == pytest.approx(expected[key], rel=1e-14)


def test_a_partition_that_leaves_samples_out_builds_a_training_tensor_of_the_clients_samples_only():
    """``equal`` gives ⌊N/M⌋ samples to each client: the remainder is not in the training tensor, and each client holds
    the samples (rows of the source, by their features) that it held when the remainder was kept."""
    from fedshuffle.data.catalog import PARTITIONS, federate, load_samples

    settings = {
        "source": "synthetic",
        "samples": 103,
        "features": 4,
        "classes": 3,
        "partition": "equal",
        "clients": 5,
        "seed": 7,
    }
    samples, rng = load_samples(settings, 0)
    data = federate(samples, settings, rng)
    assert data.features.shape[0] == data.num_samples == 100 and data.held_rows() is None
    source = torch.as_tensor(samples.features.reshape(len(samples.features), -1))
    _, replay = load_samples(settings, 0)  # the split's own draws again: the shuffle, then ⌊N/M⌋ samples each
    train = replay.permutation(103)
    parts = PARTITIONS["equal"].build({"clients": 5}, labels=samples.labels[train], rng=replay, label_groups=None)
    for client, part in enumerate(parts):
        assert torch.equal(data.features[data.client_indices[client]], source[train[part]])
