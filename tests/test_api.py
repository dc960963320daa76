"""The notebook API (fedshuffle.api): experiments from presets, files and dicts; runs; every curve as a
DataFrame equal to the files on disk; plots; custom parts through the registries; arguments checked by name."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import fedshuffle as fs
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.results import read_metrics

SMALL = {
    "experiment": {"name": "small", "seeds": [0, 1]},
    "data": {"source": "targets", "client_sizes": [1, 2, 3]},
    "local": {"lr": 0.02},
    "sampler": {"name": "uniform", "cohort": 2},
    "run": {"rounds": 6, "eval_every": 3},
    "variants": [
        {"label": "FedAvg", "method": {"name": "fedavg"}},
        {"label": "FedShuffle", "method": {"name": "fedshuffle"}},
    ],
}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "small"
    return fs.experiment(SMALL).run(out, progress=False), out


def test_import_fedshuffle_does_not_import_torch_and_every_public_name_resolves():
    code = "import sys, fedshuffle; assert 'torch' not in sys.modules, 'torch imported'; print(len(fedshuffle.__all__))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    for name in fs.__all__:
        assert getattr(fs, name) is not None
    assert fs.metrics.METRICS["f_gap"].defaults["kind"] == "model"
    with pytest.raises(AttributeError):
        fs.no_such_name  # noqa: B018


def test_an_experiment_is_the_same_from_a_preset_a_file_a_dict_and_each_override_form(tmp_path):
    from fedshuffle.experiments.schema import PRESETS_DIR

    text = (PRESETS_DIR / "quickstart.toml").read_text()
    (tmp_path / "mine.toml").write_text(text)
    import tomllib

    forms = [
        fs.experiment("quickstart", overrides={"run.rounds": 7}),
        fs.experiment(tmp_path / "mine.toml", overrides={"run": {"rounds": 7}}),
        fs.experiment(tomllib.loads(text), overrides=["run.rounds=7"]),
        fs.experiment(fs.experiment("quickstart"), overrides={"run.rounds": 7}),
    ]
    dumps = [{k: v.model_dump() for k, v in e.specs().items()} for e in forms]
    assert all(d == dumps[0] for d in dumps) and dumps[0]["FedShuffle"]["run"]["rounds"] == 7
    assert forms[0].variants == ["FedAvg", "FedAvgRR", "FedNova", "FedShuffle"]
    assert forms[0].with_overrides({"run.eval_every": 7}).spec("FedAvg").run.model_dump()["eval_every"] == 7
    assert fs.experiment("quickstart", seeds=range(2)).seeds == [0, 1]


def test_curves_hold_every_run_and_metric_exactly_as_the_files(small_run):
    results, out = small_run
    curves = results.curves
    from fedshuffle import metrics

    assert list(curves.columns[:4]) == ["variant", "point", "seed", "round"]
    assert set(metrics.METRICS.names()) <= set(curves.columns)
    assert len(results.runs) == 4 and set(results.runs.status) == {"complete"}
    assert len(curves) == 4 * 3  # rounds 0, 3, 6 of 2 variants × 2 seeds
    for run in results.runs.itertuples():
        on_disk = read_metrics(Path(run.path) / "metrics.csv")
        mine = curves[(curves.variant == run.variant) & (curves.seed == run.seed)]
        for name in ("round", "f_gap", "dist_sq", "sample_gradients", "bytes_up", "compute_seconds"):
            np.testing.assert_array_equal(mine[name].to_numpy(dtype=float), on_disk[name])
    assert curves["round"].dtype == np.int64 and curves["test_accuracy"].isna().all()
    final = results.final()
    assert (final["round"] == 6).all() and list(final.status) == ["complete"] * 4
    summary = results.summary("f_gap")
    for variant in ("FedAvg", "FedShuffle"):
        values = final[final.variant == variant]["f_gap"].to_numpy()
        assert summary.loc[(variant, ""), ("f_gap", "mean")] == pytest.approx(values.mean())
        assert summary.loc[(variant, ""), ("f_gap", "std")] == pytest.approx(values.std())
        assert summary.loc[(variant, ""), ("seeds", "")] == 2


def test_load_results_reads_the_same_tables_back_and_a_run_is_reproducible(small_run, tmp_path):
    results, out = small_run
    again = fs.load_results(out)
    assert again.curves.equals(results.curves) and again.runs.equals(results.runs)
    rerun = fs.experiment(SMALL).run(tmp_path / "rerun", progress=False, variants=["FedShuffle"], seeds=[1])
    mine = results.curves[(results.curves.variant == "FedShuffle") & (results.curves.seed == 1)]
    np.testing.assert_array_equal(rerun.curves["f_gap"].to_numpy(), mine["f_gap"].to_numpy())


def test_load_results_refuses_a_finished_run_whose_metrics_changed(small_run, tmp_path):
    import shutil

    _, out = small_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    table = next(copy.rglob("metrics.csv"))
    table.write_text(table.read_text() + "\n")  # one byte more than the seal covers
    with pytest.raises(ConfigError) as err:
        fs.load_results(copy)
    assert err.value.field == "paths" and "seal" in err.value.message
    with pytest.warns(UserWarning, match="seal"):
        assert len(fs.load_results(copy, allow_unsealed=True).runs) == len(fs.load_results(out).runs)


def test_sweep_points_become_columns(tmp_path):
    from fedshuffle.experiments.schema import validate, Experiment
    from fedshuffle.experiments.sweep import jobs_for, parse_grid, run_jobs

    config = validate(Experiment, {**SMALL, "experiment": {"seeds": [0]}, "run": {"rounds": 3, "eval_every": 3}})
    run_jobs(jobs_for(config, tmp_path, parse_grid(["local.lr=0.01,0.02"])), show_progress=False)
    results = fs.load_results(tmp_path)
    assert sorted(results.runs["local.lr"].unique()) == [0.01, 0.02]
    assert set(results.curves.point) == {"local.lr=0.01", "local.lr=0.02"}
    assert len(results.summary("f_gap")) == 4  # 2 variants × 2 points


def test_plot_draws_one_line_per_variant_and_refuses_what_the_runs_lack(small_run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, _ = small_run
    ax = results.plot("f_gap", x="epochs", band="minmax")
    assert [line.get_label() for line in ax.get_lines()] == ["FedAvg", "FedShuffle"] and ax.get_yscale() == "log"
    assert len(ax.collections) == 2  # one band per variant (2 seeds each)
    plt.close("all")
    for kwargs, field in [
        ({"metric": "test_accuracy"}, "metric"),
        ({"metric": "nope"}, "metric"),
        ({"x": "f_gap"}, "x"),
        ({"band": "iqr"}, "band"),
    ]:
        with pytest.raises(ConfigError) as err:
            results.plot(**kwargs)
        assert err.value.field == field
    with pytest.raises(ConfigError, match="these runs have: loss, f_gap"):
        results.plot("test_accuracy")


def test_a_diverging_run_is_a_status_and_a_warning_not_an_exception(tmp_path):
    config = {
        **SMALL,
        "local": {"lr": 1e3},
        "sampler": {"name": "full"},
        "run": {"rounds": 40, "eval_every": 40},
        "experiment": {"seeds": [0]},
    }
    with pytest.warns(RuntimeWarning, match="not every run completed"):
        results = fs.experiment(config).run(tmp_path / "boom", progress=False, variants=["FedAvg"])
    assert list(results.runs.status) == ["diverged"]


def test_objective_of_a_variant_is_the_inspectors_on_its_own_parts():
    exp = fs.experiment({**SMALL, "sampler": {"name": "full"}})
    fedavg = exp.objective("FedAvg")
    np.testing.assert_allclose(fedavg.effective_weights, np.array([1, 4, 9]) / 14, rtol=1e-12)
    np.testing.assert_allclose(exp.objective("FedShuffle").effective_weights, np.array([1, 2, 3]) / 6, rtol=1e-12)
    sim = exp.simulation("FedShuffle", seed=3)
    before = sim.params.clone()
    sim.step()
    assert sim.counters.rounds == 1 and not bool((sim.params == before).all())


def test_inspect_objective_names_each_bad_argument():
    algorithm = fs.build_algorithm("fedavg", {"local": {"lr": 0.01}})
    sampler = fs.UniformWithoutReplacement(3, 2)
    report = fs.inspect_objective(algorithm, sampler, [1, 2, 3], None)  # the call: w_i = |D_i|/|D|
    np.testing.assert_allclose(report.weights, [1 / 6, 2 / 6, 3 / 6])
    np.testing.assert_allclose(report.expected_aggregation_weights, [7 / 36, 16 / 45, 9 / 20])
    np.testing.assert_allclose(fs.inspect_objective(algorithm, sampler, [1, 2, 3], [2, 4, 6]).weights, report.weights)
    cases = [
        ((None, sampler, [1, 2, 3], None), {}, "algorithm"),
        ((algorithm, "uniform", [1, 2, 3], None), {}, "sampler"),
        ((algorithm, sampler, [1, 2], None), {}, "sizes"),
        ((algorithm, sampler, [1, 0, 3], None), {}, "sizes"),
        ((algorithm, sampler, [1, 2.5, 3], None), {}, "sizes"),
        ((algorithm, sampler, "abc", None), {}, "sizes"),
        ((algorithm, sampler, [1, 2, 3], [1, 2]), {}, "weights"),
        ((algorithm, sampler, [1, 2, 3], [1, -1, 1]), {}, "weights"),
        ((algorithm, sampler, [1, 2, 3], [0, 0, 0]), {}, "weights"),
        ((algorithm, sampler, [1, 2, 3], "size"), {}, "weights"),
        ((algorithm, sampler, [1, 2, 3], None), {"rounds": 0}, "rounds"),
    ]
    for args, kwargs, field in cases:
        with pytest.raises(ConfigError) as err:
            fs.inspect_objective(*args, **kwargs)
        assert err.value.field == field, (args, kwargs, str(err.value))


def test_api_arguments_are_checked_by_name(small_run, tmp_path):
    results, out = small_run
    exp = fs.experiment(SMALL)
    cases = [
        (lambda: fs.experiment(3), "config"),
        (lambda: fs.experiment("no-such-preset"), "preset"),
        (lambda: fs.experiment(SMALL, overrides={"rnu.rounds": 3}), "overrides"),
        (lambda: fs.experiment(SMALL, overrides=5), "overrides"),
        (lambda: fs.experiment(SMALL, overrides={"local.lr": -1}), "overrides local.lr"),
        (lambda: fs.experiment(SMALL, seeds=[0, 0]), "seeds"),
        (lambda: fs.experiment(SMALL, seeds=[-1]), "seeds"),
        (lambda: exp.spec(), "variant"),
        (lambda: exp.spec("FedNova"), "variant"),
        (lambda: exp.run(tmp_path, variants=["FedNova"]), "variants"),
        (lambda: exp.run(tmp_path, variants="FedAvg"), "variants"),
        (lambda: exp.run(tmp_path, workers=0), "workers"),
        (lambda: exp.run(3), "out"),
        (lambda: exp.run(resume=True), "resume"),
        (lambda: fs.load_results(tmp_path / "missing"), "paths"),
        (lambda: fs.load_results(), "paths"),
        (lambda: results.summary("nope"), "metrics"),
    ]
    for call, field in cases:
        with pytest.raises(ConfigError) as err:
            call()
        assert err.value.field == field, str(err.value)


def test_a_taken_folder_is_left_alone_and_the_folder_used_is_named(small_run, capsys):
    """One rule with ``fedshuffle run``: the runs go into the first free ``out-N``, and a note names it."""
    _, out = small_run
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file())
    again = fs.experiment(SMALL).run(out, seeds=[0], variants=["FedAvg"], progress=False)
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()) == before
    assert {Path(p).parent.parent.name for p in again.runs["path"]} == {f"{out.name}-2"}
    assert again.path == Path(f"{out}-2") and fs.load_results(out).path == out  # the folder written, the folder read
    assert (
        f"{out} already holds results of 'small'; writing to {out}-2 (to continue the runs in {out}: resume=True)"
        in capsys.readouterr().err
    )
    both = fs.load_results(out, f"{out}-2")
    assert both.paths == (out, Path(f"{out}-2"))
    with pytest.raises(ConfigError, match="read from 2 folders; see Results.paths"):
        both.path


def test_parts_registered_after_import_are_accepted_and_unknown_ones_named():
    from fedshuffle.data.catalog import PARTITIONS, SOURCES, Samples
    from fedshuffle.problems import PROBLEMS, quadratic

    def ones(samples: int = 4) -> Samples:
        return Samples(np.ones((samples, 2)), np.zeros(samples, dtype=np.int64), 0)

    def halves(labels, clients=None):
        return np.array_split(np.arange(len(labels)), 2)

    saved = [dict(r._entries) for r in (PROBLEMS, SOURCES, PARTITIONS)]
    try:
        PROBLEMS.add("my_quadratic", quadratic, "a quadratic under another name")
        SOURCES.add("ones", ones, "all-ones targets")
        PARTITIONS.add("halves", halves, "two halves")
        exp = fs.experiment(
            {
                "problem": {"name": "my_quadratic"},
                "data": {"source": "ones", "samples": 6, "partition": "halves"},
                "local": {"lr": 0.1},
            }
        )
        assert list(exp.simulation().data.sizes) == [3, 3]
    finally:
        for registry, entries in zip((PROBLEMS, SOURCES, PARTITIONS), saved):
            registry._entries.clear()
            registry._entries.update(entries)
    for raw, field in [
        ({"problem": {"name": "my_quadratic"}}, "problem.name"),
        ({"data": {"source": "ones"}}, "data.source"),
        ({"data": {"partition": "halves"}}, "data.partition"),
    ]:
        with pytest.raises(ConfigError) as err:
            fs.experiment({**raw, "local": {"lr": 0.1}})
        assert err.value.field == field and "accepted:" in err.value.message


def test_list_presets_has_every_preset_with_its_paper():
    from fedshuffle.experiments.schema import preset_names

    table = fs.list_presets()
    assert list(table.name) == preset_names()
    assert table.set_index("name").loc["quickstart", "variants"] == ["FedAvg", "FedAvgRR", "FedNova", "FedShuffle"]
    assert table.paper.str.len().min() > 0


def test_warnings_are_not_raised_by_a_clean_run(small_run):
    results, _ = small_run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results.summary(["f_gap", "dist_sq"])
        results.final()


def test_metric_columns_include_the_methods_diagnostics_whatever_is_imported_first():
    code = "from fedshuffle.experiments.results import METRIC_COLUMNS; print('prox_residual' in METRIC_COLUMNS)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "True"
    )


def test_a_sweep_from_python_runs_every_point_and_picks_the_best(tmp_path):
    """Experiment.sweep: the grid's every combination × seed, the best point per variant by the final metric,
    the edge of the grid flagged, and bad grids refused naming the argument."""
    exp = fs.experiment(
        {
            "data": {"client_sizes": [1, 2, 3]},
            "local": {"lr": 0.1},
            "run": {"rounds": 6, "eval_every": 3},
            "variants": [{"label": "FedAvgRR", "method": {"name": "fedavg_rr"}}],
        }
    )
    results = exp.sweep({"local.lr": [0.01, 0.1, 0.5]}, tmp_path / "sweep", seeds=[0, 1], pick="f_gap", progress=False)
    assert len(results.runs) == 6 and set(results.runs["status"]) == {"complete"}
    final = (
        results.final()
        .merge(results.runs[["point", "seed", "local.lr"]], on=["point", "seed"])
        .groupby("local.lr")["f_gap"]
        .mean()
    )
    best = results.best["FedAvgRR"]
    assert (
        best["point"] == {"local": {"lr": float(final.idxmin())}}
        and best["mean"] == pytest.approx(final.min())
        and best["candidates"] == 3
    )
    assert best["at_edge"] == (["local.lr"] if final.idxmin() in (0.01, 0.5) else [])
    for bad, argument in (
        ({}, "grid"),
        ({"lr": [1]}, "grid"),
        ({"local.lr": []}, "grid"),
        ({"local.lr": "0.1"}, "grid"),
    ):
        with pytest.raises(fs.ConfigError) as err:
            exp.sweep(bad, tmp_path / "bad", progress=False)
        assert err.value.field == argument
