"""A fedshuffle experiment as a Flower ServerApp and ClientApp.

Both apps read the same experiment (a TOML file, a preset, an app's embedded ``experiment.json``, or an
:class:`~fedshuffle.experiments.schema.Experiment`) and the run configuration
(:class:`~fedshuffle.integrations.flower.common.AppSettings`). The ServerApp runs the selected variants
one after another, each with its own :class:`~fedshuffle.integrations.flower.strategy.FedShuffleStrategy`;
all of them are built before the first message, so a bad configuration stops the run before anything is sent.

A run that cannot go on (a bad run config, a missing node, two nodes holding one partition, lost client
state, an invalid reply under ``invalid-reply = "stop"``) ends with fedshuffle's error: Flower logs it
as one line naming the setting or node (:class:`OneLineErrors`), not as a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.experiments.schema import Experiment
from fedshuffle.integrations.flower.client import NodeRuntime, make_client_app, partition_of
from fedshuffle.integrations.flower.common import AppSettings, FederatedRun, federated_runs, read_experiment
from fedshuffle.integrations.flower.strategy import FederationError, FedShuffleStrategy, handshake

Source = str | Path | Experiment
LOGGER = logging.getLogger("flwr")

#: per process: the runs of an experiment under a run config, and the node runtimes built (Ray actors keep them between messages)
_RUNS: dict[tuple[str, tuple], list[FederatedRun]] = {}
_RUNTIMES: dict[tuple[str, int], NodeRuntime] = {}


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
    key = (source.model_dump_json() if isinstance(source, Experiment) else str(source), tuple(sorted(run_config.items())))
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
        strategies = [FedShuffleStrategy(run, round_timeout=settings.round_timeout, connect_timeout=settings.connect_timeout, out=settings.out or None, resume=settings.resume, log=LOGGER.info,
                                         invalid_reply=settings.invalid_reply) for run in runs]
        nodes = handshake(grid, strategies, settings.connect_timeout)
        for strategy in strategies:
            strategy.nodes = dict(nodes)
            strategy.start(grid)

    return app


def client_app(source: Source, run_config: Mapping[str, Any] | None = None) -> ClientApp:
    """The ClientApp: this node's client (``partition-id``) of whichever run a message names (``run_config`` as for :func:`server_app`)."""

    _one_line_errors()

    def runtime(context: Context, index: int) -> NodeRuntime:
        runs = runs_for(source, _run_config(run_config, context))
        if not 0 <= index < len(runs):
            raise IndexError(f"run {index} asked for; this app's run config selects {len(runs)} run(s)")
        run, partition = runs[index], partition_of(context)
        key = (run.digest, partition)
        if key not in _RUNTIMES:
            _RUNTIMES[key] = NodeRuntime.build(run, partition)
        return _RUNTIMES[key]

    return make_client_app(runtime)
