"""Metrics declared once: communication accounting against hand counts, and a declared metric reaching every output."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle import metrics
from fedshuffle.cli import app
from fedshuffle.experiments.results import METRIC_COLUMNS, read_metrics
from fedshuffle.experiments.runner import run_single
from fedshuffle.experiments.schema import RunSpec, validate

TWO_NN_PARAMS = 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10  # Yang, Fang & Liu (ICLR 2021): 2NN on MNIST


def two_nn_spec(method: str, rounds: int) -> RunSpec:
    """The 2NN (784-200-200-10) on 40 synthetic MNIST-sized samples, 4 clients, 2 per round."""
    return validate(
        RunSpec,
        {
            "method": {"name": method},
            "local": {"lr": 0.01, "batch_size": 10},
            "problem": {"name": "mlp", "hidden": [200, 200]},
            "data": {
                "source": "synthetic",
                "samples": 40,
                "features": 784,
                "classes": 10,
                "partition": "iid",
                "clients": 4,
            },
            "sampler": {"name": "uniform", "cohort": 2},
            "run": {"rounds": rounds, "eval_every": rounds, "dtype": "float32"},
        },
    )


@pytest.mark.parametrize("method, models_each_way", [("fedavg", 1), ("scaffold", 2)])
def test_communication_per_worker_matches_the_hand_count_of_yang_et_al_table_2(tmp_path, method, models_each_way):
    """3 rounds of the 2NN: FedAvg sends one fp32 model each way per round (4.56 MB in the paper's
    Table 2, MNIST n = 10 rows), SCAFFOLD two (model and control variate: 9.12 MB)."""
    rounds = 3
    outcome = run_single(two_nn_spec(method, rounds), tmp_path, 0)
    final = outcome.final
    one_way = rounds * models_each_way * TWO_NN_PARAMS * 4 / 2**20
    assert final["mib_up"] == pytest.approx(one_way) and final["mib_down"] == pytest.approx(one_way)
    assert round(final["mib_up"] + final["mib_down"], 2) == {1: 4.56, 2: 9.12}[models_each_way]
    timing = json.loads((tmp_path / "timing.json").read_text())
    assert timing["compute_seconds"] > 0
    # wall-clock = computation + both directions at 20 MB/s
    assert timing["wallclock_seconds"] == pytest.approx(timing["compute_seconds"] + 2 * one_way / 20.0)
    # bytes_* count every client's traffic in the run's dtype: members × per-worker bytes
    assert final["bytes_up"] == 2 * rounds * models_each_way * TWO_NN_PARAMS * 4


def test_measured_metrics_stay_out_of_the_deterministic_table(tmp_path):
    run_single(two_nn_spec("fedavg", 2), tmp_path, 0)
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header == list(METRIC_COLUMNS) and "compute_seconds" not in header
    assert (tmp_path / "timing.csv").read_text().splitlines()[0].split(",") == ["round", *metrics.names(measured=True)]
    merged = read_metrics(tmp_path / "metrics.csv")
    seconds = merged["compute_seconds"]
    assert seconds[0] == 0 and np.all(seconds[1:] > 0) and np.all(np.diff(seconds) >= 0)


def test_a_method_diagnostic_is_declared_once_and_reaches_csv_summary_table_and_plot(tmp_path):
    """FedCDR declares prox_residual next to its code; nothing else names it."""
    assert metrics.METRICS["prox_residual"].defaults["kind"] == "method"
    config = tmp_path / "cdr.toml"
    config.write_text("""
[method]
name = "fedcdr"
eta = 0.5
[local]
lr = 0.05
batch_size = 5
[problem]
name = "softmax"
[data]
source = "synthetic"
samples = 60
features = 4
classes = 3
partition = "iid"
clients = 3
[sampler]
name = "cyclic"
cohort = 1
[run]
rounds = 4
eval_every = 2
""")
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 0, result.output
    residuals = read_metrics(tmp_path / "o" / "seed-0" / "metrics.csv")["prox_residual"]
    assert np.all(np.isfinite(residuals[1:])) and np.all(residuals[1:] > 0)
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["variants"][next(iter(summary["variants"]))]["final"]["prox_residual"]["mean"] == pytest.approx(
        residuals[-1]
    )
    table = runner.invoke(app, ["table", str(tmp_path / "o"), "--metric", "prox_residual"])
    assert table.exit_code == 0 and "prox_residual" in table.output
    plot = runner.invoke(app, ["plot", str(tmp_path / "o"), "--metric", "prox_residual", "--x", "mib_up"])
    assert plot.exit_code == 0, plot.output


def test_an_undeclared_diagnostic_is_an_error_not_a_silent_drop():
    evaluation = metrics.Evaluation(
        counters=None, num_samples=1, bandwidth_mib_s=20.0, extras={"my_diag": 1.0}, model={}
    )
    with pytest.raises(KeyError, match="my_diag"):
        metrics.evaluate(evaluation)


def test_every_declared_metric_has_a_label_and_a_direction():
    for entry in metrics.METRICS.entries():
        assert (
            entry.summary
            and entry.defaults["better"] in ("min", "max")
            and entry.defaults["kind"] in ("cost", "model", "method")
        )


def test_table_target_reports_the_first_evaluated_round_and_its_cost(tmp_path):
    """``table --target``: the row where test accuracy first reaches the value, with MiB and wall-clock there."""
    spec = validate(
        RunSpec,
        {
            "method": {"name": "fedavg"},
            "local": {"lr": 0.5, "batch_size": 5},
            "problem": {"name": "softmax"},
            "data": {
                "source": "synthetic",
                "samples": 200,
                "features": 5,
                "classes": 3,
                "separation": 3.0,
                "partition": "iid",
                "clients": 4,
                "test_fraction": 0.25,
            },
            "sampler": {"name": "uniform", "cohort": 2},
            "run": {"rounds": 12, "eval_every": 1},
        },
    )
    run_single(spec, tmp_path / "exp" / "seed-0", 0)
    table = read_metrics(tmp_path / "exp" / "seed-0" / "metrics.csv")
    goal = float(np.nanmax(table["test_accuracy"]))
    first = int(np.flatnonzero(table["test_accuracy"] >= goal)[0])
    result = CliRunner().invoke(app, ["table", str(tmp_path / "exp"), "--target", f"test_accuracy={goal}"])
    assert result.exit_code == 0, result.output
    row = result.stdout.strip().splitlines()[-1].split("|")
    assert float(row[2]) == table["round"][first]
    assert float(row[3]) == pytest.approx(table["mib_up"][first] + table["mib_down"][first], rel=1e-3)
    assert row[-2].strip() == "1 of 1"
    never = CliRunner().invoke(app, ["table", str(tmp_path / "exp"), "--target", "test_accuracy=1.5"])
    assert never.exit_code == 0 and "0 of 1" in never.stdout
    bad = CliRunner().invoke(app, ["table", str(tmp_path / "exp"), "--target", "accuracy=0.9"])
    assert bad.exit_code == 2 and "--target" in bad.stderr and "test_accuracy" in bad.stderr
