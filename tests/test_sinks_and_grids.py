"""Settings that would do nothing or do something twice, and grids too large for one sweep: one line each, before
any folder is written."""

from __future__ import annotations

import socket

import pytest
from conftest import toy_config
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.experiments.sinks import check_sinks
from fedshuffle.experiments.sweep import MAX_POINTS, parse_grid


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


@pytest.mark.parametrize(
    ("override", "field", "says"),
    [
        (
            'run.sinks=["tensorboard", "tensorboard"]',
            "--set run.sinks",
            "'tensorboard' is listed twice; list each sink once",
        ),
        (
            'run.mlflow_uri="file:///tmp/mlruns"',
            "--set run.mlflow_uri",
            "a setting of sink 'mlflow', which run.sinks does not list",
        ),
        (
            'run.wandb_project="p"',
            "--set run.wandb_project",
            "a setting of sink 'wandb', which run.sinks does not list",
        ),
    ],
)
def test_a_sink_twice_or_a_sinks_setting_without_it_is_one_line_and_nothing_is_written(tmp_path, override, field, says):
    cfg = toy_config(tmp_path, method="fedavg", rounds=2, eval_every=1)
    result = cli("run", cfg, "--set", override, "--out", tmp_path / "out", "--quiet")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: ") and says in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_sinks_listed_once_with_their_settings_are_accepted_and_each_takes_only_its_own():
    run = validate(RunSpec, {"run": {"sinks": ["tensorboard", "mlflow"], "mlflow_uri": "file:///tmp/x"}}).run
    assert run.own_settings() == {"mlflow_uri": "file:///tmp/x"}
    assert validate(RunSpec, {"run": {"sinks": []}}).run.own_settings() == {}
    with pytest.raises(ConfigError) as err:
        validate(RunSpec, {"run": {"sinks": ["mlflow"], "wandb_entity": "team"}})
    assert err.value.field == "run.wandb_entity" and "sink 'wandb'" in err.value.message
    assert "sink 'mlflow' takes mlflow_uri" in err.value.message


def test_a_sinks_check_runs_with_its_own_settings_before_any_run(monkeypatch):
    """The mlflow sink's declared check reaches its tracking server with run.mlflow_uri, naming it when it cannot."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(ConfigError) as err:
        check_sinks(["tensorboard", "mlflow"], {"mlflow_uri": f"http://127.0.0.1:{port}"})
    assert err.value.field == "run.mlflow_uri" and "cannot reach the MLflow tracking server" in err.value.message
    check_sinks(["tensorboard", "mlflow"], {"mlflow_uri": "file:///tmp/x"})  # a file store: left to MLflow


def test_a_grid_of_more_points_than_a_sweep_takes_is_refused_before_making_them():
    values = ",".join(str(k) for k in range(1, 101))
    assert len(parse_grid([f"local.epochs={values}", f"local.batch_size={values}"])) == MAX_POINTS
    with pytest.raises(ConfigError) as info:  # 100^5 = 10^10 points: refused at once, none made
        parse_grid(
            [
                f"local.epochs={values}",
                f"local.batch_size={values}",
                f"local.lr={values}",
                f"local.momentum={values}",
                f"local.weight_decay={values}",
            ]
        )
    assert info.value.field == "--grid" and str(info.value).startswith(
        f"--grid: 100 × 100 × 100 × 100 × 100 = 10000000000 points; a sweep takes at most {MAX_POINTS}"
    )


def test_the_sweep_command_refuses_a_20000_point_grid_in_one_line(tmp_path):
    cfg = toy_config(tmp_path, method="fedavg", rounds=2, eval_every=1)
    lrs = ",".join(f"{0.001 + k * 1e-5:.5g}" for k in range(200))
    decays = ",".join(f"{k * 1e-4:.4g}" for k in range(100))
    result = cli(
        "sweep",
        cfg,
        "--grid",
        f"local.lr={lrs}",
        "--grid",
        f"local.weight_decay={decays}",
        "--out",
        tmp_path / "out",
        "--quiet",
        "--workers",
        "1",
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        (
            f"error: --grid: 200 × 100 = 20000 points; a sweep takes at most {MAX_POINTS}: split the grid over several "
            "sweep commands with the same --out (a sweep started again keeps its finished runs and takes other points)"
        )
    ]
    assert not (tmp_path / "out").exists()


def test_where_the_metrics_also_go_is_no_part_of_a_runs_identity_for_every_registered_sink():
    """Adding a sink, or a sink's setting, continues the same results folder: every sink's settings are neutral."""
    from typing import Annotated

    from pydantic import Field

    from fedshuffle.experiments.folders import config_hash, identity
    from fedshuffle.experiments.sinks import SINKS

    def board(root, board_url: Annotated[str | None, Field(description="where (tests only)")] = None):
        return None

    SINKS.add("board", board, "nowhere (tests only)")
    try:
        plain = identity(validate(RunSpec, {"run": {}}).model_dump())
        for run in ({"sinks": ["board"], "board_url": "http://x"}, {"sinks": ["mlflow"], "mlflow_uri": "file:///x"}):
            assert config_hash(identity(validate(RunSpec, {"run": run}).model_dump())) == config_hash(plain)
    finally:
        SINKS.remove("board")
