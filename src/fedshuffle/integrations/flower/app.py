"""A fedshuffle experiment as a Flower ServerApp and ClientApp.

Both apps read the same experiment (a TOML file, a preset, an app's embedded ``experiment.json``, or an
:class:`~fedshuffle.experiments.schema.Experiment`) and the run configuration
(:class:`~fedshuffle.integrations.flower.common.AppSettings`). The ServerApp runs the selected variants
one after another, each with its own :class:`~fedshuffle.integrations.flower.strategy.FedShuffleStrategy`;
all of them are built before the first message, so a bad configuration stops the run before anything is sent.

:func:`simulate` runs both on Flower's simulation engine with a Ray that listens on 127.0.0.1 only.

A run that cannot go on (a bad run config, a missing node, two nodes hosting one client, a client no node hosts, lost
client
state, an invalid reply under ``invalid-reply = "stop"``) ends with fedshuffle's error: Flower logs it
as one line naming the setting or node (:class:`OneLineErrors`), not as a traceback.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedshuffle.integrations.flower import messages  # noqa: F401  isort: skip  (first: refuses an unsupported Flower)
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from flwr.serverapp import Grid, ServerApp

from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.experiments.schema import Experiment
from fedshuffle.integrations.flower.client import NodeRuntime, RuntimeCache, hosted_clients, make_client_app
from fedshuffle.integrations.flower.common import AppSettings, FederatedRun, federated_runs, read_experiment
from fedshuffle.integrations.flower.partitions import Columns
from fedshuffle.integrations.flower.replies import UpdateBound
from fedshuffle.integrations.flower.robust import RobustAggregation
from fedshuffle.integrations.flower.secagg import SecureAggregation
from fedshuffle.integrations.flower.strategy import FederationError, FedShuffleStrategy, handshake

Source = str | Path | Experiment
LOGGER = logging.getLogger("flwr")

#: per process: the runs of an experiment under a run config, and the node runtimes built (Ray actors and
#: :mod:`.worker`'s long-lived ClientApp process keep them between messages)
_RUNS: dict[tuple[str, str], list[FederatedRun]] = {}
_RUNTIMES = RuntimeCache()


#: errors that say what to change: logged as one line, without a traceback
USER_ERRORS = (ConfigError, ResultsError, FederationError)


class OneLineErrors(logging.Filter):
    """Turns a log record carrying one of fedshuffle's :data:`USER_ERRORS` (Flower logs a ServerApp's exception
    with its traceback) into one line: the record's message, the error's type and its text."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, USER_ERRORS):
            text = " ".join(str(error).split())
            record.msg, record.args = f"{record.getMessage()}: {type(error).__name__}: {text}", ()
            record.exc_info, record.exc_text = None, None
        return True


def _one_line_errors() -> None:
    """Install :class:`OneLineErrors` on Flower's logger (once)."""
    if not any(isinstance(f, OneLineErrors) for f in LOGGER.filters):
        LOGGER.addFilter(OneLineErrors())


def _experiment(source: Source) -> Experiment:
    return source if isinstance(source, Experiment) else read_experiment(source)


def runs_for(source: Source, run_config: Mapping[str, Any]) -> list[FederatedRun]:
    """The runs a run configuration selects from ``source`` (cached per process)."""
    key = (
        source.model_dump_json() if isinstance(source, Experiment) else str(source),
        json.dumps(dict(run_config), sort_keys=True, default=str),
    )
    if key not in _RUNS:
        _RUNS[key] = federated_runs(_experiment(source), AppSettings.from_run_config(run_config))
    return _RUNS[key]


def _run_config(defaults: Mapping[str, Any] | None, context: Context) -> dict[str, Any]:
    """The app's run configuration: ``defaults`` under the context's (pyproject.toml and ``flwr run -c``)."""
    return {**(defaults or {}), **dict(context.run_config)}


def server_app(source: Source, run_config: Mapping[str, Any] | None = None) -> ServerApp:
    """The ServerApp: every selected run in turn, results in the run config's ``out`` folder.

    ``run_config`` holds defaults of the run configuration (:class:`AppSettings` keys) for apps started
    without a pyproject.toml (``flwr.simulation.run_simulation``); give the ClientApp the same.
    """
    app = ServerApp()
    _one_line_errors()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        config = _run_config(run_config, context)
        settings = AppSettings.from_run_config(config)
        runs = runs_for(source, config)
        strategies = [
            FedShuffleStrategy(
                run,
                round_timeout=settings.round_timeout,
                connect_timeout=settings.connect_timeout,
                out=settings.out or None,
                resume=settings.resume,
                log=LOGGER.info,
                invalid_reply=settings.invalid_reply,
                node_data=settings.node_data,
                secure=SecureAggregation.from_settings(settings),
                evaluation=settings.evaluation,
                bound=UpdateBound.from_settings(settings),
                robust=RobustAggregation.from_settings(settings),
            )
            for run in runs
        ]
        nodes = handshake(grid, strategies, settings.connect_timeout)
        for strategy in strategies:
            strategy.nodes = dict(nodes)
            strategy.start(grid)

    return app


def client_app(source: Source, run_config: Mapping[str, Any] | None = None, mods: Sequence[Mod] = ()) -> ClientApp:
    """The ClientApp: this node's clients (``clients``, or ``partition-id``) of whichever run a message names, built
    from the node's own files where its node config has a ``data-path`` (``run_config`` as for :func:`server_app`).

    ``mods``: Flower mods (``mod(message, context, call_next) -> Message``) around every message, in order: a
    written app's ``MODS`` (:func:`~fedshuffle.integrations.flower.bundle.app_module`). Flower's
    ``message_size_mod`` and ``arrays_size_mod`` (logging) fit any message; ``fixedclipping_mod``,
    ``adaptiveclipping_mod`` and ``LocalDpMod`` expect Flower's own training message (one array record: the model)
    and answer fedshuffle's (the broadcast and the plans) with an error reply, which stops the run: differential
    privacy is the experiment's ``privacy`` section."""

    _one_line_errors()

    def runtime(context: Context, index: int) -> NodeRuntime:
        runs = runs_for(source, _run_config(run_config, context))
        if not 0 <= index < len(runs):
            raise IndexError(f"run {index} asked for; this app's run config selects {len(runs)} run(s)")
        run, clients, folder = runs[index], hosted_clients(context), context.node_config.get("data-path")
        columns = Columns.from_node_config(context.node_config)
        key = (context.run_id, run.digest, clients, str(folder or ""), columns)
        return _RUNTIMES.get(
            key,
            lambda: (
                NodeRuntime.from_folder(run, clients, str(folder), columns)
                if folder
                else NodeRuntime.build(run, clients)
            ),
        )

    return make_client_app(runtime, mods)


def simulate(
    source: Source,
    num_supernodes: int,
    run_config: Mapping[str, Any] | None = None,
    *,
    cpus: int | None = None,
    client_cpus: float = 1.0,
) -> None:
    """The experiment on Flower's simulation engine (``flwr.simulation.run_simulation``), one virtual SuperNode per
    client.

    Flower's engine runs on Ray, whose services listen on every interface unless told otherwise (an open Ray
    runs any code sent to it). Here Ray is started first, bound to 127.0.0.1 only, with ``cpus`` CPUs (default:
    all) and ``client_cpus`` per ClientApp (:func:`fedshuffle.executors.ray.start_local_ray`); Flower's engine
    uses it, and it is shut down when the run ends or fails. ``run_config`` as for :func:`server_app`.
    """
    import ray
    from flwr.simulation import run_simulation

    from fedshuffle.executors.ray import start_local_ray, stop_local_ray

    if ray.is_initialized():
        raise ConfigError(
            "ray",
            "a Ray is already running in this process; simulate() starts its own, bound to 127.0.0.1 (call "
            "ray.shutdown() first)",
        )
    server, client = server_app(source, run_config), client_app(source, run_config)
    temp_dir = start_local_ray(ray, cpus or os.cpu_count() or 1)
    try:
        run_simulation(
            server,
            client,
            num_supernodes=num_supernodes,
            backend_config={"client_resources": {"num_cpus": client_cpus}},
        )
    finally:
        stop_local_ray(ray, temp_dir)
