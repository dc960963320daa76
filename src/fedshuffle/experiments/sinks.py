"""Optional metric sinks for users who already follow runs in TensorBoard, MLflow or Weights & Biases.

Enabled per run with ``[run] sinks = ["tensorboard", "mlflow", "wandb"]``; off by default and never required
(each needs its own package). Every evaluation row is sent as scalars at step = round. Each gathers
an experiment (or sweep) in one place, so its variants compare side by side:

* TensorBoard: one log directory, ``<results>/tensorboard``, with a subdirectory per run laid out as
  the results are (``<variant>/seed-<s>``, under ``<point>/`` in a sweep):
  ``tensorboard --logdir <results>/tensorboard``.
* MLflow (``run.mlflow_uri``, default a local file store ``<results>/mlruns``): one MLflow experiment
  per fedshuffle experiment (its name), one parent run per variant (and grid point), and a nested run
  per seed holding the metrics and the resolved config as parameters. A resumed run continues its
  MLflow run. ``mlflow ui --backend-store-uri <results>/mlruns``. An ``http(s)://`` tracking server
that does not answer within :data:`MLFLOW_CONNECT_SECONDS` is an error at once (one line), and
MLflow's own retries are bounded (unless ``MLFLOW_HTTP_REQUEST_*`` are set).
* Weights & Biases: one W&B project per fedshuffle experiment (``run.wandb_project``, default its name;
  ``run.wandb_entity``, default W&B's), one group per variant (and grid point), and one W&B run per seed named
  ``<variant> seed-<s>``, holding the metrics and the resolved config. Its id is derived from the run's folder, so
  a resumed run continues its W&B run. W&B's own settings apply: ``WANDB_MODE=offline`` keeps everything on the
  machine (``wandb sync`` uploads it later), ``WANDB_DIR`` moves its files, which default to ``<results>/wandb``.
  W&B's console capture and system statistics are off: the command's output stays its own.

``<results>`` is the folder given to ``run``/``sweep`` (the one holding ``manifest.json``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import Field

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Example, Registry, call_with

MAX_PARAMS = 100  # MLflow's limit per log_batch call
#: seconds to reach an http(s) tracking server before the run stops with an error
MLFLOW_CONNECT_SECONDS = 5.0
#: MLflow's HTTP retries and time-out, unless set (its defaults retry for minutes against a server that is down)
MLFLOW_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def check_tracking_server(uri: str) -> None:
    """An ``http(s)://`` tracking URI whose host accepts a connection within :data:`MLFLOW_CONNECT_SECONDS`, or a
    :class:`ConfigError` naming ``run.mlflow_uri`` (other schemes, file stores and databases, are left to MLflow)."""
    try:
        parts = urllib.parse.urlsplit(uri)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ConfigError("run.mlflow_uri", f"{uri!r} is not a valid URI ({exc})") from None
    if parts.scheme not in ("http", "https"):
        return
    if not parts.hostname:
        raise ConfigError("run.mlflow_uri", f"{uri!r} has no host")
    try:
        socket.create_connection((parts.hostname, port), timeout=MLFLOW_CONNECT_SECONDS).close()
    except OSError as exc:
        raise ConfigError(
            "run.mlflow_uri",
            f"cannot reach the MLflow tracking server at {uri} ({exc.strerror or exc or type(exc).__name__}); "
            "start it, correct run.mlflow_uri, or remove 'mlflow' from run.sinks",
        ) from None


class MetricSink(Protocol):
    def log(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in row.items() if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class TensorBoardSink:
    """Scalars of one run into ``<results>/tensorboard/<run folder relative to the results>``."""

    def __init__(self, root: Path, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "run.sinks", "the tensorboard sink needs TensorBoard: pip install 'fedshuffle[tensorboard]'"
            ) from None
        self.log_dir = root / "tensorboard" / Path(run_dir).resolve().relative_to(root)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, row):
        for name, value in _scalars(row).items():
            self.writer.add_scalar(name, value, global_step=int(row["round"]))

    def close(self):
        self.writer.close()


class MLflowSink:
    """One seed's run, nested in its variant's parent run, in the MLflow experiment named after the fedshuffle
    experiment."""

    def __init__(
        self, root: Path, uri: str | None, experiment: str, label: str, point: str, seed: int, params: Mapping[str, Any]
    ) -> None:
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Metric, Param
        except ImportError:
            raise ConfigError("run.sinks", "the mlflow sink needs MLflow: pip install 'fedshuffle[mlflow]'") from None
        if uri is None:  # a local file store in the results folder; MLflow 3 wants this opt-in for file stores
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (root / "mlruns").as_uri()
        check_tracking_server(uri)
        for key, value in MLFLOW_HTTP.items():
            os.environ.setdefault(key, value)
        self.client, self.metric = MlflowClient(uri), Metric
        tags = {"fedshuffle.results": str(root), "fedshuffle.variant": label or "run", "fedshuffle.point": point}
        # parallel workers of one experiment must find, not duplicate, the experiment and the variant's parent run
        lock = (
            Path(tempfile.gettempdir())
            / f"fedshuffle-mlflow-{hashlib.sha256(f'{uri}|{root}'.encode()).hexdigest()[:16]}.lock"
        )
        with open(lock, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            parent = self._find(experiment_id, tags) or self.client.create_run(
                experiment_id, run_name=(label or "run") + (f" [{point}]" if point else ""), tags=tags
            )
        self.parent_id = parent.info.run_id
        child_tags = {**tags, "mlflow.parentRunId": self.parent_id, "fedshuffle.seed": str(seed)}
        child = self._find(experiment_id, child_tags)  # a resumed run continues its MLflow run
        if child is None:
            child = self.client.create_run(experiment_id, run_name=f"seed-{seed}", tags=child_tags)
            items = [Param(k, str(v)[:500]) for k, v in params.items()]
            for k in range(0, len(items), MAX_PARAMS):
                self.client.log_batch(child.info.run_id, params=items[k : k + MAX_PARAMS])
        else:
            self.client.update_run(child.info.run_id, status="RUNNING")
        self.run_id = child.info.run_id

    def _find(self, experiment_id: str, tags: Mapping[str, str]) -> Any:
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items() if "'" not in v)
        keys = set(tags)
        for run in self.client.search_runs([experiment_id], filter_string=query):
            if {k: run.data.tags.get(k) for k in keys} == dict(tags) and (
                "mlflow.parentRunId" in keys or "mlflow.parentRunId" not in run.data.tags
            ):
                return run
        return None

    def log(self, row):
        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[self.metric(k, v, now, int(row["round"])) for k, v in _scalars(row).items()]
        )

    def close(self):
        self.client.set_terminated(self.run_id)
        self.client.set_terminated(self.parent_id)


def require_wandb() -> Any:
    """The ``wandb`` package, or a :class:`ConfigError` naming ``run.sinks`` and how to install it."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "run.sinks", "the wandb sink needs Weights & Biases: pip install 'fedshuffle[wandb]'"
        ) from None
    return wandb


class WandbSink:
    """One seed's run as a Weights & Biases run, grouped by variant (and grid point) in the experiment's project."""

    def __init__(
        self,
        root: Path,
        run_dir: Path,
        *,
        project: str,
        entity: str | None,
        label: str,
        point: str,
        seed: int,
        params: Mapping[str, Any],
    ) -> None:
        wandb = require_wandb()
        group = (label or "run") + (f" [{point}]" if point else "")
        where = Path(run_dir).resolve().relative_to(root).as_posix()
        run_id = hashlib.sha256(f"{root}|{where}".encode()).hexdigest()[:16]  # the same run when resumed
        folder = Path(os.environ.get("WANDB_DIR") or root)
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        config = {**params, "fedshuffle.results": str(root), "fedshuffle.seed": seed}
        self.run = wandb.init(
            project=project,
            entity=entity,
            group=group,
            name=f"{group} seed-{seed}",
            id=run_id,
            resume="allow",
            dir=str(folder),
            config=config,
            settings=settings,
            reinit="create_new",
        )

    def log(self, row):
        self.run.log(_scalars(row), step=int(row["round"]))

    def close(self):
        self.run.finish()


def tensorboard_sink(root: Path, run_dir: Path) -> TensorBoardSink:
    return TensorBoardSink(root, run_dir)


def mlflow_sink(
    root: Path,
    experiment: str,
    label: str,
    point: str,
    seed: int,
    params: Mapping[str, Any],
    mlflow_uri: Annotated[
        str | None, Field(description="tracking URI (default: a local file store, mlruns beside the seed folders)")
    ] = None,
) -> MLflowSink:
    return MLflowSink(root, mlflow_uri, experiment, label, point, seed, params)


def wandb_sink(
    root: Path,
    run_dir: Path,
    experiment: str,
    label: str,
    point: str,
    seed: int,
    params: Mapping[str, Any],
    wandb_project: Annotated[str | None, Field(description="the W&B project (default: the experiment's name)")] = None,
    wandb_entity: Annotated[
        str | None, Field(description="the W&B entity, a user or team (default: W&B's default)")
    ] = None,
) -> WandbSink:
    return WandbSink(
        root,
        run_dir,
        project=wandb_project or experiment,
        entity=wandb_entity,
        label=label,
        point=point,
        seed=seed,
        params=params,
    )


def _reachable(mlflow_uri: str | None = None) -> None:
    if mlflow_uri:
        check_tracking_server(mlflow_uri)


#: metric sinks by the name ``[run] sinks`` lists; an entry's keyword parameters other than the runtime ones are its
#: settings, given in ``[run]`` (``mlflow_uri``, ...). ``check``, where declared, is called with the sink's settings
#: before any run starts, to find a missing package or an unreachable server in one line.
SINKS = Registry(
    "run.sinks", runtime=("root", "run_dir", "experiment", "label", "point", "seed", "params"), noun="sink"
)
SINKS.add("tensorboard", tensorboard_sink, "scalars under `<results>/tensorboard`, a folder per run", example=Example())
SINKS.add(
    "mlflow",
    mlflow_sink,
    "an MLflow experiment per experiment, a parent run per variant, a run per seed",
    check=_reachable,
    example=Example(),
)
SINKS.add(
    "wandb",
    wandb_sink,
    "a W&B project per experiment, a group per variant, a run per seed",
    check=require_wandb,
    example=Example(),
)


def _taken(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Those of ``settings`` (a run's executor and sink settings) that sink ``name`` takes."""
    return {k: v for k, v in settings.items() if k in SINKS[name].setting_names()}


def check_sinks(names: Sequence[str], settings: Mapping[str, Any]) -> None:
    """Each sink's declared ``check`` with its ``settings``: a missing package or an unreachable server, one line."""
    for name in names:
        check = SINKS[name].defaults.get("check")
        if check is not None:
            call_with(check, **_taken(name, settings))


def open_sinks(
    names: Sequence[str],
    run_dir: Path,
    root: Path,
    *,
    settings: Mapping[str, Any],
    experiment: str,
    label: str,
    point: Mapping[str, Mapping[str, Any]],
    seed: int,
    params: Mapping[str, Any],
) -> list[MetricSink]:
    """The sinks a run lists, each with its own of ``settings``; ``root`` is the results folder the run belongs to
    (:func:`~fedshuffle.experiments.folders.experiment_root`), ``point`` a sweep's grid point by section (empty
    outside sweeps)."""
    text = ", ".join(f"{section}.{key}={value}" for section, chosen in point.items() for key, value in chosen.items())
    runtime = {"root": root, "run_dir": run_dir, "experiment": experiment, "label": label, "point": text}
    return [SINKS[name].build(_taken(name, settings), **runtime, seed=seed, params=params) for name in names]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"local": {"lr": 0.1}}`` → ``{"local.lr": 0.1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
