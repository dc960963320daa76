"""Hardening: AdGD without curvature information, loaders that check what they read, memory estimates
that refuse sizes before anything is allocated."""

import math

import numpy as np
import pytest
import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.server import SERVER_OPTIMIZERS


# --- AdGD (Malitsky & Mishchenko 2020) when ‖Δx‖ = 0 or ‖Δg‖ = 0 -------------------------------------------


def adgd_steps(directions, params_seq, lr=0.5):
    server = SERVER_OPTIMIZERS["adgd"].factory(lr=lr)
    state = server.init(torch.as_tensor(params_seq[0], dtype=torch.float64))
    out = []
    for g, x in zip(directions, params_seq):
        step, state = server.update(
            torch.as_tensor(g, dtype=torch.float64), state, torch.as_tensor(x, dtype=torch.float64)
        )
        out.append((step, float(state["lr"]), float(state["theta"])))
    return out


def test_adgd_follows_the_paper_when_both_differences_are_nonzero():
    """λ₁ = ‖x₁ − x₀‖/(2‖g₁ − g₀‖) (θ₀ = +∞); λ₂ = min{√(1+θ₁)λ₁, ‖Δx‖/(2‖Δg‖)}; x ← x − λg."""
    g = [[1.0, 0.0], [0.5, 0.0], [0.4, 0.1]]
    x = [[0.0, 0.0], [-0.5, 0.0], [-0.75, 0.0]]
    (s0, l0, _), (s1, l1, t1), (s2, l2, t2) = adgd_steps(g, x)
    assert l0 == 0.5 and torch.allclose(s0, 0.5 * torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert l1 == pytest.approx(0.5 / (2 * 0.5)) and t1 == pytest.approx(l1 / l0)
    expected = min(math.sqrt(1 + t1) * l1, 0.25 / (2 * math.hypot(0.1, 0.1)))
    assert l2 == pytest.approx(expected) and t2 == pytest.approx(l2 / l1)
    assert torch.allclose(s2, l2 * torch.tensor([0.4, 0.1], dtype=torch.float64))


@pytest.mark.parametrize("case", ["model_stopped", "direction_constant", "both_zero", "underflow"])
def test_adgd_keeps_the_previous_step_without_curvature_information(case):
    """‖Δx‖ = 0 or ‖Δg‖ = 0: λ_k = λ_{k−1}, θ_k = 1, finite steps, no division by zero — also for many
    rounds in a row, where the previous code divided 0 by 0."""
    first_g, first_x = [1.0, 2.0], [0.0, 0.0]
    if case == "model_stopped":  # Δx = 0, Δg ≠ 0
        g, x = [first_g, [3.0, -1.0], [0.0, 5.0], [1.0, 1.0]], [first_x] * 4
    elif case == "direction_constant":  # Δg = 0, Δx ≠ 0: f linear along the step; +∞ here would mean λ = +∞
        g, x = [first_g] * 4, [[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]
    elif case == "both_zero":
        g, x = [[0.0, 0.0]] * 4, [first_x] * 4
    else:  # the ratio underflows to 0
        g = [first_g, [1e300, 0.0], [1e300, 1e300], [0.0, 1e300]]
        x = [[0.0, 0.0], [1e-300, 0.0], [2e-300, 0.0], [3e-300, 0.0]]
    steps = adgd_steps(g, x, lr=0.25)
    for step, lam, theta in steps[1:]:
        assert lam == 0.25 and theta == 1.0 and torch.isfinite(step).all()


def test_nastya_with_adgd_runs_to_the_end_once_the_model_stops_moving(tmp_path):
    """The reported failure: Nastya + AdGD on a 100-sample logistic problem reaches a floating-point fixed
    point (x_{k+1} = x_k exactly) and used to end in ZeroDivisionError; now it completes near x*."""
    from fedshuffle.experiments.runner import run_single
    from fedshuffle.experiments.schema import RunSpec, validate

    spec = validate(
        RunSpec,
        {
            "method": {"name": "nastya"},
            "local": {"lr": 0.01},
            "server": {"optimizer": "adgd", "lr": 0.5},
            "problem": {"name": "logistic", "l2": 0.1},
            "data": {"source": "synthetic", "samples": 100, "features": 3, "clients": 4, "partition": "iid"},
            "run": {"rounds": 60, "eval_every": 20},  # x stops moving at round 45
        },
    )
    outcome = run_single(spec, tmp_path / "run", seed=0)
    assert outcome.status == "complete" and 0 <= outcome.final["f_gap"] < 1e-4
    params = np.load(tmp_path / "run" / "final_params.npy")
    assert np.isfinite(params).all()


# --- loaders: one-line errors naming the file and the record ---------------------------------------------

import json

from fedshuffle.core import limits
from fedshuffle.core.errors import DataError
from fedshuffle.data.sources.arrays import load_npz, load_targets
from fedshuffle.data.sources.leaf import load_leaf
from fedshuffle.data.sources.libsvm import read_svmlight


def leaf_folder(root, train, test=None, extra=None):
    """A LEAF folder: ``train``/``test`` map user → (x, y); ``extra`` maps file name → raw JSON text in train/."""
    for split, users in (("train", train), ("test", test if test is not None else train)):
        (root / split).mkdir(parents=True, exist_ok=True)
        body = {
            "users": list(users),
            "num_samples": [len(v[1]) if isinstance(v[1], list) else 1 for v in users.values()],
            "user_data": {u: {"x": v[0], "y": v[1]} for u, v in users.items()},
        }
        (root / split / "a.json").write_text(json.dumps(body))
    for name, text in (extra or {}).items():
        (root / "train" / name).write_text(text)
    return root


GOOD = {"u1": ([[0.0, 1.0], [1.0, 0.0]], [0, 1]), "u2": ([[0.5, 0.5]], [2])}


def one_line(exc):
    return "\n" not in str(exc.value) and "Traceback" not in str(exc.value)


@pytest.mark.parametrize(
    "labels, message",
    [
        ([0.0, 1.5], "y[1] = 1.5: labels must be integers"),
        ([-1, 0], "y[0] = -1"),
        (3, "one integer per sample"),
        ([[0], [1]], "one integer per sample"),
        ([True, False], "booleans"),
        (["0", "1"], "labels must be integers"),
    ],
)
def test_leaf_labels_must_be_class_indices_never_truncated(tmp_path, labels, message):
    folder = leaf_folder(tmp_path, {"u1": ([[0.0], [1.0]], labels)})
    with pytest.raises(DataError) as exc:
        load_leaf(folder)
    assert (
        "a.json" in exc.value.field
        and "user 'u1'" in exc.value.field
        and message in exc.value.message
        and one_line(exc)
    )


def test_leaf_integral_float_labels_are_classes(tmp_path):
    _, train, _ = load_leaf(leaf_folder(tmp_path, {"u1": ([[0.0], [1.0]], [0.0, 2.0])}))
    assert train[0][1].dtype == np.int64 and train[0][1].tolist() == [0, 2]


def test_a_leaf_user_listed_twice_is_refused(tmp_path):
    twice = leaf_folder(tmp_path / "same", GOOD)
    body = json.loads((twice / "train" / "a.json").read_text())
    body["users"].append("u1")
    (twice / "train" / "a.json").write_text(json.dumps(body))
    with pytest.raises(DataError, match="listed twice") as exc:
        load_leaf(twice)
    assert "user 'u1'" in exc.value.field
    other = leaf_folder(
        tmp_path / "files",
        GOOD,
        extra={"b.json": json.dumps({"users": ["u2"], "user_data": {"u2": {"x": [[1.0, 2.0]], "y": [0]}}})},
    )
    with pytest.raises(DataError, match=r"listed twice \(also in .*a\.json\)") as exc:
        load_leaf(other)
    assert "b.json" in exc.value.field


@pytest.mark.parametrize(
    "fault, message",
    [
        ({"users": [["u"]], "user_data": {}}, "user names must be strings"),
        ({"users": ["u"], "user_data": {"u": {"x": [[]], "y": [0]}}}, "at least one feature"),
        ({"users": ["u"], "user_data": {"u": {"x": [[1.0], [1.0, 2.0]], "y": [0, 1]}}}, "equally long rows"),
        ({"users": ["u"], "user_data": {"u": {"x": [["a"]], "y": [0]}}}, "rows of numbers"),
        ({"users": ["u"], "user_data": {"u": {"x": [[1e39]], "y": [0]}}}, "float32"),
        ({"users": ["u"], "user_data": {"u": {"x": 5, "y": [0]}}}, "list of samples"),
        ({"users": ["u"], "num_samples": [3], "user_data": {"u": {"x": [[1.0]], "y": [0]}}}, "num_samples says 3"),
    ],
)
def test_malformed_leaf_users_are_refused_with_file_and_user(tmp_path, fault, message):
    folder = leaf_folder(tmp_path, GOOD, extra={"b.json": json.dumps(fault)})
    with pytest.raises(DataError) as exc:
        load_leaf(folder)
    assert "b.json" in exc.value.field and message in exc.value.message and one_line(exc)


def test_leaf_train_and_test_widths_must_agree(tmp_path):
    folder = leaf_folder(tmp_path, GOOD, test={"u1": ([[0.0, 1.0, 2.0]], [0])})
    with pytest.raises(DataError, match="test samples have 3 features but training samples have 2") as exc:
        load_leaf(folder)
    assert "test" in exc.value.field and "user 'u1'" in exc.value.field


def test_deeply_nested_leaf_json_is_refused(tmp_path):
    folder = leaf_folder(tmp_path, GOOD, extra={"b.json": "[" * 100_000 + "]" * 100_000})
    with pytest.raises(DataError, match="nested too deeply"):
        load_leaf(folder)


def npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    "x, y, message",
    [
        (np.ones((3, 2)) + 1j, np.array([0, 1, 0]), "complex"),
        (np.ones((3, 2)), np.array([0, 1, 0]) + 0j, "complex"),
        (np.ones((3, 0)), np.array([0, 1, 0]), "at least one feature"),
        (np.ones((3, 2, 0)), np.array([0, 1, 0]), "at least one feature"),
        (np.array([[1.0, np.inf], [0, 0], [0, 0]]), np.array([0, 1, 0]), "x[0]: features must be finite"),
        (np.ones((3, 2)), np.array([0, 1.5, 0]), "y[1] = 1.5"),
        (np.ones((3, 2)), np.array([0, 1, 0, 1]), "3 rows of features but 4 labels"),
        (np.ones((0, 2)), np.zeros(0, dtype=int), "no samples"),
    ],
)
def test_npz_contents_are_checked(tmp_path, x, y, message):
    with pytest.raises(ConfigError) as exc:
        load_npz(npz(tmp_path / "d.npz", x=x, y=y))
    assert message in str(exc.value) and one_line(exc)


def test_complex_and_zero_width_quadratic_targets_are_refused(tmp_path):
    np.save(tmp_path / "c.npy", np.eye(3) * (1 + 1j))
    np.save(tmp_path / "z.npy", np.ones((3, 0)))
    for name, message in (("c.npy", "complex"), ("z.npy", "at least one feature")):
        with pytest.raises(ConfigError, match=message) as exc:
            load_targets(tmp_path / name)
        assert name in exc.value.field and one_line(exc)


def forged_npy(path, shape):
    """A valid .npy header claiming ``shape`` of float64, followed by 8 bytes of data."""
    header = {"descr": "<f8", "fortran_order": False, "shape": shape}
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, header)
        fh.write(b"\0" * 8)
    return path


def test_an_npy_header_claiming_more_than_the_file_holds_is_refused_before_allocating(tmp_path):
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        load_targets(forged_npy(tmp_path / "big.npy", (10**12, 3)))


def test_an_npz_member_claiming_more_than_memory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(limits.ENV, "1M")
    x = np.zeros((40_000, 4))  # 1.2 MiB of float64: more than the 1 MiB allowed
    with pytest.raises(
        ConfigError, match=r"needs about .* more than the 1\.0 MiB available \(FEDSHUFFLE_MAX_MEMORY\)"
    ) as exc:
        load_npz(npz(tmp_path / "d.npz", x=x, y=np.zeros(40_000, dtype=int)))
    assert "d.npz, x" in exc.value.field


def svm(tmp_path, text):
    path = tmp_path / "f.svm"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, field, message",
    [
        ("", "f.svm", "empty"),
        ("1 1:0.5\n0.5 2:1\n", "line 2", "label 0.5 is not an integer"),
        ("1 1:0.5\n# note\n\n0 2:nan\n", "line 4", "finite"),
        ("1 1:1\n0 999999999:1\n", "line 2", "largest feature index 999999999"),
        ("1\n0\n", "f.svm", "every sample needs at least one"),
    ],
)
def test_svmlight_files_are_checked_line_by_line(tmp_path, text, field, message):
    with pytest.raises(DataError) as exc:
        read_svmlight(svm(tmp_path, text))
    assert field in exc.value.field and message in exc.value.message and one_line(exc)


def test_integral_svmlight_labels_still_map_to_zero_one(tmp_path):
    x, y = read_svmlight(svm(tmp_path, "+1 1:0.5\n-1 2:1\n+1.0 1:2\n"))
    assert y.tolist() == [1, 0, 1] and x.shape == (3, 2)


# --- memory estimates: refused before anything is allocated ----------------------------------------------


def spec_with(**sections):
    from fedshuffle.experiments.schema import RunSpec, validate

    base = {
        "local": {"lr": 0.1},
        "problem": {"name": "logistic"},
        "data": {"source": "synthetic", "samples": 40, "features": 2, "clients": 2, "partition": "iid"},
        "run": {"rounds": 2},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return validate(RunSpec, base)


@pytest.mark.parametrize(
    "sections, field",
    [
        ({"data": {"samples": 10**12}}, "data.samples"),
        ({"data": {"features": 10**11}}, "data.features"),
        ({"problem": {"name": "mlp", "hidden": [10**6, 10**6]}}, "problem.hidden"),
        # the synthetic source's settings unset (None: the part's default), as the targets source does not take them
        (
            {
                "problem": {"name": "quadratic"},
                "data": {
                    "source": "targets",
                    "partition": "sizes",
                    "client_sizes": [10**7],
                    "samples": None,
                    "features": None,
                    "clients": None,
                },
            },
            "data.client_sizes",
        ),
    ],
)
def test_sizes_that_cannot_fit_are_refused_naming_the_setting(sections, field):
    from fedshuffle.experiments.build import build_problem_and_data

    with pytest.raises(ConfigError) as exc:
        build_problem_and_data(spec_with(**sections))
    assert exc.value.field == field and "needs about" in exc.value.message and one_line(exc)


def test_rounds_that_cannot_be_planned_are_refused_and_huge_batches_mean_full_batches():
    from fedshuffle.experiments.runner import build_simulation

    sim, _ = build_simulation(spec_with(local={"lr": 0.1, "epochs": 10**10}), 0)
    with pytest.raises(ConfigError) as exc:
        sim.step()
    assert exc.value.field == "local.epochs" and "minibatch plans" in exc.value.message
    full, _ = build_simulation(spec_with(local={"lr": 0.1, "batch_size": 10**9}), 0)
    exact, _ = build_simulation(spec_with(local={"lr": 0.1, "batch_size": 40}), 0)
    full.step(), exact.step()
    assert torch.equal(full.params, exact.params)


def test_available_memory_respects_the_address_space_limit_and_the_override(monkeypatch):
    import resource

    room, _ = limits.available_bytes()
    assert 0 < room < 1 << 62
    monkeypatch.setenv(limits.ENV, "3G")
    assert limits.available_bytes() == (
        min(3 << 30, room),
        limits.ENV if room > 3 << 30 else limits.available_bytes()[1],
    )
    monkeypatch.delenv(limits.ENV)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize:"))) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (256 << 20), hard))
    try:
        room, source = limits.available_bytes()
        assert room <= 256 << 20 and "ulimit -v" in source
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    with pytest.raises(ConfigError, match="FEDSHUFFLE_MAX_MEMORY"):
        limits.parse_bytes("lots")


def test_a_vectorized_chunk_and_an_in_memory_client_state_beyond_memory_are_refused(monkeypatch):
    """With little memory allowed (FEDSHUFFLE_MAX_MEMORY): a chunk of 64 clients each holding a few copies
    of a 26k-parameter MLP, and SCAFFOLD's per-client state held in memory, are refused naming the
    setting that sizes them; one client at a time fits."""
    from fedshuffle.experiments.runner import build_simulation

    monkeypatch.setenv(limits.ENV, "64M")
    wide = {
        "problem": {"name": "mlp", "hidden": [2000]},
        "data": {"samples": 128, "features": 10, "clients": 64},
        "sampler": {"name": "full"},
    }
    for run, field in (({"chunk_size": 64}, "run.chunk_size"), ({}, "run.memory_budget_mb")):
        sim, _ = build_simulation(spec_with(**wide, run={"executor": "vectorized", "rounds": 1, **run}), 0)
        with pytest.raises(ConfigError) as exc:
            sim.step()
        assert exc.value.field == field and "vectorized chunk of 64 clients" in exc.value.message
    sim, _ = build_simulation(spec_with(**wide, run={"executor": "vectorized", "chunk_size": 1, "rounds": 1}), 0)
    sim.step()
    monkeypatch.setenv(limits.ENV, "8M")
    many = {
        "method": {"name": "scaffold"},
        "problem": {"name": "softmax"},
        "data": {"samples": 3000, "features": 30, "clients": 3000, "classes": 10},
    }
    with pytest.raises(ConfigError) as exc:
        build_simulation(spec_with(**many, run={"state_memory_mb": 100_000, "rounds": 1}), 0)
    assert exc.value.field == "run.state_memory_mb" and "3000 clients" in exc.value.message


@pytest.mark.parametrize("weighting", [[0.0, 0.0], []])
def test_an_all_zero_aggregation_weighting_is_refused(weighting):
    from fedshuffle.experiments.runner import build_simulation

    with pytest.raises(ConfigError) as exc:
        build_simulation(spec_with(aggregation={"weighting": weighting}), 0)
    assert exc.value.field == "aggregation.weighting" and one_line(exc)
