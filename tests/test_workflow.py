"""The researcher's workflow: sweeps, tables, plots, sinks, kill -9 and resume, faults."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.experiments.schema import load_experiment
from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.experiments.results import read_metrics
from fedshuffle.experiments.runner import run_single
from fedshuffle.experiments.sweep import grid_edges, parse_grid, parse_seeds, point_name
from conftest import toy_config

runner = CliRunner()


def config(tmp_path, method="fedshuffle_mvr", rounds=100, name="toy.toml", extra=""):
    return toy_config(tmp_path, method=method, rounds=rounds, eval_every=10, name=name, extra=extra)


def test_grid_and_seed_syntax():
    assert parse_seeds("0..4") == [0, 1, 2, 3, 4] and parse_seeds("3,1") == [3, 1]
    points = parse_grid(["local.lr=0.1,0.01", "local.epochs=[2,5],1"])
    assert (
        len(points) == 4 and points[1] == {"local": {"lr": 0.1, "epochs": 1}} and points[0]["local"]["epochs"] == [2, 5]
    )
    assert point_name(points[0]) == "local.lr-0.1_local.epochs-2-5"
    large, small = parse_grid(
        ["local.lr=1e+30,1e-30"]
    )  # a folder name turns "+" into "-": exponents lose their "+" first
    assert (point_name(large), point_name(small)) == ("local.lr-1e30", "local.lr-1e-30")
    for bad, field in (
        (lambda: parse_seeds("4..1"), "--seeds"),
        (lambda: parse_grid(["lr"]), "--grid"),
        (lambda: parse_grid(["local.lr=1", "local.lr=2"]), "--grid"),
        (lambda: parse_grid(["model.lr=1"]), "--grid"),
    ):
        with pytest.raises(ConfigError) as err:
            bad()
        assert err.value.field == field


def test_a_best_point_at_the_edge_of_its_grid_is_flagged():
    tried = [{"local": {"lr": lr, "epochs": e}} for lr in (0.1, 0.2, 0.4) for e in (1, 2)]
    assert grid_edges({"local": {"lr": 0.4, "epochs": 2}}, tried) == [
        "local.lr"
    ]  # two values of epochs are no range to be inside
    assert grid_edges({"local": {"lr": 0.2, "epochs": 1}}, tried) == []
    assert grid_edges(
        {"local": {"lr": 0.1}}, [{"local": {"lr": 0.1}}, {"local": {"lr": 0.2}}, {"local": {"lr": 0.3}}]
    ) == ["local.lr"]
    assert (
        grid_edges(None, tried) == []
        and grid_edges({"local": {"epochs": [2, 5]}}, [{"local": {"epochs": [2, 5]}}]) == []
    )


def test_sweep_runs_every_combination_in_parallel_skips_finished_runs_and_picks_the_best(tmp_path):
    cfg, out = config(tmp_path, method="fedavg", rounds=60), tmp_path / "sweep"
    args = [
        "sweep",
        str(cfg),
        "--grid",
        "local.lr=0.0005,0.004",
        "--grid",
        "server.momentum=0,0.5",
        "--seeds",
        "0..1",
        "--out",
        str(out),
        "--workers",
        "2",
        "--pick",
        "f_gap",
        "--quiet",
    ]
    result = runner.invoke(app, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    summaries = sorted(out.rglob("seed-*/summary.json"))
    assert len(summaries) == 2 * 2 * 2
    record = json.loads((out / "sweep.json").read_text())
    means = {}
    for path in summaries:
        s = json.loads(path.read_text())
        means.setdefault(json.dumps(s["point"], sort_keys=True), []).append(s["final"]["f_gap"])
    best_point = min(means, key=lambda k: np.mean(means[k]))
    assert json.dumps(record["best"]["run"]["point"], sort_keys=True) == best_point
    assert record["best"]["run"]["mean"] == pytest.approx(np.mean(means[best_point]))
    stamps = {p: p.stat().st_mtime_ns for p in summaries}
    again = runner.invoke(app, args[:-3] + ["--quiet"], terminal_width=200)
    assert again.exit_code == 0, again.output
    assert {p: p.stat().st_mtime_ns for p in summaries} == stamps  # nothing was run twice
    table = runner.invoke(app, ["table", str(out), "--metric", "f_gap"])
    assert table.exit_code == 0 and table.stdout.count("| run [") == 4
    row = next(line for line in table.stdout.splitlines() if "local.lr=0.004, server.momentum=0.5" in line)
    key = json.dumps({"local": {"lr": 0.004}, "server": {"momentum": 0.5}}, sort_keys=True)
    assert f"{np.mean(means[key]):.4g} ± {np.std(means[key]):.2g}" in row
    plot = runner.invoke(
        app, ["plot", str(out), "--metric", "f_gap", "--metric", "dist_sq", "--x", "epochs", "--band", "minmax"]
    )
    assert (
        plot.exit_code == 0
        and (out / "plot-f_gap-dist_sq-by-epochs.png").stat().st_size > 10_000
        and (out / "plot-f_gap-dist_sq-by-epochs.pdf").exists()
    )


def test_table_marks_diverged_runs_instead_of_failing(tmp_path):
    out = tmp_path / "res"
    result = runner.invoke(
        app,
        [
            "run",
            str(config(tmp_path, method="fedavg", rounds=40)),
            "--set",
            "local.lr=50",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 3
    table = runner.invoke(app, ["table", str(out), "--metric", "f_gap"])
    assert table.exit_code == 0 and "0 (1 diverged)" in table.stdout


def test_run_folder_has_config_versions_parquet_and_sinks(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    spec = load_experiment(config(tmp_path)).runs({"run": {"sinks": ["tensorboard", "mlflow"]}})[0][1]
    run_single(spec, tmp_path / "r" / "seed-0", seed=0, label="toy")
    run = tmp_path / "r" / "seed-0"
    saved = json.loads((run / "config.json").read_text())
    assert (
        saved["seed"] == 0
        and saved["label"] == "toy"
        and {"fedshuffle", "torch", "numpy", "python"} <= set(saved["environment"])
    )
    import pyarrow.parquet as pq

    table = pq.read_table(run / "metrics.parquet").to_pydict()
    csv = read_metrics(run / "metrics.csv")
    np.testing.assert_array_equal(np.array(table["f_gap"]), csv["f_gap"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "r" / "tensorboard" / "seed-0"))
    events.Reload()
    np.testing.assert_allclose([e.value for e in events.Scalars("f_gap")], csv["f_gap"], rtol=1e-6)
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=(run.parent / "mlruns").resolve().as_uri())
    (mlrun,) = client.search_runs(
        [client.get_experiment_by_name("fedshuffle").experiment_id], filter_string="tags.`fedshuffle.seed` = '0'"
    )
    history = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "f_gap"))
    np.testing.assert_allclose([v for _, v in history], csv["f_gap"], rtol=1e-12)
    assert mlrun.data.params["method.name"] == "fedshuffle_mvr"


def test_sinks_gather_an_experiment_in_one_mlflow_experiment_and_one_tensorboard_directory(tmp_path):
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    cfg = config(tmp_path, rounds=4).read_text().replace("seeds = [0]", 'seeds = [0, 1]\nname = "toy"')
    cfg += '\n[[variants]]\nlabel = "A"\n\n[[variants]]\nlabel = "B"\nlocal = { lr = 0.002 }\n'
    (tmp_path / "two.toml").write_text(cfg)
    out = tmp_path / "res"
    result = runner.invoke(
        app,
        [
            "run",
            str(tmp_path / "two.toml"),
            "--set",
            'run.sinks=["tensorboard", "mlflow"]',
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    # TensorBoard: one log directory, a subdirectory per run as the results are laid out
    assert sorted(
        p.parent.relative_to(out / "tensorboard").as_posix()
        for p in (out / "tensorboard").rglob("events.out.tfevents.*")
    ) == ["a/seed-0", "a/seed-1", "b/seed-0", "b/seed-1"]
    assert not list(out.glob("*/mlruns")) and not list(out.glob("*/*/tensorboard"))
    # MLflow: one store and one experiment; a parent run per variant with a nested run per seed
    client = mlflow.tracking.MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    assert experiment.name == "toy"
    runs = client.search_runs([experiment.experiment_id])
    parents = {r.info.run_id: r.info.run_name for r in runs if "mlflow.parentRunId" not in r.data.tags}
    assert sorted(parents.values()) == ["A", "B"]
    children = sorted(
        (parents[r.data.tags["mlflow.parentRunId"]], r.info.run_name)
        for r in runs
        if "mlflow.parentRunId" in r.data.tags
    )
    assert children == [("A", "seed-0"), ("A", "seed-1"), ("B", "seed-0"), ("B", "seed-1")]
    child = next(
        r for r in runs if r.info.run_name == "seed-1" and parents.get(r.data.tags.get("mlflow.parentRunId")) == "B"
    )
    assert child.data.params["local.lr"] == "0.002" and child.info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(child.info.run_id, "f_gap"))
    np.testing.assert_allclose(
        [v for _, v in history], read_metrics(out / "b" / "seed-1" / "metrics.csv")["f_gap"], rtol=1e-12
    )


def offline_wandb_history(folder):
    """The run record and the logged rows (step → {metric: value}) of W&B's offline run file in ``folder``: the LevelDB
    log format (32 KiB blocks of records with a 7-byte header) after W&B's own 7-byte header, each record a protobuf."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = next(folder.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    block, position, pending, run, rows = 32768, 7, b"", None, {}
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "run":
                run = record.run
            elif record.WhichOneof("record_type") == "history":
                items = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                rows[record.history.step.num] = {
                    k: v for k, v in items.items() if not k.startswith("_")
                }  # W&B's own: _step, _runtime
    return run, rows


def test_the_wandb_sink_writes_an_offline_run_per_seed_with_the_metrics_of_metrics_csv(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb-files"),
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_SILENT": "true",
    }.items():
        monkeypatch.setenv(key, value)  # nothing leaves the machine
    cfg = config(tmp_path, rounds=20).read_text().replace("seeds = [0]", 'seeds = [0, 1]\nname = "toy"')
    cfg += '\n[[variants]]\nlabel = "A"\n\n[[variants]]\nlabel = "B"\nlocal = { lr = 0.002 }\n'
    (tmp_path / "two.toml").write_text(cfg)
    out = tmp_path / "res"
    result = runner.invoke(
        app, ["run", str(tmp_path / "two.toml"), "--set", 'run.sinks=["wandb"]', "--out", str(out), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    offline = sorted((tmp_path / "wandb-files" / "wandb").glob("offline-run-*"))
    assert len(offline) == 4 and not (out / "wandb").exists()  # one W&B run per variant and seed, in WANDB_DIR
    seen = set()
    for folder in offline:
        run, rows = offline_wandb_history(folder)
        label, seed = run.run_group, int(run.display_name.rsplit("seed-", 1)[1])
        assert run.project == "toy" and run.display_name == f"{label} seed-{seed}"
        config_values = {u.key: json.loads(u.value_json) for u in run.config.update}
        assert (
            config_values["local.lr"] == (0.002 if label == "B" else 0.004) and config_values["fedshuffle.seed"] == seed
        )
        csv = read_metrics(out / label.lower() / f"seed-{seed}" / "metrics.csv")
        assert sorted(rows) == list(csv["round"])  # a row per evaluation, at step = round
        for k, step in enumerate(csv["round"]):
            logged = rows[step]
            recorded = {m: float(csv[m][k]) for m in csv if m != "round" and np.isfinite(csv[m][k])}
            assert logged == recorded, (label, seed, step)  # every metric, exactly as metrics.csv holds it
        seen.add((label, seed))
    assert seen == {("A", 0), ("A", 1), ("B", 0), ("B", 1)}


def _command(*args):
    return [sys.executable, "-m", "fedshuffle", *args]


def test_kill_9_then_resume_gives_the_uninterrupted_numbers_bit_for_bit(tmp_path):
    """A run killed with SIGKILL mid-way and resumed matches an uninterrupted run exactly:
    model, metrics, sampler and data-order streams, server and global-momentum state."""
    cfg = config(tmp_path, rounds=2000)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    subprocess.run(
        _command("run", str(cfg), "--out", str(tmp_path / "full"), "--quiet"), check=True, env=env, capture_output=True
    )
    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        _command("run", str(cfg), "--out", str(cut), "--quiet"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoint, metrics_table = cut / "seed-0" / "checkpoint.pt", cut / "seed-0" / "metrics.csv"
    deadline = time.time() + 120
    while time.time() < deadline and not (
        checkpoint.exists() and metrics_table.exists() and len(read_metrics(metrics_table)["round"]) > 30
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (cut / "seed-0" / "summary.json").exists(), "the run finished before it could be killed"
    killed_at = read_metrics(cut / "seed-0" / "metrics.csv")["round"][-1]
    assert 0 < killed_at < 2000
    resumed = subprocess.run(
        _command("run", str(cfg), "--resume", str(cut), "--quiet"), env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    for name in ("final_params.npy", "metrics.csv"):
        assert (tmp_path / "full" / "seed-0" / name).read_bytes() == (cut / "seed-0" / name).read_bytes(), name
    full, again = (json.loads((d / "seed-0" / "summary.json").read_text()) for d in (tmp_path / "full", cut))
    assert full == again


def test_unwritable_results_folder_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = runner.invoke(app, ["run", str(config(tmp_path)), "--out", str(blocker / "res"), "--quiet"])
    assert result.exit_code == 4 and "cannot write to" in result.output
    assert not any(tmp_path.glob("**/metrics.csv"))


def test_full_disk_is_detected_before_training_and_during_it(tmp_path, monkeypatch):
    import fedshuffle.core.checkpoint as checkpoint_mod
    import fedshuffle.experiments.loop as loop_mod
    import fedshuffle.experiments.runner as runner_mod

    spec = load_experiment(config(tmp_path)).runs()[0][1]
    monkeypatch.setattr(runner_mod.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1024})())
    with pytest.raises(ResultsError, match="MiB free"):
        run_single(spec, tmp_path / "a", seed=0)
    assert not (tmp_path / "a" / "metrics.csv").exists()
    monkeypatch.undo()
    calls = {"n": 0}
    real = loop_mod.write_atomic

    def flaky(path, data):
        calls["n"] += 1
        if calls["n"] > 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(loop_mod, "write_atomic", flaky)
    monkeypatch.setattr(checkpoint_mod, "write_atomic", flaky)
    every_evaluation = spec.model_copy(
        update={"run": spec.run.model_copy(update={"checkpoint_seconds": 0.0})}
    )  # the 5th checkpoint fails
    with pytest.raises(ResultsError, match="No space left on device.*everything written before is kept"):
        run_single(every_evaluation, tmp_path / "b", seed=0)
    assert (tmp_path / "b" / "checkpoint.pt").exists()  # what was written before is kept


def test_sweep_over_one_variants_own_setting(tmp_path):
    cfg = config(
        tmp_path,
        method="fedavg",
        rounds=20,
        name="two.toml",
        extra='\n[[variants]]\nlabel = "CDR"\nmethod = { name = "fedcdr" }\nserver = { momentum = 0.0 }\nsampler = { '
        'name = "cyclic", cohort = 1 }\n'
        '\n[[variants]]\nlabel = "Avg"\nmethod = { name = "fedavg" }\n',
    )
    out = tmp_path / "s"
    result = runner.invoke(
        app,
        [
            "sweep",
            str(cfg),
            "--variant",
            "CDR",
            "--grid",
            "method.eta=1,10",
            "--out",
            str(out),
            "--workers",
            "1",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert {p.parent.name for p in out.rglob("seed-0")} == {"cdr"} and len(list(out.rglob("seed-0/summary.json"))) == 2
    bad = runner.invoke(app, ["sweep", str(cfg), "--variant", "FedCDR", "--out", str(out), "--quiet"])
    assert bad.exit_code == 2 and "the variants are: CDR, Avg" in bad.output
