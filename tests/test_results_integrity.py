"""Results you can trust: a results folder knows what it holds, plot and table never mix experiments,
and every failure ends in the documented exit status (2 bad input, 3 diverged or failed, 4 folder
unwritable, 130 interrupted) with one line instead of a traceback.

Each test reproduces a failure found by trying the command line as an adversarial user would.
"""

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from termination import signals_by_default
from typer.testing import CliRunner

import fedshuffle.experiments.loop as loop_mod
import fedshuffle.experiments.plots as plots_mod
import fedshuffle.experiments.runner as runner_mod
from fedshuffle.cli import app
from fedshuffle.experiments.folders import FolderLock, folder_name
from fedshuffle.experiments.plots import _aligned, comparison_figure
from fedshuffle.experiments.results import read_metrics
from conftest import toy_config


def toy(tmp_path, name="toy.toml", method="fedavg", extra=""):
    return toy_config(tmp_path, method=method, rounds=20, seeds=(0, 1), eval_every=5, name=name, extra=extra)


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


def same_files(a, b, names=("metrics.csv", "final_params.npy", "summary.json")):
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{a / name} differs from {b / name}"


def clean(result, status):
    """The command ended with ``status`` (an uncaught exception would be 1) and no traceback."""
    assert result.exit_code == status, result.output
    assert "Traceback" not in result.output


# -- a run folder knows what it holds -------------------------------------------------------------------


def test_resume_refuses_other_settings_and_names_them(tmp_path):
    cfg, out = toy(tmp_path), tmp_path / "out"
    clean(cli("run", cfg, "--out", out, "--quiet"), 0)
    config = (out / "seed-0" / "config.json").read_bytes()
    # finished runs: no longer re-reports the old numbers under the new setting
    refused = cli("run", cfg, "--resume", out, "--set", "local.lr=0.002", "--quiet")
    clean(refused, 2)
    assert "local.lr: 0.004 there, 0.002 now" in refused.stderr
    # an interrupted run: no longer continues with the new setting, config.json untouched
    (out / "seed-1" / "summary.json").unlink()
    clean(cli("run", cfg, "--resume", out, "--set", "local.batch_size=2", "--quiet"), 2)
    assert (out / "seed-0" / "config.json").read_bytes() == config and not (out / "seed-1" / "summary.json").exists()
    # a setting that cannot change the numbers may differ; the same config continues
    clean(cli("run", cfg, "--resume", out, "--set", "plot.metric=dist_sq", "--quiet"), 0)
    assert json.loads((out / "seed-1" / "summary.json").read_text())["status"] == "complete"
    # another experiment resumed into the folder: refused, its summary kept
    summary = (out / "summary.json").read_bytes()
    other = toy(
        tmp_path,
        "other.toml",
        extra='\n[[variants]]\nlabel = "A"\n\n[[variants]]\nlabel = "B"\nmethod = { name = "fednova" }\n',
    )
    result = cli("run", other, "--resume", out, "--quiet")
    clean(result, 2)
    assert "variants only in the config: 'A', 'B'" in result.stderr
    assert (out / "summary.json").read_bytes() == summary and not (out / "a").exists()
    # fewer seeds than the folder holds: refused too (the summary would silently drop runs)
    clean(cli("run", cfg, "--resume", out, "--seeds", "0", "--quiet"), 2)
    config_json = json.loads(config)
    assert len(config_json["config_hash"]) == 64 and config_json["data_hashes"] == {}


def test_data_file_content_is_part_of_the_config(tmp_path):
    np.save(tmp_path / "t.npy", np.eye(6))
    cfg = (
        toy(tmp_path)
        .read_text()
        .replace("client_sizes = [1, 2, 3]", 'client_sizes = [1, 2, 3]\npath = "t.npy"')
        .replace("seeds = [0, 1]", "seeds = [0]")
    )
    (tmp_path / "t.toml").write_text(cfg)
    out = tmp_path / "out"
    clean(cli("run", tmp_path / "t.toml", "--out", out, "--quiet", "--set", "run.rounds=5"), 0)
    np.save(tmp_path / "t.npy", 2 * np.eye(6))  # same name, other numbers
    result = cli("run", tmp_path / "t.toml", "--resume", out, "--quiet", "--set", "run.rounds=5")
    clean(result, 2)
    assert "data.path: 'sha256:" in result.stderr


def test_more_rounds_need_extend_to_and_then_equal_the_longer_run_byte_for_byte(tmp_path):
    cfg = toy(tmp_path, method="fedshuffle_mvr")  # server momentum and MVR state cross the extension
    short, full = tmp_path / "short", tmp_path / "full"
    clean(
        cli("run", cfg, "--out", short, "--seeds", "3", "--set", "run.rounds=17", "--quiet"), 0
    )  # 17: ends off the evaluation grid
    clean(cli("run", cfg, "--out", full, "--seeds", "3", "--set", "run.rounds=40", "--quiet"), 0)
    result = cli("run", cfg, "--resume", short, "--seeds", "3", "--set", "run.rounds=40", "--quiet")
    clean(result, 2)
    assert "--extend-to 40" in result.stderr
    clean(cli("run", cfg, "--resume", short, "--seeds", "3", "--extend-to", "40", "--quiet"), 0)
    same_files(short / "seed-3", full / "seed-3")
    assert list(read_metrics(short / "seed-3" / "metrics.csv")["round"]) == [0, 5, 10, 15, 20, 25, 30, 35, 40]
    clean(cli("run", cfg, "--resume", short, "--seeds", "3", "--extend-to", "30", "--quiet"), 2)  # no shortening
    clean(cli("run", cfg, "--out", tmp_path / "x", "--extend-to", "30", "--quiet"), 2)  # only with --resume
    step = toy(tmp_path, "step.toml", extra='\n[schedule]\nname = "step"\ndecay_at = [0.5]\n')
    clean(cli("run", step, "--out", tmp_path / "step", "--seeds", "0", "--quiet"), 0)
    result = cli("run", step, "--resume", tmp_path / "step", "--seeds", "0", "--extend-to", "40", "--quiet")
    clean(result, 2)
    assert "schedule.name = 'step'" in result.stderr


def test_variant_folders_are_collision_free_and_inside_out(tmp_path):
    def variants(*labels):
        return "".join(f'\n[[variants]]\nlabel = "{label}"\n' for label in labels)

    for labels, message in (
        (("Fed Avg", "fed-avg"), "would share the results folder 'fed-avg'"),
        (("A", "A"), "'A' is given twice"),
        (("summary.json",), "results files use"),
        (("",), "needs a label"),
    ):
        result = cli("run", toy(tmp_path, extra=variants(*labels)), "--out", tmp_path / "o", "--quiet")
        clean(result, 2)
        assert message in result.stderr and not (tmp_path / "o").exists()
    cfg = toy(tmp_path, "u.toml", extra=variants("..", "α-β", "Ωμέγα", "../x"))
    out = tmp_path / "box" / "deep" / "out"
    clean(cli("run", cfg, "--out", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet"), 0)
    assert all(p == out.parent or p.is_relative_to(out) for p in (tmp_path / "box").rglob("*"))  # nothing outside --out
    names = {p.name for p in out.iterdir() if p.is_dir()}
    assert names == {folder_name(".."), "α-β", "ωμέγα", "x"} and folder_name("..").startswith("v-")
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["variants"]) == {"..", "α-β", "Ωμέγα", "../x"}


def test_seeds_are_chosen_on_the_command_line_and_never_counted_twice(tmp_path):
    cfg = toy(tmp_path)
    out = tmp_path / "a"
    clean(cli("run", cfg, "--out", out, "--seeds", "2..3", "--set", "run.rounds=5", "--quiet"), 0)
    assert sorted(p.name for p in out.glob("seed-*")) == ["seed-2", "seed-3"]
    # --set run.seed=S is not ignored where the config lists seeds: it runs seed S alone
    clean(cli("run", cfg, "--out", tmp_path / "b", "--set", "run.seed=5", "--set", "run.rounds=5", "--quiet"), 0)
    assert [p.name for p in (tmp_path / "b").glob("seed-*")] == ["seed-5"]
    for args, message in (
        (["--seeds", "1,1"], "seed 1 is listed twice"),
        (["--seeds", "0..99999999999"], "at most 10000"),
        (["--seeds", "0", "--set", "run.seed=1"], "not both"),
    ):
        result = cli("run", cfg, "--out", tmp_path / "c", *args, "--quiet")
        clean(result, 2)
        assert message in result.stderr and not (tmp_path / "c").exists()
    for seeds, message in (("[0, 0, 0]", "seed 0 is listed twice"), ("[-1]", ">= 0")):
        path = toy(tmp_path, "s.toml")
        path.write_text(path.read_text().replace("seeds = [0, 1]", f"seeds = {seeds}"))
        result = cli("run", path, "--out", tmp_path / "c", "--quiet")
        clean(result, 2)
        assert "experiment.seeds" in result.stderr and message in result.stderr and not (tmp_path / "c").exists()


def test_out_on_an_existing_folder_says_what_it_does(tmp_path):
    cfg, out = toy(tmp_path), tmp_path / "out"
    clean(cli("run", cfg, "--out", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet"), 0)
    stamp = (out / "seed-0" / "metrics.csv").stat().st_mtime_ns
    again = cli("run", cfg, "--out", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet")
    clean(again, 0)
    assert (
        f"{out} already holds results of 'toy'; writing to {out}-2 (to continue the runs in {out}: --resume {out})"
        in " ".join(again.stderr.split())
    )
    assert f"results: {out}-2/" in again.stdout
    assert (out / "seed-0" / "metrics.csv").stat().st_mtime_ns == stamp and (
        tmp_path / "out-2" / "seed-0" / "summary.json"
    ).exists()
    (tmp_path / "file").write_text("x")
    result = cli("run", cfg, "--out", tmp_path / "file", "--quiet")
    clean(result, 4)
    assert "it is a file" in result.stderr
    clean(cli("run", cfg, "--out", "", "--quiet"), 2)
    clean(cli("run", tmp_path, "--out", tmp_path / "new", "--quiet"), 2)  # a folder as the config
    clean(cli("run", cfg, "--resume", out / "seed-0", "--quiet"), 2)  # one run's folder, not the experiment's


def test_one_writer_per_folder(tmp_path):
    cfg, out = toy(tmp_path), tmp_path / "out"
    clean(cli("run", cfg, "--out", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet"), 0)
    with FolderLock(out):  # another process writing the folder (flock locks are per open file, so this stands for one)
        result = cli("run", cfg, "--resume", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet")
    clean(result, 4)
    assert f"is being written by another fedshuffle process (pid {os.getpid()})" in result.stderr
    with FolderLock(out / "seed-0"):
        result = cli("run", cfg, "--resume", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet")
    clean(result, 4)


def test_leftover_temporary_files_are_removed(tmp_path):
    cfg, out = toy(tmp_path), tmp_path / "out"
    clean(cli("run", cfg, "--out", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet"), 0)
    leftovers = [
        out / ".summary.json.abc123.tmp",
        out / "seed-0" / ".checkpoint.pt.x1y2.tmp",
        out / "seed-0" / ".write-test",
    ]
    for path in leftovers:
        path.write_text("partial")
    (out / "seed-0" / "summary.json").unlink()
    clean(cli("run", cfg, "--resume", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet"), 0)
    assert not any(p.exists() for p in leftovers)


def _mapped_state(monkeypatch):
    """Client state in memory-mapped files whatever its size (the schema's minimum is 1 MiB)."""
    real = runner_mod.build_simulation

    def build(spec, seed, state_dir=None):
        return real(
            spec.model_copy(update={"run": spec.run.model_copy(update={"state_memory_mb": 0})}), seed, state_dir
        )

    monkeypatch.setattr(runner_mod, "build_simulation", build)


def test_memory_mapped_state_resumes_after_moving_the_folder_and_is_checked(tmp_path, monkeypatch):
    _mapped_state(monkeypatch)
    cfg = toy(tmp_path, method="scaffold")
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    args = ["--seeds", "0", "--quiet"]
    clean(cli("run", cfg, "--out", "rel", *args, "--set", "run.rounds=10"), 0)  # a relative folder
    clean(cli("run", cfg, "--out", tmp_path / "full", *args), 0)
    assert list((tmp_path / "a" / "rel" / "seed-0" / "client_state").glob("*.bin"))
    shutil.move(tmp_path / "a" / "rel", tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    clean(cli("run", cfg, "--resume", "moved", *args, "--extend-to", "20"), 0)
    same_files(tmp_path / "moved" / "seed-0", tmp_path / "full" / "seed-0")
    (state,) = (tmp_path / "moved" / "seed-0" / "client_state").glob("*.bin")
    for damage in ("truncate", "delete"):
        if damage == "truncate":
            os.truncate(state, 8)
        else:
            state.unlink()
        result = cli("run", cfg, "--resume", "moved", *args, "--extend-to", "30")
        clean(result, 3)
        assert f"{state.name}: " in result.stderr and "do not match their checksums" in result.stderr


def test_damaged_run_files_are_one_line_errors_or_written_again(tmp_path):
    cfg, out = toy(tmp_path), tmp_path / "out"
    args = ["--seeds", "0", "--set", "run.rounds=10", "--quiet"]
    clean(cli("run", cfg, "--out", out, *args), 0)
    clean(cli("run", cfg, "--out", tmp_path / "ref", *args), 0)
    run, ref = out / "seed-0", tmp_path / "ref" / "seed-0"
    # a finished run whose files changed is not taken as finished: written again from its checkpoint, to the same bytes
    params = bytearray((run / "final_params.npy").read_bytes())
    params[-1] ^= 1  # one bit of the model
    (run / "final_params.npy").write_bytes(bytes(params))
    (run / "summary.json").write_text(
        (run / "summary.json").read_text().replace('"status": "complete"', '"status": "diverged"')
    )
    result = cli("table", out)
    clean(result, 2)
    assert "changed after the run finished" in result.stderr
    clean(cli("run", cfg, "--resume", out, *args), 0)
    same_files(run, ref)
    # a checkpoint changed in place still unpickles (one metric's name differs): its digest refuses it
    original = (run / "checkpoint.pt").read_bytes()
    assert original.count(b"compute_seconds") >= 1
    (run / "checkpoint.pt").write_bytes(original.replace(b"compute_seconds", b"compute_secondz", 1))
    result = cli("run", cfg, "--resume", out, "--seeds", "0", "--extend-to", "20", "--quiet")
    clean(result, 3)
    assert "checkpoint.pt: damaged checkpoint (its SHA-256 does not match its contents)" in result.stderr
    # a damaged checkpoint is only an error when it is needed
    (run / "checkpoint.pt").write_bytes(original[:100])
    clean(cli("run", cfg, "--resume", out, *args), 0)
    result = cli("run", cfg, "--resume", out, "--seeds", "0", "--extend-to", "20", "--quiet")
    clean(result, 3)
    assert "checkpoint.pt: damaged checkpoint" in result.stderr
    (run / "config.json").write_text("{not json")
    result = cli("run", cfg, "--resume", out, *args)
    clean(result, 2)
    assert "config.json: unreadable run config" in result.stderr
    (run / "summary.json").write_text(
        json.dumps({"status": "complete", "final": {}, "label": "", "point": {}, "seed": 0})
    )
    (run / "metrics.csv").write_text("round,loss\n0,abc\n")
    for command in (["table", out, "--stat", "best"], ["plot", out]):
        result = cli(*command)  # a summary without its seal is refused ...
        clean(result, 2)
        assert "summary.json: not sealed" in result.stderr
        result = cli(*command, "--allow-unsealed")  # ... and, shown anyway, its damaged table is one line
        clean(result, 2)
        assert "metrics.csv: unreadable metrics table" in result.stderr


# -- plot and table never mix experiments ----------------------------------------------------------------


def test_plot_and_table_keep_folders_apart_and_count_each_seed_once(tmp_path):
    cfg = toy(tmp_path, extra='\n[[variants]]\nlabel = "FedAvg"\n')
    a, b = tmp_path / "a", tmp_path / "b"
    clean(cli("run", cfg, "--out", a, "--set", "run.rounds=10", "--quiet"), 0)
    clean(
        cli(
            "run",
            cfg,
            "--out",
            b,
            "--set",
            "run.rounds=10",
            "--set",
            "local.lr=0.002",
            "--set",
            "run.eval_every=2",
            "--quiet",
        ),
        0,
    )
    table = cli("table", a, b, "--metric", "loss")
    clean(table, 0)
    rows = {line.split("|")[1].strip(): line for line in table.stdout.splitlines() if line.startswith("| FedAvg")}
    assert set(rows) == {"FedAvg (a)", "FedAvg (b)"}
    for folder in (a, b):
        finals = [
            json.loads((folder / "fedavg" / f"seed-{s}" / "summary.json").read_text())["final"]["loss"] for s in (0, 1)
        ]
        assert f"{np.mean(finals):.4g} ± {np.std(finals):.2g} | 2 |" in rows[f"FedAvg ({folder.name})"]
    twice = cli("table", a, a / "fedavg", "--metric", "loss")  # the same runs reached twice are counted once
    clean(twice, 0)
    assert "| 2 |" in twice.stdout and "(a)" not in twice.stdout
    clean(cli("plot", a, b, "--metric", "loss", "--out", tmp_path / "fig"), 0)
    assert (tmp_path / "fig.png").stat().st_size > 10_000
    bad_math = cli("plot", a, "--metric", "loss", "--title", "$\\frac{$", "--out", tmp_path / "math")
    clean(bad_math, 2)
    assert "plot: a title or variant label is not valid matplotlib math text" in bad_math.stderr
    shutil.copytree(a / "fedavg" / "seed-0", a / "fedavg" / "seed-0-copy")
    for command in ("table", "plot"):
        result = cli(command, a, "--metric", "loss")
        clean(result, 2)
        assert "are both seed 0 of 'FedAvg'" in result.stderr


def test_seeds_are_matched_by_round_not_by_row():
    rounds_a, rounds_b = np.array([0.0, 5, 10, 15, 20]), np.array([0.0, 10, 20])
    a = {"round": rounds_a, "loss": rounds_a + 100, "epochs": rounds_a / 2}
    b = {"round": rounds_b, "loss": rounds_b + 200, "epochs": rounds_b}
    xs, ys = _aligned([a, b], "loss", "round")
    np.testing.assert_array_equal(xs, [0, 10, 20])
    np.testing.assert_array_equal(ys, [[100, 110, 120], [200, 210, 220]])
    xs, _ = _aligned([a, b], "loss", "epochs")
    np.testing.assert_array_equal(xs, [0, 7.5, 15])


def test_a_default_plot_metric_no_run_recorded_gives_way_to_what_they_did(tmp_path):
    from fedshuffle.experiments.results import write_metrics

    table = tmp_path / "metrics.csv"
    write_metrics(
        table, [{"round": r, "loss": 2.0 - r / 10, "test_accuracy": 0.1 * r} for r in range(4)]
    )  # no f_gap: no known optimum
    for metric, panels in (("f_gap", ["loss"]), (["f_gap", "test_accuracy"], ["test_accuracy"])):
        fig = comparison_figure({"A": [table]}, metric=metric, recorded_only=True)
        axes = [ax for ax in fig.axes if ax.get_ylabel()]
        assert len(axes) == len(panels) and all(ax.lines for ax in axes)
    assert (
        not comparison_figure({"A": [table]}, metric="f_gap").axes[0].lines
    )  # asked for by name: drawn as asked (empty)


def test_metric_names_are_checked_before_any_work(tmp_path):
    cfg = toy(tmp_path)
    result = cli(
        "sweep",
        cfg,
        "--grid",
        "local.lr=0.1,0.2",
        "--pick",
        "f_gapp",
        "--out",
        tmp_path / "s",
        "--workers",
        "1",
        "--quiet",
    )
    clean(result, 2)
    assert "--pick: unknown metric 'f_gapp'" in result.stderr and not (tmp_path / "s").exists()
    clean(cli("run", cfg, "--out", tmp_path / "r", "--seeds", "0", "--set", "run.rounds=5", "--quiet"), 0)
    for command in (
        ["plot", tmp_path / "r", "--metric", "bogus"],
        ["table", tmp_path / "r", "--metric", "bogus"],
        ["plot", tmp_path / "r", "--x", "time"],
    ):
        result = cli(*command)
        clean(result, 2)
        assert "accepted:" in result.stderr
    result = cli("plot", tmp_path / "r", "--metric", "accuracy")  # a near miss names the metric meant
    clean(result, 2)
    assert "unknown metric 'accuracy' (did you mean 'test_accuracy'?)" in result.stderr


# -- exit statuses ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting, field",
    [
        ("local.step_normalization=[1.0]", "local.step_normalization"),
        ("aggregation.weighting=[1.0, 2.0]", "aggregation.weighting"),
        ("aggregation.weighting=[0.0, 0.0, 0.0]", "aggregation.weighting"),
        ("plot.metric=[]", "plot.metric"),
    ],
)
def test_bad_input_found_while_building_exits_2_before_any_folder(tmp_path, setting, field):
    result = cli("run", toy(tmp_path), "--out", tmp_path / "out", "--set", setting, "--quiet")
    clean(result, 2)
    assert result.stderr.startswith(f"error: {field}:") and not (tmp_path / "out").exists()


def test_unwritable_folders_exit_4_at_start_mid_run_and_for_summary_and_plot(tmp_path, monkeypatch):
    cfg = toy(tmp_path)
    monkeypatch.setattr(runner_mod.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1024})())
    result = cli("run", cfg, "--out", tmp_path / "start", "--quiet")  # no room at the start: 4, not 3
    clean(result, 4)
    assert "MiB free" in result.stderr
    monkeypatch.undo()
    real = loop_mod.write_atomic

    def read_only(path, data):  # a seed folder that cannot be written
        if "seed-1" in str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, data)

    monkeypatch.setattr(loop_mod, "write_atomic", read_only)
    result = cli("run", cfg, "--out", tmp_path / "ro", "--quiet")
    clean(result, 4)
    assert "Permission denied" in result.stderr and "--resume" in result.stderr
    assert (tmp_path / "ro" / "seed-0" / "summary.json").exists()  # what was written is kept
    monkeypatch.undo()

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(plots_mod, "write_atomic", full_disk)
    result = cli("run", cfg, "--out", tmp_path / "plot", "--quiet")
    clean(result, 4)
    assert (
        "No space left on device" in result.stderr
        and json.loads((tmp_path / "plot" / "summary.json").read_text())["variants"]
    )
    result = cli("plot", tmp_path / "plot", "--metric", "loss")
    clean(result, 4)
    assert "cannot write the figure" in result.stderr


def test_plot_leaves_the_runs_figure_alone_and_keeps_its_title(tmp_path, monkeypatch):
    from fedshuffle.experiments import report

    cfg, out = toy(tmp_path), tmp_path / "out"
    clean(cli("run", cfg, "--out", out, "--seeds", "0", "--set", "run.rounds=5", "--quiet"), 0)
    figure = (out / "plot.png").read_bytes()
    titles, real = [], report.plot_runs
    monkeypatch.setattr(report, "plot_runs", lambda *a, **k: titles.append(k["title"]) or real(*a, **k))
    result = cli("plot", out, "--metric", "loss")
    clean(result, 0)
    assert (out / "plot.png").read_bytes() == figure and (out / "plot-loss-by-round.png").stat().st_size > 1000
    assert f"{out / 'plot-loss-by-round.png'}" in " ".join(result.stdout.split())
    clean(cli("plot", out, "--metric", "loss", "--x", "epochs", "--title", "mine", "--out", tmp_path / "fig"), 0)
    assert (
        titles == ["toy", "mine"] and (tmp_path / "fig.png").exists()
    )  # the experiment's name (it has no title), then the one asked for


def test_a_sweep_with_diverged_runs_exits_3(tmp_path):
    result = cli(
        "sweep",
        toy(tmp_path),
        "--grid",
        "local.lr=0.004,50",
        "--seeds",
        "0",
        "--set",
        "run.rounds=20",
        "--set",
        "run.dtype='float32'",
        "--out",
        tmp_path / "s",
        "--workers",
        "1",
        "--pick",
        "f_gap",
        "--quiet",
    )
    clean(result, 3)
    record = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert record["status"] == {"complete": 1, "diverged": 1} and record["best"]["run"]["point"] == {
        "local": {"lr": 0.004}
    }


def test_a_sweep_started_again_keeps_its_runs_and_refuses_another_config(tmp_path):
    cfg, out = toy(tmp_path), tmp_path / "s"
    base = ["sweep", cfg, "--seeds", "0", "--set", "run.rounds=5", "--out", out, "--workers", "1", "--quiet"]
    clean(cli(*base, "--grid", "local.lr=0.004"), 0)
    first = out / "local.lr-0.004" / "seed-0" / "metrics.csv"
    stamp = first.stat().st_mtime_ns
    more = cli(*base, "--grid", "local.lr=0.004,0.002")  # another point added: the finished one is kept
    clean(more, 0)
    assert first.stat().st_mtime_ns == stamp and "1 of its 2 runs are finished" in more.stderr
    clean(cli(*base, "--grid", "local.lr=0.002"), 0)  # fewer points than the folder holds
    other = cli(*base[:-5], "--set", "local.batch_size=2", *base[-5:], "--grid", "local.lr=0.004")
    clean(other, 2)
    assert "local.batch_size: 1 there, 2 now" in other.stderr
    clean(cli("run", cfg, "--resume", out, "--quiet"), 2)  # a sweep folder is not a run's


def _fedshuffle(*args):
    return [sys.executable, "-m", "fedshuffle", *map(str, args)]


def _env():
    return {
        **os.environ,
        "PYTHONPATH": str(Path(runner_mod.__file__).parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


SLOW = """
[problem]
name = "quadratic"
[data]
client_sizes = [40, 40]
[method]
name = "fedavg"
[local]
lr = 0.001
[sampler]
name = "full"
[run]
rounds = 24
eval_every = 2
"""


def test_ctrl_c_exits_130_with_a_resume_hint_and_resumes_exactly(tmp_path):
    cfg = tmp_path / "slow.toml"
    cfg.write_text(SLOW)
    out = tmp_path / "cut"
    proc = subprocess.Popen(
        _fedshuffle("run", cfg, "--out", out, "--quiet"),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=signals_by_default,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "seed-0" / "checkpoint.pt").exists():
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal goes to the whole process group
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and f"--resume {out}" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (out / "seed-0" / "summary.json").exists(), "the run finished before it could be interrupted"
    clean(cli("run", cfg, "--resume", out, "--quiet"), 0)
    clean(cli("run", cfg, "--out", tmp_path / "full", "--quiet"), 0)
    same_files(out / "seed-0", tmp_path / "full" / "seed-0")


def test_a_disk_filling_up_mid_run_exits_4_and_keeps_what_was_written(tmp_path):
    cfg = toy(tmp_path, extra="")
    args = ["--seeds", "0", "--set", "run.rounds=60", "--set", "run.eval_every=1", "--quiet"]

    def limit_file_size():  # every file this process writes stops at 8 KiB ("File too large"), as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, 8 << 10))

    out = tmp_path / "full-disk"
    proc = subprocess.run(
        _fedshuffle("run", cfg, "--out", out, *args),
        env=_env(),
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=300,
    )
    assert proc.returncode == 4, proc.stderr
    assert "File too large" in proc.stderr and f"--resume {out}" in proc.stderr and "Traceback" not in proc.stderr
    written = read_metrics(out / "seed-0" / "metrics.csv")["round"]
    assert 5 < written[-1] < 60 and (out / "seed-0" / "checkpoint.pt").exists()
    assert not list(out.rglob("*.tmp"))
    clean(cli("run", cfg, "--resume", out, *args), 0)  # once there is room again
    assert read_metrics(out / "seed-0" / "metrics.csv")["round"][-1] == 60


# -- appended tables, checkpoints between them ----------------------------------------------------------


class _Killed(Exception):
    pass


def test_a_run_killed_between_checkpoints_resumes_to_the_same_numbers_and_bytes(tmp_path):
    """Rows appended after the last checkpoint are dropped on resume and computed again: the resumed
    folder holds the uninterrupted run's bytes (metrics.csv, timing.csv's rounds, Parquet, final model)."""
    from fedshuffle.experiments.schema import load_experiment
    from fedshuffle.core.checkpoint import load_checkpoint

    spec = load_experiment(toy(tmp_path)).runs()[0][1]
    spec = spec.model_copy(
        update={"run": spec.run.model_copy(update={"rounds": 30, "eval_every": 1, "checkpoint_every": 10})}
    )
    runner_mod.run_single(spec, tmp_path / "full", seed=0)
    rounds = {"n": 0}

    def kill_at_15(done):
        rounds["n"] += done
        if rounds["n"] == 15:
            raise _Killed

    cut = tmp_path / "cut"
    with pytest.raises(_Killed):
        runner_mod.run_single(spec, cut, seed=0, on_round=kill_at_15)
    assert read_metrics(cut / "metrics.csv")["round"][-1] == 15  # appended past the checkpoint...
    assert [row["round"] for row in load_checkpoint(cut / "checkpoint.pt")["rows"]][
        -1
    ] == 10  # ...which holds rounds 0-10
    runner_mod.run_single(spec, cut, seed=0, resume=True)
    same_files(cut, tmp_path / "full", names=("metrics.csv", "metrics.parquet", "final_params.npy"))
    assert read_metrics(cut / "timing.csv")["round"].tolist() == list(range(31))


def test_checkpoints_fall_by_rounds_or_by_seconds_and_always_at_the_end(monkeypatch):
    clock = {"now": 100.0}
    monkeypatch.setattr(loop_mod.time, "monotonic", lambda: clock["now"])
    by_rounds = loop_mod.CheckpointCadence(rounds=4, seconds=30.0, total=10)
    assert [r for r in range(1, 11) if by_rounds.due(r, evaluated=r % 2 == 0)] == [4, 8, 10]
    by_time = loop_mod.CheckpointCadence(rounds=0, seconds=30.0, total=100)
    due = []
    for r in range(1, 101):
        clock["now"] += 1.0  # one second per round
        if by_time.due(r, evaluated=r % 5 == 0):
            by_time.saved()
            due.append(r)
    assert due == [
        5,
        35,
        65,
        95,
        100,
    ]  # the first evaluation, then one per 30 s, at evaluations only, and the last round
    every = loop_mod.CheckpointCadence(rounds=0, seconds=0.0, total=10)
    assert [r for r in range(1, 11) if every.due(r, evaluated=r % 2 == 0)] == [2, 4, 6, 8, 10]


def test_an_appended_row_cut_short_is_taken_back_whole(tmp_path, monkeypatch):
    from fedshuffle.experiments.results import AppendedTable, write_metrics

    rows = [{"round": k, "loss": 1.0 / (k + 1)} for k in range(3)]
    table = AppendedTable(tmp_path / "metrics.csv", rows[:1])
    table.append(rows[1])
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:5]))  # a disk that takes 5 bytes
    with pytest.raises(OSError) as raised:
        table.append(rows[2])
    assert raised.value.errno == errno.EFBIG
    monkeypatch.undo()
    table.close()
    write_metrics(tmp_path / "expected.csv", rows[:2])
    assert (tmp_path / "metrics.csv").read_bytes() == (tmp_path / "expected.csv").read_bytes()
