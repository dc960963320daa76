"""The operator-thread policy of runs: one thread for problems of small closed-form operators, the process'
count for modules, recorded in config.json and said by ``run``; the caller's setting restored afterwards."""

import json

import torch
from typer.testing import CliRunner

import fedshuffle.experiments.runner as runner_mod
from fedshuffle.cli import app
from fedshuffle.executors.choice import run_threads
from fedshuffle.problems import LogisticRegression, ModuleProblem, lenet5
from conftest import toy_config


def test_closed_form_problems_get_one_thread_and_modules_keep_the_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert run_threads(LogisticRegression(5, 0.1), "cpu")[0] == 1
        assert run_threads(ModuleProblem(lenet5((3, 16, 16), 4), sample_shape=(3, 16, 16)), "cpu")[0] == 2
    finally:
        torch.set_num_threads(before)


def test_a_run_uses_records_and_reports_its_threads_and_restores_the_callers(tmp_path, monkeypatch):
    seen = []
    real_train = runner_mod._train
    monkeypatch.setattr(runner_mod, "_train", lambda *a: seen.append(torch.get_num_threads()) or real_train(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = CliRunner().invoke(
            app,
            [
                "run",
                str(toy_config(tmp_path, method="fedavg", rounds=3, eval_every=1)),
                "--out",
                str(tmp_path / "out"),
                "--quiet",
            ],
        )
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
    recorded = json.loads((tmp_path / "out" / "seed-0" / "config.json").read_text())["operator_threads"]
    assert recorded["count"] == 1 and "quadratic" in recorded["reason"]
    assert "operator threads per run: 1 (quadratic has small closed-form operators" in result.stdout
