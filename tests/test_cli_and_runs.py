"""The command line and the runner: results on disk, bad input, divergence, resume."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle.methods import METHODS
from fedshuffle.cli import app
from fedshuffle.experiments.schema import load_experiment, preset_names
from fedshuffle.experiments.results import read_metrics
from fedshuffle.experiments.runner import run_single
from conftest import toy_config

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
    assert {
        "quickstart",
        "fedshuffle-fig1-full",
        "fedshuffle-fig1-momentum",
        "fedshuffle-fig1-sum-one",
        "fedshuffle-fig1-importance",
        "fedshuffle-fig4-unfinished",
    } <= set(names)
    for name in names:
        runs = load_experiment(name).runs()
        assert runs and all(spec.local.lr for _, spec in runs)


def test_user_targets_file(tmp_path):
    targets = np.random.default_rng(0).normal(size=(5, 3))
    np.save(tmp_path / "t.npy", targets)
    cfg = write_config(tmp_path, BASE.format(targets="t.npy", lr=0.01, rounds=1500))
    result = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "±" not in result.stdout and "| run |" in result.stdout  # one seed: its values, no "± 0"
    final = np.load(tmp_path / "o" / "seed-0" / "final_params.npy")
    metrics = read_metrics(tmp_path / "o" / "seed-0" / "metrics.csv")
    # x* with w_i = |D_i|/|D| is the mean of all targets, and FedShuffle gets there up to its noise floor
    assert metrics["dist_sq"][-1] == pytest.approx(np.sum((final - targets.mean(0)) ** 2))
    assert metrics["dist_sq"][-1] < 1e-3 * metrics["dist_sq"][0]


@pytest.mark.parametrize(
    "edit, field",
    [
        (("lr = 0.1", "lr = -0.1"), "local.lr"),
        (('name = "fedshuffle"', 'name = "fedshufle"'), "did you mean 'fedshuffle'"),
        (("rounds = 10", "roundz = 10"), "did you mean 'rounds'"),
        (('name = "full"', 'name = "uniform"\ncohort = 3'), "sampler.cohort"),
        (("client_sizes = [2, 3]", "client_sizes = [2, 4]"), "data.client_sizes"),
        (("client_sizes = [2, 3]", "client_sizes = [5, 0]"), "data.client_sizes"),
        (('path = "t.npy"', 'path = "missing.npy"'), "data.path"),
        (('path = "t.npy"', 'path = "bad.npy"'), "bad.npy: not a .npy array"),
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
    cfg = write_config(
        tmp_path,
        BASE.format(targets="t.npy", lr=5.0, rounds=500)
        .replace("client_sizes = [2, 3]", "client_sizes = [2, 3]")
        .replace('name = "fedshuffle"', 'name = "fedavg_rr"')
        .replace("rounds = 500", 'rounds = 500\ndtype = "float32"'),
    )
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
    assert np.array_equal(
        np.load(tmp_path / "full" / "final_params.npy"), np.load(tmp_path / "cut" / "final_params.npy")
    )
    assert (tmp_path / "full" / "metrics.csv").read_text() == (tmp_path / "cut" / "metrics.csv").read_text()
    assert full.final["round"] == 300


def test_show_and_presets_commands():
    result = runner.invoke(app, ["show", "fedshuffle-fig1-sum-one"])
    assert result.exit_code == 0 and "sum_one" in result.stdout
    listing = runner.invoke(app, ["presets"], terminal_width=200)
    assert listing.exit_code == 0 and "fedshuffle-fig4-unfinished" in listing.stdout


def test_show_prints_every_default_resolved_and_takes_set():
    result = runner.invoke(app, ["show", "quickstart", "--set", "local.lr=0.5", "--set", "server.momentum=0.5"])
    assert result.exit_code == 0, result.output
    fedavg = json.loads(result.stdout)["runs"]["FedAvg"]
    assert fedavg["local"]["lr"] == 0.5 and fedavg["local"]["order"] == "with_replacement"
    # the server optimizer the parts choose (heavy ball for momentum > 0) and its step size, not null
    assert (
        fedavg["server"]["optimizer"] == "heavy_ball"
        and fedavg["server"]["lr"] == 1.0
        and fedavg["server"]["momentum"] == 0.5
    )
    assert fedavg["method"] == {"name": "fedavg"}  # other methods' settings are not shown
    fedcdr = json.loads(runner.invoke(app, ["show", "fedcdr-femnist"]).stdout)["runs"]["FedCDR"]["method"]
    assert fedcdr["form"] == "y" and fedcdr["exact_prox"] is True and None not in fedcdr.values()
    assert fedcdr["initialization"] == "lazy" and fedcdr["prox_solver"] == "sgd" and fedcdr["warm_start"] is True
    for name in (
        preset_names()
    ):  # every preset's every run shows as plain settings, and each shown setting is one its part takes
        for label, spec in load_experiment(name).runs():
            settings = spec.model_dump(mode="json")
            json.dumps(settings)
            assert set(settings["method"]) == {"name", *METHODS[spec.method.name].setting_names()}, (name, label)
    bad = runner.invoke(app, ["show", "quickstart", "--set", "local.lrr=1"])
    assert bad.exit_code == 2 and "local.lrr" in bad.output and "did you mean 'lr'" in bad.output
    assert runner.invoke(app, ["show", "quickstart", "--set", "lr=1"]).exit_code == 2


def test_tables_off_a_terminal_are_markdown_and_never_cut():
    listing = runner.invoke(app, ["presets"])  # not a terminal: Markdown, one line per preset
    assert listing.exit_code == 0 and "…" not in listing.stdout
    lines = [line for line in listing.stdout.splitlines() if line.startswith("| ")]
    assert len(lines) == len(preset_names()) + 2  # header and rule
    row = next(line for line in lines if line.startswith("| yang-fig2-logistic |"))
    minutes = load_experiment("yang-fig2-logistic").experiment.expected_minutes
    assert row.split(" | ")[1:] == ["Yang et al., ICLR 2021", "Fig. 2 (a)", "cpu", f"~{minutes:g} |"]
    parts = runner.invoke(app, ["show", "server-optimizers"])
    assert "…" not in parts.stdout and "Malitsky & Mishchenko, ICML 2020, Algorithm 1" in parts.stdout


def test_inspect_config_reports_each_variants_objective_weights():
    result = runner.invoke(app, ["inspect", "--config", "quickstart", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    # clients of sizes 1, 2, 3 under full participation: FedAvg weights them by |D_i|², FedShuffle by |D_i|
    assert np.allclose(rows["FedAvg"]["objective"]["effective_weights"], np.array([1, 4, 9]) / 14, atol=1e-12)
    assert np.allclose(rows["FedShuffle"]["objective"]["effective_weights"], np.array([1, 2, 3]) / 6, atol=1e-12)
    assert rows["FedAvg"]["objective"]["biased"] and not rows["FedNova"]["objective"]["biased"]
    assert (
        rows["FedShuffle"]["local_lr"] == pytest.approx(0.004166666666666667)
        and rows["FedShuffle"]["objective"]["mode"] == "exact"
    )
    text = runner.invoke(app, ["inspect", "--config", "quickstart", "--set", "local.lr=0.001"]).stdout
    assert (
        "| 2 | 3 | 0.5 | 0.6429 | 0.6429 | 0.5 | 0.5 |" in text
        and "FedAvg minimizes Σ ŵ_i f_i" in text
        and "0.001" in text
    )


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
    spec = lambda rounds: load_experiment(write_config(tmp_path, RR_CLI.format(server="adam", rounds=rounds))).runs()[
        0
    ][1]  # noqa: E731
    run_single(spec(10), tmp_path / "full", seed=1)
    run_single(spec(6), tmp_path / "cut", seed=1)  # 6 = 1.5 meta-epochs of R = 4
    (tmp_path / "cut" / "summary.json").unlink()
    run_single(spec(10), tmp_path / "cut", seed=1, resume=True, extend=True)
    assert np.array_equal(
        np.load(tmp_path / "full" / "final_params.npy"), np.load(tmp_path / "cut" / "final_params.npy")
    )
    assert (tmp_path / "full" / "metrics.csv").read_text() == (tmp_path / "cut" / "metrics.csv").read_text()


def test_inspect_config_shows_theoretical_step_sizes(tmp_path):
    path = write_config(tmp_path, RR_CLI.format(server="sgd", rounds=5))
    result = runner.invoke(app, ["inspect", "--config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["run"]
    c = row["constants"]
    assert row["local_lr"] == pytest.approx(1 / c["L_sample_max"]) and row["server_lr"] == pytest.approx(
        row["local_lr"] * 4
    )  # N = 20/5 steps
    assert row["global_lr"] == 2.0 and row["from_theory"] == ["lr", "server_lr"] and row["local_steps"] == 4
    bad = write_config(tmp_path, RR_CLI.format(server="adamw", rounds=5))
    result = runner.invoke(app, ["inspect", "--config", str(bad)])
    assert result.exit_code == 2 and "server.optimizer" in result.output


def test_executor_setting_runs_the_same_numbers(tmp_path):
    """run.executor switches the executor, not the results (metrics files identical)."""
    base = load_experiment(write_config(tmp_path, RR_CLI.format(server="sgd", rounds=6))).runs()[0][1]
    for name in ("sequential", "vectorized", "auto", "threaded"):
        spec = base.model_copy(update={"run": base.run.model_copy(update={"executor": name, "threads": 2})})
        run_single(spec, tmp_path / name, seed=2)
    a, b, c, d = (read_metrics(tmp_path / n / "metrics.csv") for n in ("sequential", "vectorized", "auto", "threaded"))
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-12)
    np.testing.assert_allclose(a["loss"], c["loss"], rtol=1e-12)
    np.testing.assert_allclose(a["loss"], d["loss"], rtol=1e-12)
    assert json.loads((tmp_path / "threaded" / "config.json").read_text())["executor"] == {"name": "threaded"}
    picked = json.loads((tmp_path / "auto" / "config.json").read_text())["executor"]
    assert picked["name"] == "vectorized" and picked["chosen"].startswith(
        "auto: vectorized"
    )  # logistic regression: batched closed forms
    bad = write_config(tmp_path, RR_CLI.format(server="sgd", rounds=6).replace("[run]", '[run]\nexecutor = "gpu"'))
    result = runner.invoke(app, ["run", str(bad), "--out", str(tmp_path / "bad")])
    assert (
        result.exit_code == 2 and "run.executor" in result.output and "auto" in result.output
    )  # the accepted values are listed


def fake_sweep(root, lrs=(0.1, 0.2, 0.4), labels=("FedAvg", "FedShuffle"), seeds=(0, 1)):
    """Run folders as a sweep writes them (sealed), with f_gap = 1/(1 + lr·r) · (1 + k): the largest step is each
    variant's best point."""
    from fedshuffle.core.io import write_json
    from fedshuffle.experiments.folders import sealed
    from fedshuffle.experiments.results import write_metrics

    for lr in lrs:
        for k, label in enumerate(labels):
            for seed in seeds:
                folder = root / f"local.lr={lr}" / label.lower() / f"seed-{seed}"
                rows = [{"round": r, "f_gap": (1 + k) / (1 + lr * r) * (1 + 0.01 * seed)} for r in range(0, 101, 10)]
                folder.mkdir(parents=True)
                write_metrics(folder / "metrics.csv", rows)
                write_json(
                    folder / "summary.json",
                    sealed(
                        {
                            "status": "complete",
                            "final": {"f_gap": rows[-1]["f_gap"]},
                            "label": label,
                            "point": {"local": {"lr": lr}},
                            "seed": seed,
                        },
                        folder,
                    ),
                )


def test_sweep_plot_draws_each_variants_best_point_with_the_legend_outside(tmp_path):
    from fedshuffle.experiments.plots import comparison_figure
    from fedshuffle.experiments.report import best_point_runs, collect_runs, group_runs

    fake_sweep(tmp_path / "sweep")
    runs = collect_runs([tmp_path / "sweep"])
    best = best_point_runs(runs, "f_gap")
    assert {r.point["local"]["lr"] for r in best} == {0.4} and len(best) == 4  # 2 variants × 2 seeds of the best point
    for chosen, lines in ((best, 2), (runs, 6)):
        groups = group_runs(chosen)
        fig = comparison_figure({n: [r.path / "metrics.csv" for r in g] for n, g in groups.items()}, metric="f_gap")
        fig.canvas.draw()
        (ax,) = fig.axes
        assert len(ax.get_lines()) == lines
        assert len({(line.get_color(), line.get_linestyle()) for line in ax.get_lines()}) == lines
        assert len({line.get_linestyle() for line in ax.get_lines()}) == min(lines, 4)  # not colour alone
        legend = fig.legends[0].get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1  # outside the axes, right of them
        assert legend.x1 <= fig.bbox.x1 + 1  # and inside the figure
        assert len(fig.legends[0].get_texts()) == lines
    result = runner.invoke(app, ["plot", str(tmp_path / "sweep"), "--metric", "f_gap", "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert "best of 3 grid points" in result.stderr and (tmp_path / "p.png").exists()
    empty = runner.invoke(
        app,
        ["plot", str(tmp_path / "sweep"), "--metric", "test_accuracy", "--all-points", "--out", str(tmp_path / "q")],
    )
    assert (
        empty.exit_code == 2
        and "test_accuracy" in empty.stderr
        and "f_gap" in empty.stderr
        and not (tmp_path / "q.png").exists()
    )


def test_single_seed_tables_print_no_zero_spread(tmp_path):
    fake_sweep(tmp_path / "sweep", lrs=(0.1,), seeds=(0,))
    result = runner.invoke(app, ["table", str(tmp_path / "sweep")])
    assert result.exit_code == 0, result.output
    assert "±" not in result.stdout and "| FedShuffle | 0.1818 | 1 |" in result.stdout
    fake_sweep(tmp_path / "two", lrs=(0.1,), seeds=(0, 1))
    assert "0.09136 ± 0.00045" in runner.invoke(app, ["table", str(tmp_path / "two")]).stdout


def test_a_data_path_is_found_by_the_data_location_rules_from_any_working_directory(tmp_path, monkeypatch):
    from fedshuffle.experiments.build import build_problem_and_data

    targets = np.arange(15.0).reshape(5, 3)
    for folder in ("config", "data/quad", "cache/quad", "elsewhere"):
        (tmp_path / folder).mkdir(parents=True)
    np.save(tmp_path / "data" / "quad" / "t.npy", targets)
    np.save(tmp_path / "cache" / "quad" / "c.npy", 2 * targets)
    monkeypatch.setenv("FEDSHUFFLE_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("FEDSHUFFLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    config = write_config(tmp_path / "config", BASE.format(targets="quad/t.npy", lr=0.01, rounds=5))
    for name, expected in (("quad/t.npy", targets), ("quad/c.npy", 2 * targets)):  # a data folder, then the cache
        spec = load_experiment(config).runs({"data": {"path": name}})[0][1]
        _, data = build_problem_and_data(spec)
        assert np.array_equal(data.features.numpy(), expected)
    np.save(tmp_path / "config" / "t.npy", 3 * targets)  # next to the config file: found first
    spec = load_experiment(write_config(tmp_path / "config", BASE.format(targets="t.npy", lr=0.01, rounds=5))).runs()[
        0
    ][1]
    assert np.array_equal(build_problem_and_data(spec)[1].features.numpy(), 3 * targets)
    missing = runner.invoke(
        app, ["run", str(config), "--set", 'data.path="quad/none.npy"', "--out", str(tmp_path / "o"), "--quiet"]
    )
    assert (
        missing.exit_code == 2
        and "data.path" in missing.stderr
        and str(tmp_path / "data" / "quad" / "none.npy") in missing.stderr
    )
    assert not (tmp_path / "o").exists()


def test_femnist_preset_finds_its_data_in_fedshuffle_data_from_any_directory(shared_data, tmp_path, monkeypatch):
    from fedshuffle.data.sources.fetch import resolve_data_path
    from fedshuffle.experiments.folders import data_hashes

    monkeypatch.setenv("FEDSHUFFLE_DATA", str(shared_data))
    monkeypatch.chdir(tmp_path)
    for label, spec in load_experiment("fedcdr-femnist").runs():
        assert resolve_data_path(spec.data.path, spec.data.data_dirs) == shared_data / "femnist"
        assert "data.path" in data_hashes(spec.model_dump())  # recorded by content, wherever it was found


def test_forty_lines_never_share_colour_and_dash_pattern():
    from fedshuffle.experiments.plots import line_style

    styles = [tuple(line_style(k).values()) for k in range(40)]
    assert len(set(styles)) == 40 and all(a[0] != b[0] and a[1] != b[1] for a, b in zip(styles, styles[1:]))


def test_version_names_fedshuffle_python_pytorch_and_numpy():
    import sys
    from importlib import metadata

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    python, torch = sys.version.split()[0], metadata.version("torch")
    assert line.startswith(f"fedshuffle {metadata.version('fedshuffle')} (Python {python}, PyTorch {torch}, ")
    assert f"NumPy {np.__version__}" in line and "\n" not in line


TWO_VARIANTS = """
[[variants]]
label = "A"

[[variants]]
label = "B"
local = { lr = 0.002 }
"""


def test_show_diff_lists_exactly_the_settings_on_which_the_base_and_the_variants_differ():
    from fedshuffle.experiments.sinks import flatten

    full = json.loads(runner.invoke(app, ["show", "quickstart"]).stdout)["runs"]
    result = runner.invoke(app, ["show", "quickstart", "--diff", "--json"])
    assert result.exit_code == 0, result.output
    diff = json.loads(result.stdout)
    flat = {label: flatten(settings) for label, settings in full.items()}
    differing = {k for k in flat["FedAvg"] if len({json.dumps(f.get(k)) for f in flat.values()}) > 1}
    assert differing <= set(diff) and "method.name" in diff and "run.rounds" not in diff
    for key, values in diff.items():  # each row: the base and every variant, not all equal
        assert set(values) <= {"base", *full}
        assert len({json.dumps(v) for v in values.values()}) > 1 or len(values) < 1 + len(full), (
            key
        )  # differ, or some column lacks it
        for label in full:
            assert values.get(label, "missing") == flat[label].get(key, "missing"), (key, label)
    assert diff["method.name"]["base"] == "fedshuffle" and diff["method.name"]["FedAvg"] == "fedavg"
    table = runner.invoke(
        app, ["show", "quickstart", "--diff"]
    )  # off a terminal: a Markdown table, one row per setting
    rows = [line for line in table.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| setting | base | FedAvg | FedAvgRR | FedNova | FedShuffle |" and len(rows) == len(diff) + 2


def test_show_takes_variant_and_shows_the_seeds_that_will_run(tmp_path):
    quickstart = load_experiment("quickstart")
    result = runner.invoke(app, ["show", "quickstart", "--variant", "FedNova", "--variant", "FedAvg"])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)["runs"]
    assert set(runs) == {"FedNova", "FedAvg"} and quickstart.experiment.seeds
    assert runs["FedNova"]["run"]["seeds"] == quickstart.experiment.seeds and "seed" not in runs["FedNova"]["run"]
    alone = json.loads(runner.invoke(app, ["show", "quickstart", "--set", "run.seed=7"]).stdout)["runs"]
    assert {label: r["run"]["seeds"] for label, r in alone.items()} == {
        label: [7] for label in alone
    }  # as `run --set run.seed=7`
    unseeded = json.loads(
        runner.invoke(
            app, ["show", str(toy_config(tmp_path, method="fedavg", rounds=3, seeds=(4, 5), eval_every=1))]
        ).stdout
    )
    assert unseeded["runs"]["run"]["run"]["seeds"] == [4, 5]
    unknown = runner.invoke(app, ["show", "quickstart", "--variant", "Fed"])
    assert (
        unknown.exit_code == 2
        and "error: --variant: no variant 'Fed'; the variants are: FedAvg, FedAvgRR, FedNova, FedShuffle"
        in unknown.output
    )


def test_show_refuses_labels_that_run_refuses(tmp_path):
    twice = toy_config(tmp_path, method="fedavg", rounds=3, eval_every=1, extra=TWO_VARIANTS.replace('"B"', '"A"'))
    shown, ran = (
        runner.invoke(app, [command, str(twice), "--out", str(tmp_path / "out")][: 2 if command == "show" else 4])
        for command in ("show", "run")
    )
    assert shown.exit_code == ran.exit_code == 2
    assert (
        shown.output.strip()
        == ran.output.strip()
        == "error: variants: variant label 'A' is given twice; every variant label needs its own name"
    )


def test_a_bad_override_is_reported_against_the_set_or_grid_that_gave_it(tmp_path):
    config = toy_config(tmp_path, method="fedavg", rounds=3, eval_every=1, extra=TWO_VARIANTS)
    typo = runner.invoke(app, ["run", str(config), "--set", "local.lrr=0.01", "--out", str(tmp_path / "out")])
    assert typo.exit_code == 2 and typo.output.startswith(
        "error: --set local.lrr: unknown setting (did you mean 'lr'?)"
    )
    own = toy_config(
        tmp_path,
        method="fedavg",
        rounds=3,
        eval_every=1,
        name="own.toml",
        extra=TWO_VARIANTS.replace("lr = 0.002", "lrr = 0.002"),
    )
    mine = runner.invoke(app, ["run", str(own), "--out", str(tmp_path / "out")])
    assert mine.exit_code == 2 and mine.output.startswith(
        "error: variants[1] (B).local.lrr: unknown setting"
    )  # the variant's own typo
    commas = runner.invoke(app, ["run", str(config), "--set", "server.lr=0.5,1", "--out", str(tmp_path / "out")])
    assert commas.exit_code == 2 and commas.output.startswith("error: --set server.lr: ")
    assert "to run each of several values, sweep them: fedshuffle sweep CONFIG --grid server.lr=0.5,1" in commas.output
    grid = runner.invoke(app, ["sweep", str(config), "--grid", "server.lr=-1,1", "--out", str(tmp_path / "out")])
    assert (
        grid.exit_code == 2 and grid.output.startswith("error: --grid server.lr: ") and "sweep them" not in grid.output
    )
    assert not (tmp_path / "out").exists()


def test_data_leaves_a_folder_that_holds_files_alone_as_run_does(tmp_path):
    out = tmp_path / "data"
    first = runner.invoke(app, ["data", "quickstart", "--out", str(out)])
    assert first.exit_code == 0, first.output
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert set(before) == {"data_summary.json", "label_heatmap.png"}
    second = runner.invoke(app, ["data", "quickstart", "--out", str(out), "--json"])
    assert second.exit_code == 0 and json.loads(second.stdout)["heatmap"] == str(
        tmp_path / "data-2" / "label_heatmap.png"
    )
    assert f"note: {out} already holds files; writing to {out}-2" in second.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_a_sweep_figure_is_titled_with_the_experiments_title(tmp_path):
    from fedshuffle.experiments.report import collect_runs
    from fedshuffle.experiments.session import figure_title

    config = toy_config(tmp_path, method="fedavg", rounds=2, eval_every=1)
    config.write_text(
        config.read_text().replace("[experiment]", '[experiment]\nname = "toy"\ntitle = "A toy quadratic"')
    )
    result = runner.invoke(
        app,
        [
            "sweep",
            str(config),
            "--grid",
            "local.lr=0.001,0.002",
            "--out",
            str(tmp_path / "s"),
            "--workers",
            "1",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert figure_title(collect_runs([tmp_path / "s"])) == "A toy quadratic"  # not the name 'toy'
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["title"] == "A toy quadratic"


@pytest.mark.parametrize("width", [80, 120])
def test_help_texts_fill_the_terminal_rather_than_break_at_the_docstrings_line_ends(width):
    """Every line of a command's description but the last of its paragraph is filled to near the terminal's width."""
    import typer

    commands = list(typer.main.get_command(app).commands)
    env = {"COLUMNS": str(width), "TERMINAL_WIDTH": str(width), "NO_COLOR": "1", "TERM": "dumb"}
    for name in commands:
        text = runner.invoke(app, [name, "--help"], env=env, terminal_width=width).output
        lines = text.splitlines()
        shown = max(len(line.rstrip()) for line in lines)  # the width the help was laid out to (its panels fill it)
        start = next(k for k, line in enumerate(lines) if "Usage:" in line) + 1
        end = next(k for k, line in enumerate(lines) if line.lstrip().startswith(("╭", "Options", "Arguments")))
        paragraphs = [
            p.strip("\n").splitlines()
            for p in "\n".join(line.strip() for line in lines[start:end]).split("\n\n")
            if p.strip()
        ]
        assert paragraphs, name
        for paragraph in paragraphs:
            for line, following in zip(paragraph, paragraph[1:]):
                assert len(line) + 1 + len(following.split()[0]) > shown - 4, (
                    f"fedshuffle {name} --help breaks early at {shown} columns: {line!r}"
                )
