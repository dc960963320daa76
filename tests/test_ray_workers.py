"""What a Ray worker gets from the driver and checks against it: the driver's ``FEDSHUFFLE_*`` variables as its
``runtime_env``, and a refusal in one line when its fedshuffle, NumPy or PyTorch differs; Ray's worker and retry
counts are configuration keys."""

from __future__ import annotations

import os

import pytest

from fedshuffle.core.errors import ClusterError, ConfigError
from fedshuffle.experiments.schema import RunSpec, validate

ray = pytest.importorskip("ray")

from fedshuffle.executors.ray import RayExecutor, check_versions, package_versions, runtime_env

DRIVER = {"fedshuffle": "0.9.0", "numpy": "2.1.3", "torch": "2.5.1"}


def spec(**run: object) -> RunSpec:
    return validate(
        RunSpec,
        {
            "method": {"name": "fedavg"},
            "local": {"lr": 0.1, "epochs": 1, "batch_size": 2},
            "sampler": {"name": "full"},
            "problem": {"name": "logistic", "l2": 1e-2},
            "data": {
                "source": "synthetic",
                "samples": 40,
                "features": 3,
                "classes": 2,
                "clients": 4,
                "partition": "iid",
            },
            "run": {"rounds": 2, "eval_every": 1, "executor": "ray", **run},
        },
    )


def test_a_worker_with_the_drivers_versions_is_accepted():
    check_versions(DRIVER, dict(DRIVER))
    check_versions(package_versions())  # this process against itself
    assert set(package_versions()) == {"fedshuffle", "numpy", "torch"}


@pytest.mark.parametrize("package", ["fedshuffle", "numpy", "torch"])
def test_a_worker_with_another_version_refuses_in_one_line_naming_the_package_and_both_versions(package):
    worker = {**DRIVER, package: "0.0.1"}
    with pytest.raises(ClusterError) as info:
        check_versions(DRIVER, worker, node="node-7")
    message = str(info.value)
    assert message == (
        f"a Ray worker on node-7 has {package} 0.0.1, the driver {package} {DRIVER[package]}: "
        f"install the driver's {package} on every node"
    )


def test_the_runtime_env_carries_the_drivers_fedshuffle_variables_and_installs_nothing(monkeypatch):
    monkeypatch.setenv("FEDSHUFFLE_DATA", "/data/here")
    monkeypatch.setenv("FEDSHUFFLE_CACHE", "/cache/here")
    monkeypatch.setenv("SOMETHING_ELSE", "private")
    env = runtime_env()
    assert list(env) == ["env_vars"]
    assert env["env_vars"]["FEDSHUFFLE_DATA"] == "/data/here" and env["env_vars"]["FEDSHUFFLE_CACHE"] == "/cache/here"
    assert all(name.startswith("FEDSHUFFLE_") for name in env["env_vars"])
    for name in [n for n in list(os.environ) if n.startswith("FEDSHUFFLE_")]:
        monkeypatch.delenv(name)
    assert runtime_env() == {}


def test_the_ray_the_executor_starts_gets_the_runtime_env(monkeypatch):
    monkeypatch.setenv("FEDSHUFFLE_DATA", "/data/here")
    given = {}

    def init(*args: object, **kwargs: object) -> None:
        given.update(kwargs)
        raise ConnectionError("stopped here")

    monkeypatch.setattr(ray, "init", init)
    executor = RayExecutor(workers=1)
    with pytest.raises(ClusterError, match=r"^Ray did not start \(ConnectionError: stopped here\)$"):
        executor._start()
    assert given["runtime_env"]["env_vars"]["FEDSHUFFLE_DATA"] == "/data/here"


def test_a_worker_refusing_the_drivers_versions_ends_the_run_in_one_line(monkeypatch):
    from fedshuffle.experiments.runner import build_simulation

    sim, _ = build_simulation(spec(ray_workers=1), 0)
    try:
        sim.executor.versions = {**sim.executor.versions, "numpy": "0.0.1"}  # as if the driver had another NumPy
        with pytest.raises(ClusterError) as info:
            sim.step()
    finally:
        sim.close()
    assert "\n" not in str(info.value) and "numpy" in str(info.value) and "the driver numpy 0.0.1" in str(info.value)
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    ("setting", "bad"),
    [("ray_retries", -1), ("ray_retries", 1.5), ("ray_retries", "many"), ("ray_workers", 0), ("ray_workers", 2.5)],
)
def test_rays_worker_and_retry_counts_are_checked_configuration_keys(setting, bad):
    with pytest.raises(ConfigError) as info:
        spec(**{setting: bad})
    assert info.value.field == f"run.{setting}" and "\n" not in str(info.value)


def test_the_retry_count_reaches_the_executor():
    from fedshuffle.experiments.build import build_executor

    for retries in (0, 5):
        executor = build_executor(spec(ray_retries=retries, ray_workers=3).run)
        assert isinstance(executor, RayExecutor) and executor.max_retries == retries and executor.workers == 3
    assert spec().run.ray_retries == 3
