"""Differential privacy (fedshuffle.privacy): clipped and noised updates against hand computations with the same
noise streams, Andrew et al.'s adaptive clip by hand, ε per round against Opacus's accountant called directly,
the plain run when nothing is clipped or noised, one-line refusals, bit-exact resume, and Flower = simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("opacus", reason="the privacy accountant needs Opacus (pip install 'fedshuffle[privacy]')")
from opacus.accountants import RDPAccountant  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from fedshuffle.cli import app  # noqa: E402
from fedshuffle.core.streams import Stream  # noqa: E402
from fedshuffle.experiments.results import read_metrics  # noqa: E402
from fedshuffle.experiments.runner import build_simulation, run_single  # noqa: E402
from fedshuffle.experiments.schema import Experiment, validate  # noqa: E402

SEED = 3
CLIENTS = 6


def spec(
    privacy: dict | None = None, rounds: int = 4, method: str = "fedshuffle", sampler: dict | None = None, **sections
):
    raw = {
        "problem": {"name": "logistic", "l2": 0.05},
        "data": {
            "source": "synthetic",
            "samples": 10 * CLIENTS,
            "features": 4,
            "clients": CLIENTS,
            "partition": "dirichlet",
            "alpha": 0.8,
        },
        "method": {"name": method},
        "local": {"lr": 0.3, "batch_size": 4, "epochs": 2},
        "server": {"lr": 1.0},
        "sampler": sampler or {"name": "uniform", "cohort": 3},
        "run": {"rounds": rounds, "eval_every": 1, "seed": SEED},
        "privacy": privacy or {},
        **sections,
    }
    return validate(Experiment, raw).runs()[0][1]


def normal(*key: int, size: int) -> np.ndarray:
    """N(0, I) draws of the run's stream at ``key``, drawn here with NumPy alone."""
    return np.random.default_rng(np.random.SeedSequence([*key])).standard_normal(size)


def raw_updates(sim):
    """The next round's cohort, broadcast and unclipped Δ_i (the method's own local work), without advancing the run."""
    rnd, points = sim.open_round()
    broadcast = sim.broadcast(rnd, points, [])
    return rnd, broadcast, sim.trainer(rnd).train(rnd.plans, broadcast["model"])


def clipped(deltas: torch.Tensor, clip: float) -> torch.Tensor:
    return torch.stack([d * min(1.0, clip / float(d.norm())) for d in deltas])


def test_local_dp_sends_each_clipped_update_plus_its_own_seeded_noise_and_the_server_sums_them():
    clip, sigma = 0.05, 0.7
    sim, _ = build_simulation(spec({"mode": "local", "clip": clip, "noise_multiplier": sigma}), SEED)
    x0 = sim.params.clone()
    rnd, broadcast, deltas = raw_updates(sim)
    assert (deltas.norm(dim=1) > clip).all()  # every update is clipped
    hand = clipped(deltas, clip) + sigma * clip * torch.from_numpy(
        np.stack(
            [normal(SEED, Stream.CLIENT_PRIVACY, rnd.index, p.client, 0, size=sim.params.numel()) for p in rnd.plans]
        )
    )  # no repeats: occurrence 0
    sent = sim.method.client_update(broadcast, rnd.plans, {}, sim.trainer(rnd)).payload["delta"]
    torch.testing.assert_close(sent, hand, rtol=0, atol=1e-15)
    omega = torch.as_tensor(sim.method.aggregation_weights(rnd))
    sim.step()
    torch.testing.assert_close(sim.params, x0 - omega @ hand, rtol=0, atol=1e-15)


def test_a_client_sampled_twice_draws_fresh_noise_for_each_occurrence():
    clip, sigma = 0.05, 0.7
    sim, _ = build_simulation(
        spec(
            {"mode": "local", "clip": clip, "noise_multiplier": sigma},
            sampler={"name": "with_replacement", "cohort": 8},
        ),
        SEED,
    )
    rnd, broadcast, deltas = raw_updates(sim)
    occurrence = [rnd.cohort[:k].tolist().count(c) for k, c in enumerate(rnd.cohort.tolist())]
    assert max(occurrence) >= 1  # this seed repeats a client
    hand = clipped(deltas, clip) + sigma * clip * torch.from_numpy(
        np.stack(
            [
                normal(SEED, Stream.CLIENT_PRIVACY, rnd.index, c, k, size=sim.params.numel())
                for c, k in zip(rnd.cohort.tolist(), occurrence)
            ]
        )
    )
    sent = sim.method.client_update(broadcast, rnd.plans, {}, sim.trainer(rnd)).payload["delta"]
    torch.testing.assert_close(sent, hand, rtol=0, atol=1e-15)
    sim.step()
    assert int(sim.privacy_state["releases"].max()) == max(occurrence) + 1  # every occurrence is a release


def test_system_noise_is_not_the_seeded_streams_and_differs_between_runs():
    runs = []
    for noise in ("seeded", "system", "system"):
        sim, _ = build_simulation(
            spec({"mode": "central", "clip": 0.05, "noise_multiplier": 1.0, "noise": noise}, rounds=2), SEED
        )
        sim.step()
        runs.append(sim.params)
    assert not torch.equal(runs[0], runs[1]) and not torch.equal(runs[1], runs[2])


def test_central_dp_adds_noise_scaled_by_the_weighted_sums_sensitivity_to_the_aggregate():
    clip, sigma = 0.05, 0.8
    sim, _ = build_simulation(spec({"mode": "central", "clip": clip, "noise_multiplier": sigma}), SEED)
    x0 = sim.params.clone()
    rnd, broadcast, deltas = raw_updates(sim)
    sent = sim.method.client_update(broadcast, rnd.plans, {}, sim.trainer(rnd)).payload["delta"]
    torch.testing.assert_close(sent, clipped(deltas, clip), rtol=0, atol=1e-16)  # clients clip, add nothing
    omega = torch.as_tensor(sim.method.aggregation_weights(rnd))
    sensitivity = clip * max(
        sim.data.weights / sim.sampler.expected_counts()
    )  # C·max ω_i over all n clients (data weights / (3/6))
    assert sensitivity == pytest.approx(clip * 2 * sim.data.weights.max())
    noise = sigma * sensitivity * torch.from_numpy(normal(SEED, Stream.SERVER_PRIVACY, 0, 0, size=sim.params.numel()))
    sim.step()
    torch.testing.assert_close(sim.params, x0 - (omega @ clipped(deltas, clip) + noise), rtol=0, atol=1e-15)


def test_adaptive_clipping_follows_andrew_et_al_geometric_update_and_splits_the_noise():
    clip, sigma, quantile, lr, count_noise = 0.02, 0.5, 0.4, 0.3, 1.5
    privacy = {
        "mode": "central",
        "clip": clip,
        "noise_multiplier": sigma,
        "clipping": "adaptive",
        "target_quantile": quantile,
        "clip_lr": lr,
        "count_noise": count_noise,
    }
    sim, _ = build_simulation(spec(privacy, sampler={"name": "full"}), SEED)
    z_update = (sigma**-2 - (2 * count_noise) ** -2) ** -0.5  # Andrew et al., Theorem 1
    assert sim.privacy.update_noise == pytest.approx(z_update)
    clips, counts = [clip], []
    for r in range(6):
        rnd, broadcast, deltas = raw_updates(sim)
        assert float(broadcast["clip"][0]) == clips[-1]  # members clip with the server's current C
        x0 = sim.params.clone()
        unclipped = int((deltas.norm(dim=1) <= clips[-1]).sum())
        counts.append(unclipped)
        noised = (
            unclipped + count_noise * normal(SEED, Stream.SERVER_PRIVACY, r, 1, size=1)[0]
        ) / CLIENTS  # m = expected cohort = 6
        omega = torch.as_tensor(sim.method.aggregation_weights(rnd))
        noise = (
            z_update
            * clips[-1]
            * float(max(sim.data.weights))
            * torch.from_numpy(normal(SEED, Stream.SERVER_PRIVACY, r, 0, size=sim.params.numel()))
        )
        sim.step()
        torch.testing.assert_close(sim.params, x0 - (omega @ clipped(deltas, clips[-1]) + noise), rtol=0, atol=1e-15)
        clips.append(clips[-1] * math.exp(-lr * (noised - quantile)))
        assert float(sim.privacy_state["clip"]) == pytest.approx(clips[-1], rel=1e-15) and sim.last_extras[
            "dp_clip"
        ] == float(sim.privacy_state["clip"])
    assert counts[0] == 0 and clips[-1] > 2 * clip  # all clipped at first: C grows towards the 0.4-quantile
    eps = sim.counters.epsilon
    assert eps == pytest.approx(rdp_epsilon(sigma, 1.0, 6, 1e-5), rel=1e-12)  # the accountant sees the total σ, not σ_Δ


def rdp_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("mode", ["central", "local"])
def test_epsilon_per_round_in_metrics_csv_is_opacus_accountant_called_directly(tmp_path, mode):
    sigma, delta = 1.3, 1e-4
    run_single(
        spec({"mode": mode, "clip": 0.1, "noise_multiplier": sigma, "delta": delta}, rounds=8), tmp_path, seed=SEED
    )
    metrics = read_metrics(tmp_path / "metrics.csv")
    eps = metrics["epsilon"]
    assert eps[0] == 0.0 and np.all(np.diff(eps) >= 0) and eps[-1] > eps[1] > 0
    if mode == "central":  # every round a Gaussian mechanism on a q = 3/6 subsample
        expected = [rdp_epsilon(sigma, 0.5, int(r), delta) if r else 0.0 for r in metrics["round"]]
    else:  # the client that took part most often, each time sensitivity 2C, no amplification
        sim, _ = build_simulation(spec(rounds=8), SEED)
        taken = np.zeros(CLIENTS, dtype=int)
        expected = [0.0]
        for r in range(8):
            taken[sim.sampler.sample(r, SEED)] += 1
            expected.append(rdp_epsilon(sigma / 2, 1.0, int(taken.max()), delta))
    np.testing.assert_array_equal(eps, expected)
    assert '"delta": 0.0001' in (tmp_path / "config.json").read_text()


def test_a_run_without_privacy_has_an_empty_epsilon_column(tmp_path):
    run_single(spec(rounds=2), tmp_path, seed=SEED)
    header, first = (tmp_path / "metrics.csv").read_text().splitlines()[:2]
    assert "epsilon" in header and first.split(",")[header.split(",").index("epsilon")] == ""


def stacked_round(sim) -> None:
    """One round of ``sim`` with the members' Δ_i stacked, not summed as they are produced."""
    rnd, points = sim.open_round()
    broadcast = sim.broadcast(rnd, points, [])
    sim.close_round(
        rnd,
        points,
        broadcast,
        sim.method.client_update(broadcast, rnd.plans, {}, sim.trainer(rnd)) if len(rnd.cohort) else None,
    )


def test_no_noise_and_no_clipping_gives_the_plain_runs_numbers_and_infinite_epsilon():
    fused, _ = build_simulation(spec(rounds=5), SEED)
    stacked, _ = build_simulation(spec(rounds=5), SEED)
    for _ in range(5):
        fused.step()
        stacked_round(stacked)
    for mode in ("local", "central"):
        sim, _ = build_simulation(spec({"mode": mode, "clip": math.inf}, rounds=5), SEED)
        assert not sim.method.sums_updates  # the Δ_i are clipped one by one, never fused
        for _ in range(5):
            sim.step()
        assert torch.equal(sim.params, stacked.params) and sim.counters.rounds == stacked.counters.rounds
        torch.testing.assert_close(sim.params, fused.params, rtol=0, atol=1e-15)  # only the summation order differs
        assert sim.counters.epsilon == math.inf


def test_a_run_killed_mid_way_resumes_to_the_same_numbers_with_the_adaptive_clip(tmp_path):
    privacy = {"mode": "central", "clip": 0.02, "noise_multiplier": 0.5, "clipping": "adaptive", "count_noise": 2.0}
    full = spec(privacy, rounds=10, sampler={"name": "independent", "cohort": 3})
    run_single(full, tmp_path / "full", seed=SEED)
    short = full.model_copy(update={"run": full.run.model_copy(update={"rounds": 4})})
    run_single(short, tmp_path / "cut", seed=SEED)
    (tmp_path / "cut" / "summary.json").unlink()  # as if killed after the round-4 checkpoint
    run_single(full, tmp_path / "cut", seed=SEED, resume=True, extend=True)
    assert np.array_equal(
        np.load(tmp_path / "full" / "final_params.npy"), np.load(tmp_path / "cut" / "final_params.npy")
    )
    assert (tmp_path / "full" / "metrics.csv").read_text() == (tmp_path / "cut" / "metrics.csv").read_text()


CONFIG = """[problem]
name = "logistic"
[data]
source = "synthetic"
samples = 24
features = 3
clients = 4
partition = "iid"
[local]
lr = 0.1
[run]
rounds = 2
[method]
name = "{method}"
[privacy]
{privacy}
"""


@pytest.mark.parametrize(
    "method, privacy, field, says",
    [
        ("fedshuffle", 'mode = "local"', "privacy.clip", "needs the clip C"),
        ("fedshuffle", 'mode = "secret"', "privacy.mode", "'none', 'local' or 'central'"),
        ("fedshuffle", 'mode = "local"\nclip = 1.0\nclipping = "adaptive"', "privacy.clipping", "central DP's"),
        ("fedshuffle", 'mode = "central"\nclip = inf\nnoise_multiplier = 1.0', "privacy.clip", "finite clip"),
        (
            "fedshuffle",
            'mode = "central"\nclip = 1.0\ntarget_quantile = 0.3',
            "privacy.target_quantile",
            "clipping = 'adaptive'",
        ),
        (
            "fedshuffle",
            'mode = "central"\nclip = 1.0\nnoise_multiplier = 1.0\nclipping = "adaptive"',
            "privacy.count_noise",
            "2σ_b > σ",
        ),
        ("fedshuffle", 'mode = "local"\nclip = 1.0\ndelta = 1.5', "privacy.delta", "less than 1"),
        ("fedshuffle", 'mode = "local"\nclipp = 1.0', "privacy.clipp", "did you mean 'clip'"),
        ("scaffold", 'mode = "local"\nclip = 1.0', "privacy.mode", "scaffold"),
        ("feddyn", 'mode = "central"\nclip = 1.0', "privacy.mode", "feddyn"),
        ("fednova", 'mode = "central"\nclip = 1.0', "aggregation.weighting", "FedNova's"),
        ("fedavg", 'mode = "central"\nclip = 1.0', "aggregation.normalization", "'sum_one'"),
    ],
)
def test_bad_privacy_settings_are_refused_in_one_line_naming_the_field(tmp_path, method, privacy, field, says):
    (tmp_path / "c.toml").write_text(CONFIG.format(method=method, privacy=privacy))
    result = CliRunner().invoke(app, ["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"error: {field}") and says in line, result.output
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").rglob("metrics.csv"))


def test_central_dp_refuses_a_sampler_that_repeats_clients(tmp_path):
    (tmp_path / "c.toml").write_text(
        CONFIG.format(method="fedshuffle", privacy='mode = "central"\nclip = 1.0')
        + '[sampler]\nname = "with_replacement"\ncohort = 2\n'
    )
    result = CliRunner().invoke(app, ["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1].startswith(
        "error: sampler.name: privacy.mode = 'central'"
    ), result.output


@pytest.mark.parametrize(
    "privacy",
    [
        {"mode": "local", "clip": 0.05, "noise_multiplier": 0.7},
        {"mode": "central", "clip": 0.02, "noise_multiplier": 0.5, "clipping": "adaptive", "count_noise": 2.0},
    ],
)
def test_flower_in_process_equals_the_simulation_with_dp(privacy):
    pytest.importorskip("flwr", reason="the Flower integration needs flwr")
    from flower_harness import FakeGrid
    from flwr.app import ConfigRecord

    from fedshuffle.integrations.flower.app import client_app
    from fedshuffle.integrations.flower.common import AppSettings, federated_runs
    from fedshuffle.integrations.flower.messages import record_tensors
    from fedshuffle.integrations.flower.strategy import FedShuffleStrategy

    raw = spec(privacy, rounds=3).model_dump()
    exp = validate(
        Experiment,
        {
            **{k: raw[k] for k in ("problem", "data", "method", "local", "server", "sampler", "run", "privacy")},
            "experiment": {"seeds": [SEED]},
        },
    )
    (run,) = federated_runs(exp, AppSettings())
    grid = FakeGrid(client_app(exp), CLIENTS)
    strategy = FedShuffleStrategy(run)
    sim, _ = build_simulation(run.spec, run.seed)
    arrays = strategy.initial_arrays()
    for r in range(1, 4):
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        arrays, reported = strategy.aggregate_train(r, grid.send_and_receive(messages))
        sim.step()
        torch.testing.assert_close(record_tensors(arrays)["model"], sim.params, rtol=0, atol=1e-12)
        assert "unclipped" not in reported  # the members' clipped count is private: never reported
    assert strategy.half.counters.epsilon == sim.counters.epsilon > 0
    torch.testing.assert_close(strategy.half.privacy_state["clip"], sim.privacy_state["clip"], rtol=0, atol=1e-15)


def test_without_opacus_a_dp_run_stops_before_its_first_round_naming_the_extra(monkeypatch):
    import importlib.util

    from fedshuffle.core.errors import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "opacus" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'fedshuffle\[privacy\]'") as raised:
        build_simulation(spec({"mode": "local", "clip": 1.0, "noise_multiplier": 1.0}), SEED)
    assert raised.value.field == "privacy.mode"
