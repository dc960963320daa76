"""``fedshuffle reproduce --smoke``: every paper-scale preset builds and trains at its real model and data shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.data.catalog import SOURCES
from fedshuffle.data.sources import cifar
from fedshuffle.experiments import smoke
from fedshuffle.experiments.schema import load_experiment, preset_names
from conftest import sha
from test_real_datasets import cifar_fixture

GPU_PRESETS = [n for n in preset_names() if load_experiment(n).experiment.budget == "gpu"]


def test_every_gpu_preset_builds_and_runs_two_rounds_at_its_real_shapes():
    """The whole ``--budget gpu --smoke`` run: each preset passes, on random samples of its source's real shapes
    (no data folder is set in tests), with the model the preset names at its full size."""
    results = smoke.smoke(budget="gpu")
    assert [r.preset for r in results] == GPU_PRESETS
    failed = {r.preset: r.error for r in results if r.status != "ok"}
    assert not failed
    for r in results:
        assert "random samples" in r.data and "not found on this machine" in r.data
    by_name = {r.preset: r for r in results}
    # the paper's models at full size: ResNet-18 (CIFAR stem, 100 and 10 classes), the 2×512 character LSTM, LeNet-5,
    # Table 4's CNN
    assert by_name["fedshuffle-cifar100"].parameters == 11_220_132
    assert by_name["yang-table2-cifar10"].parameters == 11_173_962
    assert by_name["fedshuffle-shakespeare-table2"].parameters == 3_217_194
    assert by_name["nastya-fig2-lenet-cifar10"].parameters == 62_006
    assert by_name["yang-fig4-cnn"].parameters == 582_026


def test_smoke_spec_cuts_the_scale_and_keeps_model_method_and_steps():
    experiment = load_experiment("fedshuffle-cifar100")
    for _, spec in experiment.runs():
        cut = smoke.smoke_spec(spec)
        assert (cut.data.clients, cut.sampler.cohort, cut.run.rounds) == (smoke.CLIENTS, smoke.COHORT, smoke.ROUNDS)
        for part in ("problem", "method", "aggregation", "server", "schedule"):
            assert getattr(cut, part) == getattr(spec, part)
        assert cut.local.epochs == 1 and cut.local.model_dump(exclude={"epochs", "steps"}) == spec.local.model_dump(
            exclude={"epochs", "steps"}
        )
        assert cut.local.steps == (
            min(spec.local.steps, smoke.LOCAL_STEPS) if isinstance(spec.local.steps, int) else spec.local.steps
        )
        assert cut.sampler.name == spec.sampler.name and cut.data.source == spec.data.source


@pytest.mark.parametrize("source, partition", [(s, "labels") for s in smoke.SHAPES] + [("cifar10", "shards")])
def test_random_samples_have_the_sources_shapes_and_every_class_they_can(source, partition):
    shape = smoke.SHAPES[source]
    samples = smoke._random_samples(shape, partition, np.random.default_rng(0))
    n = smoke.CLIENTS * (shape.classes if partition == "labels" and not shape.own_clients else smoke.SAMPLES_PER_CLIENT)
    assert samples.features.shape == (n, *shape.sample) and samples.test[0].shape == (smoke.TEST_SAMPLES, *shape.sample)
    if shape.tokens:
        assert samples.features.dtype == np.int64 and samples.labels.shape == (n, *shape.sample)
        assert samples.features.max() < shape.classes
    else:
        assert samples.features.dtype == np.float32 and 0 <= samples.features.min() and samples.features.max() <= 1
        assert len(np.unique(samples.labels)) == min(n, shape.classes)
    assert (samples.client_sizes is not None) == shape.own_clients


def test_real_files_found_on_the_machine_are_cut_class_by_class(tmp_path, monkeypatch):
    """A CIFAR-10 archive in a data folder is used (a cut, every class in turn) and the report says so."""
    raw, _ = cifar_fixture("cifar10", np.random.default_rng(3), 20)
    archive, _, *rest = cifar.CIFAR_ARCHIVES["cifar10"]
    monkeypatch.setitem(cifar.CIFAR_ARCHIVES, "cifar10", (archive, sha(raw), *rest))
    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / archive).write_bytes(raw)
    monkeypatch.setenv("FEDSHUFFLE_DATA", str(tmp_path))
    samples, origin = smoke.smoke_samples("cifar10", {"partition": "labels"})
    assert origin == "real cifar10 files (a cut)"
    assert samples.features.shape == (smoke.CLIENTS * 10, 3, 32, 32)  # every class once per client
    assert np.bincount(samples.labels, minlength=10).tolist() == [smoke.CLIENTS] * 10
    assert np.allclose(
        samples.features * 255, np.round(samples.features * 255), atol=1e-4
    )  # the archive's bytes, not random draws


def test_a_preset_that_does_not_build_fails_by_name_and_the_registry_is_restored(tmp_path):
    broken = tmp_path / "broken-lstm-on-images.toml"
    broken.write_text(
        '[experiment]\nbudget = "gpu"\n[problem]\nname = "char_lstm"\n[data]\nsource = "cifar10"\npartition = '
        '"equal"\nclients = 4\n'
    )
    before = SOURCES["cifar10"].factory
    result = CliRunner().invoke(app, ["reproduce", str(broken), "--smoke"])
    assert result.exit_code == 3
    assert "smoke run failed for broken-lstm-on-images" in result.output
    assert SOURCES["cifar10"].factory is before


def test_smoke_is_for_gpu_presets():
    result = CliRunner().invoke(app, ["reproduce", "--smoke", "--budget", "cpu"])
    assert result.exit_code == 2 and "--budget: --smoke checks the presets sized for a GPU" in result.output


def test_memory_is_checked_before_the_samples_are_allocated(monkeypatch):
    monkeypatch.setenv("FEDSHUFFLE_MAX_MEMORY", "64K")
    (result,) = smoke.smoke(["nastya-fig2-lenet-cifar10"])
    assert result.status == "failed"
    assert (
        "data.source" in result.error
        and "the smoke run's samples" in result.error
        and "64.0 KiB available" in result.error
    )


def test_cifar_cpu_preset_runs_on_a_fixture_archive_served_from_loopback(server, monkeypatch, tmp_path):
    """nastya-fig2-lenet-cifar10-cpu, cut to one round, downloads its archive from a mirror on 127.0.0.1,
    checks it and trains every line on it."""
    base, root, requests = server
    raw, _ = cifar_fixture("cifar10", np.random.default_rng(6), 20)
    archive, _, *rest = cifar.CIFAR_ARCHIVES["cifar10"]
    monkeypatch.setitem(cifar.CIFAR_ARCHIVES, "cifar10", (archive, sha(raw), *rest))
    (root / "cifar10").mkdir()
    (root / "cifar10" / archive).write_bytes(raw)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "run",
            "nastya-fig2-lenet-cifar10-cpu",
            "--set",
            "run.rounds=1",
            "--set",
            f"data.mirror={base}",
            "--seeds",
            "0",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert requests.count(f"/cifar10/{archive}") == 1  # downloaded once, then served from the cache
    finals = [json.loads(p.read_text())["final"] for p in out.glob("*/seed-0/summary.json")]
    assert len(finals) == 4 and all(0 <= f["test_accuracy"] <= 1 for f in finals)
