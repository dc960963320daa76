"""Datasets with natural clients: FedProx's Synthetic(α, β) and LEAF's per-user JSON (FEMNIST)."""

import gzip
import json

import numpy as np
import pytest

from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.experiments.build import build_problem_and_data
from fedshuffle.data.sources.leaf import load_leaf
from fedshuffle.data.sources.synthetic import FedProxSynthetic
from fedshuffle.core.errors import ConfigError, DataError


def test_device_sizes_follow_floor_lognormal_4_2_plus_50():
    extra = FedProxSynthetic(0, 0, 40_000, seed=3).sizes - 50
    q1, median, q3 = np.percentile(extra, [25, 50, 75])
    # N(4, 2) quartiles are 4 ∓ 1.349: e^2.651 = 14.2, e^4 = 54.6, e^5.349 = 210.4 (floored)
    assert 13 <= q1 <= 15.5 and 52 <= median <= 57 and 200 <= q3 <= 222 and extra.min() >= 0


@pytest.mark.parametrize("alpha, beta", [(0.5, 0.5), (1.0, 1.0)])
def test_alpha_and_beta_are_standard_deviations_and_parameters_have_their_laws(alpha, beta):
    gen = FedProxSynthetic(alpha, beta, 3000, seed=1)
    params = [gen.parameters(k) for k in range(3000)]
    u, big_b = np.array([p["u"] for p in params]), np.array([p["B"] for p in params])
    assert np.std(u) == pytest.approx(alpha, rel=0.05) and np.std(big_b) == pytest.approx(beta, rel=0.05)
    w_offsets = np.array([p["W"].mean() - p["u"] for p in params])  # mean of 600 N(u, 1) entries
    v_offsets = np.array([p["v"].mean() - p["B"] for p in params])  # mean of 60 N(B, 1) entries
    assert np.std(w_offsets) == pytest.approx(1 / np.sqrt(600), rel=0.06) and np.std(v_offsets) == pytest.approx(
        1 / np.sqrt(60), rel=0.06
    )


def test_features_have_covariance_diag_j_pow_minus_1_2_and_labels_are_the_argmax():
    gen = FedProxSynthetic(1.0, 1.0, 200, seed=2)
    residuals = np.concatenate([gen.device(k)[0] - gen.parameters(k)["v"] for k in range(200)])
    np.testing.assert_allclose(residuals.var(axis=0), np.arange(1, 61) ** -1.2, rtol=0.05)
    for k in (0, 7):
        x, y = gen.device(k)
        p = gen.parameters(k)
        assert np.array_equal(y, np.argmax(x @ p["W"] + p["b"], axis=1))
        assert (
            len(gen.train(k)[1]) == int(0.9 * gen.sizes[k])
            and len(gen.train(k)[1]) + len(gen.test(k)[1]) == gen.sizes[k]
        )


def test_iid_variant_shares_one_model_and_one_input_law():
    gen = FedProxSynthetic(0, 0, 400, seed=5, iid=True)
    assert np.array_equal(gen.parameters(0)["W"], gen.parameters(399)["W"])
    hist = lambda devices: (
        np.bincount(np.concatenate([gen.device(k)[1] for k in devices]), minlength=10) / sum(gen.sizes[list(devices)])
    )  # noqa: E731
    assert 0.5 * np.abs(hist(range(0, 200)) - hist(range(200, 400))).sum() < 0.03  # the same class balance everywhere
    non_iid = FedProxSynthetic(1, 1, 400, seed=5)
    h = lambda devices: (
        np.bincount(np.concatenate([non_iid.device(k)[1] for k in devices]), minlength=10)
        / sum(non_iid.sizes[list(devices)])
    )  # noqa: E731
    assert 0.5 * np.abs(h([0]) - h([1])).sum() > 0.2  # devices disagree without IID


def test_devices_are_generated_independently_of_the_population():
    small, large = FedProxSynthetic(1, 1, 10, seed=9), FedProxSynthetic(1, 1, 100_000, seed=9)
    assert np.array_equal(small.sizes, large.sizes[:10])
    for a, b in zip(small.device(3), large.device(3)):
        assert np.array_equal(a, b)
    with pytest.raises(ConfigError, match="data.synthetic_alpha"):
        FedProxSynthetic(-1, 0, 10)


def write_leaf(folder, users, gz=False, broken=None):
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
        data = {
            "users": list(users),
            "num_samples": [len(v[1]) for v in users.values()],
            "user_data": {u: {"x": v[0], "y": v[1]} for u, v in users.items()},
        }
        text = json.dumps(data, indent=1)
        path = folder / split / ("d.json.gz" if gz else "d.json")
        path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    if broken:
        (folder / "train" / "z.json").write_text(broken)


def test_leaf_fixture_loads_users_as_clients(tmp_path):
    users = {"w2": ([[0.1, 0.2], [0.3, 0.4]], [1, 0]), "w1": ([[1.0, 0.0]], [2])}
    write_leaf(tmp_path / "leaf", users, gz=True)
    names, train, (test_x, test_y) = load_leaf(tmp_path / "leaf")
    assert names == ["w1", "w2"] and [len(y) for _, y in train] == [1, 2] and test_x.shape == (3, 2)
    assert load_leaf(tmp_path / "leaf", max_users=1)[0] == ["w1"]


@pytest.mark.parametrize(
    "broken, message",
    [
        ('{"users": ["a"], "user_data": {"a": {"x": [[1]], \n "y": [0]', "line 2"),
        ('{"users": ["a"], "user_data": {}}', "user 'a' is listed but has no x/y data"),
        ('{"users": ["a"], "user_data": {"a": {"x": [[1], [2]], "y": [0]}}}', "2 samples of x"),
        ('{"users": ["a"], "user_data": {"a": {"x": [[NaN]], "y": [0]}}}', "NaN"),
        ("[1, 2]", "not a LEAF file"),
    ],
)
def test_malformed_leaf_files_name_the_file(tmp_path, broken, message):
    write_leaf(tmp_path / "leaf", {"w": ([[0.0]], [0])}, broken=broken)
    with pytest.raises(DataError) as err:
        load_leaf(tmp_path / "leaf")
    assert "z.json" in err.value.field and message in str(err.value)


def test_missing_test_folder_is_named(tmp_path):
    write_leaf(tmp_path / "leaf", {"w": ([[0.0]], [0])})
    for p in (tmp_path / "leaf" / "test").iterdir():
        p.unlink()
    (tmp_path / "leaf" / "test").rmdir()
    with pytest.raises(DataError, match="needs train/ and test/"):
        load_leaf(tmp_path / "leaf")


def test_femnist_offline_copy(shared_data):
    spec = validate(
        RunSpec,
        {"problem": {"name": "mlp", "hidden": [128]}, "data": {"source": "leaf", "path": str(shared_data / "femnist")}},
    )
    problem, data = build_problem_and_data(spec)
    assert data.num_clients == 105 and data.num_samples == 14708 and data.test_features.shape == (1685, 784)
    assert problem.widths == [784, 128, 62]  # the data has 62 classes (digits, upper and lower case)
