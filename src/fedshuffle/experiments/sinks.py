"""Optional metric sinks for users who already follow runs in TensorBoard or MLflow.

Enabled per run with ``[run] sinks = ["tensorboard", "mlflow"]``; off by default and never required
(each needs its own package). Every evaluation row is sent as scalars at step = round. TensorBoard
writes into ``<run>/tensorboard``; MLflow logs to ``run.mlflow_uri`` (default: a local file store,
``mlruns`` beside the run's seed folders), one MLflow run per fedshuffle run with the resolved config as parameters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from fedshuffle.core.errors import ConfigError

SINKS = ("tensorboard", "mlflow")


class MetricSink(Protocol):
    def log(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("run.sinks", "the tensorboard sink needs TensorBoard: pip install 'fedshuffle[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, row):
        for name, value in _scalars(row).items():
            self.writer.add_scalar(name, value, global_step=int(row["round"]))

    def close(self):
        self.writer.close()


class MLflowSink:
    def __init__(self, run_dir: Path, uri: str | None, experiment: str, run_name: str, params: Mapping[str, Any]) -> None:
        try:
            import mlflow
        except ImportError:
            raise ConfigError("run.sinks", "the mlflow sink needs MLflow: pip install 'fedshuffle[mlflow]'") from None
        self.mlflow = mlflow
        if uri is None:  # a local file store next to the results; MLflow 3 wants this opt-in for file stores
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir.parent / "mlruns").resolve().as_uri()
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log(self, row):
        self.mlflow.log_metrics(_scalars(row), step=int(row["round"]))

    def close(self):
        self.mlflow.end_run()


def open_sinks(names: list[str], run_dir: Path, *, uri: str | None, experiment: str, run_name: str, params: Mapping[str, Any]) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    for name in names:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir))
        elif name == "mlflow":
            sinks.append(MLflowSink(run_dir, uri, experiment, run_name, params))
        else:
            raise ConfigError("run.sinks", f"unknown sink {name!r}; accepted: {', '.join(SINKS)}")
    return sinks


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"local": {"lr": 0.1}}`` → ``{"local.lr": 0.1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
