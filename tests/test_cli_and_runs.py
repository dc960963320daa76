"""The command line and the runner: results on disk, bad input, divergence, resume."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.experiments.schema import load_experiment, preset_names
from fedshuffle.experiments.results import read_metrics
from fedshuffle.experiments.runner import run_single

runner = CliRunner()

def write_config(tmp_path, text):
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path

BASE = """
[problem]
name = "quadratic"
[data]
path = "{targets}"
client_sizes = [2, 3]
[method]
name = "fedshuffle"

[local]
lr = {lr}

[sampler]
name = "full"
[run]
rounds = {rounds}
eval_every = 5
"""

def test_quickstart_preset_writes_every_result(tmp_path):
    out = tmp_path / "res"
    result = runner.invoke(app, ["run", "--out", str(out), "--set", "run.rounds=60", "--quiet"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["variants"]) == {"FedAvg", "FedAvgRR", "FedNova", "FedShuffle"}
    run_dir = out / "fedshuffle" / "seed-123"
    for name in ("config.json", "metrics.csv", "summary.json", "final_params.npy"):
        assert (run_dir / name).exists()
    assert (out / "plot.png").stat().st_size > 10_000 and (out / "plot.pdf").exists()
    metrics = read_metrics(run_dir / "metrics.csv")
    assert metrics["round"][-1] == 60 and metrics["epochs"][-1] == pytest.approx(60.0)
    assert metrics["f_gap"][-1] < metrics["f_gap"][0]
    params = np.load(run_dir / "final_params.npy")
    assert params.dtype == np.float64 and params.shape == (6,)
    assert np.sum((params - 1 / 6) ** 2) == pytest.approx(metrics["dist_sq"][-1])

def test_every_preset_validates():
    names = preset_names()
    assert {"quickstart", "fedshuffle-fig1-full", "fedshuffle-fig1-momentum", "fedshuffle-fig1-sum-one", "fedshuffle-fig1-importance", "fedshuffle-fig4-unfinished"} <= set(names)
    for name in names:
        runs = load_experiment(name).runs()
        assert runs and all(spec.local.lr for _, spec in runs)

def test_user_targets_file(tmp_path):
    targets = np.random.default_rng(0).normal(size=(5, 3))
    np.save(tmp_path / "t.npy", targets)
    cfg = write_config(tmp_path, BASE.format(targets="t.npy", lr=0.01, rounds=1500))
    result = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 0, result.output
    final = np.load(tmp_path / "o" / "seed-0" / "final_params.npy")
    metrics = read_metrics(tmp_path / "o" / "seed-0" / "metrics.csv")
    # x* with w_i = |D_i|/|D| is the mean of all targets, and FedShuffle gets there up to its noise floor
    assert metrics["dist_sq"][-1] == pytest.approx(np.sum((final - targets.mean(0)) ** 2))
    assert metrics["dist_sq"][-1] < 1e-3 * metrics["dist_sq"][0]

@pytest.mark.parametrize(
    "edit, field",
    [
        (("lr = 0.1", "lr = -0.1"), "local.lr"),
        (("name = \"fedshuffle\"", "name = \"fedshufle\""), "did you mean 'fedshuffle'"),
        (("rounds = 10", "roundz = 10"), "did you mean 'rounds'"),
        (("name = \"full\"", "name = \"uniform\"\ncohort = 3"), "sampler.cohort"),
        (("client_sizes = [2, 3]", "client_sizes = [2, 4]"), "data.client_sizes"),
        (("client_sizes = [2, 3]", "client_sizes = [5, 0]"), "data.client_sizes"),
        (("path = \"t.npy\"", "path = \"missing.npy\""), "data.path"),
        (("path = \"t.npy\"", "path = \"bad.npy\""), "bad.npy: not a .npy array"),
    ],
)
def test_bad_config_exits_2_with_one_clear_line(tmp_path, edit, field):
    np.save(tmp_path / "t.npy", np.eye(5))
    (tmp_path / "bad.npy").write_bytes(b"not a numpy file")
    cfg = write_config(tmp_path, BASE.format(targets="t.npy", lr=0.1, rounds=10).replace(*edit))
    result = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert field in result.stderr and "Traceback" not in result.stderr

def test_bad_override_and_unknown_preset_exit_2(tmp_path):
    assert runner.invoke(app, ["run", "quickstart", "--set", "local.lr"]).exit_code == 2
    result = runner.invoke(app, ["run", "quikstart"])
    assert result.exit_code == 2 and "did you mean 'quickstart'" in result.stderr

def test_divergence_stops_keeps_results_and_marks_summary(tmp_path):
    np.save(tmp_path / "t.npy", np.eye(5))
    cfg = write_config(tmp_path, BASE.format(targets="t.npy", lr=5.0, rounds=500).replace("client_sizes = [2, 3]", "client_sizes = [2, 3]").replace("name = \"fedshuffle\"", "name = \"fedavg_rr\"").replace("rounds = 500", "rounds = 500\ndtype = \"float32\""))
    result = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 3
    summary = json.loads((tmp_path / "o" / "seed-0" / "summary.json").read_text())
    assert summary["status"] == "diverged" and "round" in summary["message"]
    metrics = read_metrics(tmp_path / "o" / "seed-0" / "metrics.csv")
    assert len(metrics["round"]) >= 2 and np.isfinite(metrics["loss"][0])

def test_resume_from_checkpoint_gives_the_same_numbers(tmp_path):
    exp = load_experiment("fedshuffle-fig1-sum-one")
    label, spec = exp.runs({"run": {"rounds": 300, "eval_every": 20}})[1]
    full = run_single(spec, tmp_path / "full", seed=9)
    short = spec.model_copy(update={"run": spec.run.model_copy(update={"rounds": 140})})
    run_single(short, tmp_path / "cut", seed=9)
    (tmp_path / "cut" / "summary.json").unlink()  # as if killed after the round-140 checkpoint
    resumed = run_single(spec, tmp_path / "cut", seed=9, resume=True, extend=True)
    assert resumed.status == "complete"
    assert np.array_equal(np.load(tmp_path / "full" / "final_params.npy"), np.load(tmp_path / "cut" / "final_params.npy"))
    assert (tmp_path / "full" / "metrics.csv").read_text() == (tmp_path / "cut" / "metrics.csv").read_text()
    assert full.final["round"] == 300

def test_show_and_presets_commands():
    result = runner.invoke(app, ["show", "fedshuffle-fig1-sum-one"])
    assert result.exit_code == 0 and "sum_one" in result.stdout
    listing = runner.invoke(app, ["presets"], terminal_width=200)
    assert listing.exit_code == 0 and "fedshuffle-fig4-unfinished" in listing.stdout

RR_CLI = """
[problem]
name = "logistic"
l2 = 0.01
[data]
source = "synthetic"
samples = 240
features = 5
partition = "equal"
clients = 12
seed = 4
[method]
name = "rr_cli"

[local]
lr = "theory"
batch_size = 5

[server]
lr = "theory"
global_lr = 2.0
optimizer = "{server}"

[sampler]
name = "cyclic"
cohort = 3
[run]
rounds = {rounds}
eval_every = 1
"""

def test_rr_cli_resumes_mid_meta_epoch_with_nested_server_state(tmp_path):
    """The meta-epoch anchor and an adaptive server's moments survive a checkpoint taken inside a meta-epoch."""
    spec = lambda rounds: load_experiment(write_config(tmp_path, RR_CLI.format(server="adam", rounds=rounds))).runs()[0][1]  # noqa: E731
    run_single(spec(10), tmp_path / "full", seed=1)
    run_single(spec(6), tmp_path / "cut", seed=1)  # 6 = 1.5 meta-epochs of R = 4
    (tmp_path / "cut" / "summary.json").unlink()
    run_single(spec(10), tmp_path / "cut", seed=1, resume=True, extend=True)
    assert np.array_equal(np.load(tmp_path / "full" / "final_params.npy"), np.load(tmp_path / "cut" / "final_params.npy"))
    assert (tmp_path / "full" / "metrics.csv").read_text() == (tmp_path / "cut" / "metrics.csv").read_text()

def test_inspect_config_shows_theoretical_step_sizes(tmp_path):
    path = write_config(tmp_path, RR_CLI.format(server="sgd", rounds=5))
    result = runner.invoke(app, ["inspect", "--config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["run"]
    c = row["constants"]
    assert row["local_lr"] == pytest.approx(1 / c["L_sample_max"]) and row["server_lr"] == pytest.approx(row["local_lr"] * 4)  # N = 20/5 steps
    assert row["global_lr"] == 2.0 and row["from_theory"] == ["lr", "server_lr"] and row["local_steps"] == 4
    bad = write_config(tmp_path, RR_CLI.format(server="adamw", rounds=5))
    result = runner.invoke(app, ["inspect", "--config", str(bad)])
    assert result.exit_code == 2 and "server.optimizer" in result.output

def test_executor_setting_runs_the_same_numbers(tmp_path):
    """run.executor switches the executor, not the results (metrics files identical)."""
    base = load_experiment(write_config(tmp_path, RR_CLI.format(server="sgd", rounds=6))).runs()[0][1]
    for name in ("sequential", "vectorized", "auto"):
        spec = base.model_copy(update={"run": base.run.model_copy(update={"executor": name})})
        run_single(spec, tmp_path / name, seed=2)
    a, b, c = (read_metrics(tmp_path / n / "metrics.csv") for n in ("sequential", "vectorized", "auto"))
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-12)
    np.testing.assert_allclose(a["loss"], c["loss"], rtol=1e-12)
    picked = json.loads((tmp_path / "auto" / "config.json").read_text())["executor"]
    assert picked["name"] == "vectorized" and picked["chosen"].startswith("auto: vectorized")  # logistic regression: batched closed forms
    bad = write_config(tmp_path, RR_CLI.format(server="sgd", rounds=6).replace('[run]', '[run]\nexecutor = "gpu"'))
    result = runner.invoke(app, ["run", str(bad), "--out", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "run.executor" in result.output and "auto" in result.output  # the accepted values are listed
