"""The round loop of every run, and the callbacks that write its results folder.

A run is rounds of a server (:class:`~fedshuffle.simulation.Server`: model, server and method state,
counters). How a round's client work is done differs — the in-process executor (``fedshuffle run``) or
messages to Flower nodes (:mod:`fedshuffle.integrations.flower`) — and is the driver's ``step``; the rest
is :class:`RoundLoop`, the same for both::

    evaluate x⁰                                         (a resumed run continues its rows instead)
    repeat until run.rounds (or until a pause):
        step()                                          one round, however its client work is done
        evaluate every run.eval_every rounds, at the last round, and whenever the model is not finite
        f(x) or x not finite: stop, "diverged at round r: model|loss is not finite", keep what was written
        callbacks after the round                       checkpoint cadence, progress
    callbacks at the end                                tables synced, final model, summary sealed

What becomes of each evaluation and round is told to :class:`Callback` s, as pfl-research's training
process tells its ``TrainingProcessCallback`` s (Granqvist et al., 2024, arXiv:2404.06430). The
results folder of a run is written by the callbacks below (:func:`folder_callbacks`): metric tables
appended row by row, sinks, checkpoints on :class:`CheckpointCadence`, and the final files with the
seal (:func:`~fedshuffle.experiments.folders.sealed`).
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedshuffle import metrics
from fedshuffle.core.checkpoint import REMEDY, describe, mismatch, other_keys, read_checkpoint, save_checkpoint
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import read_text, write_atomic, write_json
from fedshuffle.experiments.folders import sealed
from fedshuffle.experiments.results import METRIC_COLUMNS, TIMING_COLUMNS, AppendedTable, write_parquet
from fedshuffle.experiments.sinks import MetricSink
from fedshuffle.simulation import Counters, Server

#: a run that stopped before its last round because it was asked to (``until``): resumable, not finished
PAUSED = "paused"


@dataclass
class Driver:
    """What a run's rounds are made of: the server ``sim`` (a :class:`~fedshuffle.simulation.Simulation`, or Flower's
    :class:`~fedshuffle.integrations.flower.strategy.ServerHalf`), ``step``
    (one round of it), ``score`` (the current model's scores: :class:`~fedshuffle.metrics.ModelScores` and
    any local-model scores), and what ``config.json`` records of it (``executor``, ``step_sizes``)."""

    sim: Any
    step: Callable[[], object]
    score: Callable[[], Mapping[str, float | None]]
    executor: dict[str, Any]
    step_sizes: dict[str, Any] = field(default_factory=dict)


class Callback:
    """Told what the loop does; every method is optional. ``close`` is called however the loop ends."""

    def on_start(self, loop: RoundLoop) -> None:
        """Before the first round of this call (after a resumed run's state and rows are restored)."""

    def on_evaluation(self, loop: RoundLoop, row: Mapping[str, Any]) -> None:
        """A metrics row was recorded (``loop.rows[-1]``)."""

    def after_round(self, loop: RoundLoop, evaluated: bool) -> None:
        """A round ended and the run goes on (not after the round a run diverged at)."""

    def on_end(self, loop: RoundLoop, status: str, message: str) -> None:
        """The run finished: ``status`` is ``complete`` or ``diverged`` (not called for a pause)."""

    def close(self) -> None:
        """Release what the callback holds (files, tracking runs)."""


class RoundLoop:
    """Drives a :class:`Driver` to ``rounds`` (``run.rounds``), evaluating every ``eval_every`` rounds; ``rows``
    are the evaluations so far (a resumed run's, up to its checkpoint)."""

    def __init__(
        self,
        driver: Driver,
        *,
        rounds: int,
        eval_every: int,
        bandwidth_mib_s: float,
        rows: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.driver, self.sim = driver, driver.sim
        self.rounds, self.eval_every, self.bandwidth_mib_s = rounds, eval_every, bandwidth_mib_s
        self.rows: list[dict[str, Any]] = list(rows)
        self.stop = rounds  # the last round of this call

    def _evaluate(self, callbacks: Sequence[Callback]) -> dict[str, Any]:
        """The row of the current model: the run's costs, the model's scores, the method's diagnostics."""
        sim = self.sim
        row = metrics.evaluate(
            metrics.Evaluation(
                sim.counters, sim.data.num_samples, self.bandwidth_mib_s, sim.last_extras, self.driver.score()
            )
        )
        self.rows.append(row)
        for callback in callbacks:
            callback.on_evaluation(self, row)
        return row

    def run(self, callbacks: Sequence[Callback] = (), until: int | None = None) -> tuple[str, str]:
        """The rounds left (up to round ``until`` if given: a pause); returns the status and its message."""
        sim = self.sim
        self.stop = self.rounds if until is None else min(until, self.rounds)
        status, message = "complete", ""
        try:
            for callback in callbacks:
                callback.on_start(self)
            if not self.rows:
                self._evaluate(callbacks)
            while sim.counters.rounds < self.stop:
                self.driver.step()
                r = sim.counters.rounds
                finite = bool(torch.isfinite(sim.params).all())
                evaluated = not finite or r % self.eval_every == 0 or r == self.rounds
                if evaluated:
                    row = self._evaluate(callbacks)
                    if not finite or not math.isfinite(row["loss"]):
                        status = "diverged"
                        message = f"diverged at round {r}: {'model' if not finite else 'loss'} is not finite"
                        break
                for callback in callbacks:
                    callback.after_round(self, evaluated)
            if status == "complete" and sim.counters.rounds < self.rounds:
                return PAUSED, f"paused at round {sim.counters.rounds} of {self.rounds}"
            for callback in callbacks:
                callback.on_end(self, status, message)
        finally:
            for callback in callbacks:
                callback.close()
        return status, message


# -- the results folder, written by callbacks --------------------------------------------------------------


class CheckpointCadence:
    """When a run checkpoints: every ``rounds`` rounds (``run.checkpoint_every``), or, with ``rounds = 0``, at an
    evaluation once ``seconds`` (``run.checkpoint_seconds``) have passed since the last checkpoint, the first
    evaluation after the start included; always at the last round (``total``: a run can be extended or resumed from
    there).

    A checkpoint rewrites the whole state and every row so far, so checkpointing at every evaluation makes a run
    quadratic in its evaluations; between checkpoints the metric tables only grow by appended rows. Where the
    checkpoints fall does not change a run's numbers: a run resumed from any of them gives the same files.
    """

    def __init__(self, rounds: int, seconds: float, total: int) -> None:
        self.rounds, self.seconds, self.total = rounds, seconds, total
        self.last: float | None = None

    def due(self, round_: int, evaluated: bool) -> bool:
        if round_ == self.total:
            return True
        if self.rounds:
            return round_ % self.rounds == 0
        return evaluated and (self.last is None or time.monotonic() - self.last >= self.seconds)

    def saved(self) -> None:
        self.last = time.monotonic()


def _counters_mismatch(counters: Any) -> str | None:
    """How a checkpoint's counters differ from :class:`~fedshuffle.simulation.Counters` (None: they do not)."""
    if not isinstance(counters, Mapping):
        return f"state.counters is a {type(counters).__name__}, expected a dict"
    declared = {f.name: str(f.type) for f in fields(Counters)}
    why = other_keys(counters, declared, "state.counters")
    for name, kind in declared.items():
        value = counters[name] if why is None else 0
        if kind == "int" and not (type(value) is int and value >= 0):
            return f"state.counters.{name} = {value!r}, expected an integer >= 0"
        if kind != "int" and not (_number(value) or value is None and "None" in kind):
            return f"state.counters.{name} = {value!r}, expected a number"
    return why


def _number(value: Any) -> bool:
    """An int or a float (a bool is neither here)."""
    return type(value) in (int, float)


def _extras_mismatch(extras: Any) -> str | None:
    """How a checkpoint's ``last_extras`` (a round's diagnostics: name → number) is not one."""
    if isinstance(extras, Mapping) and all(isinstance(k, str) and _number(v) for k, v in extras.items()):
        return None
    return "state.last_extras is not a dict of numbers"


def _store_mismatch(saved: Any, store: Any) -> str | None:
    """How a checkpoint's client state differs from what ``store`` (a :class:`~fedshuffle.state.ClientStateStore`)
    keeps: a tag, one flag per client, and per field either the clients' rows (in memory) or the written rows' hashes
    (in files). Which of the two, and how many clients, :meth:`~fedshuffle.state.ClientStateStore.load_state_dict`
    checks."""
    if store is None:
        return None if saved is None else "state.client_store holds client state, the run's method keeps none"
    if not isinstance(saved, Mapping) or type(saved.get("tag")) is not int:
        return "state.client_store has no integer tag"
    created = saved.get("created")
    if not isinstance(created, np.ndarray) or created.dtype != np.bool_ or created.ndim != 1:
        return "state.client_store.created is not one flag per client"
    kept = "arrays" if "arrays" in saved else "hashes" if "hashes" in saved else None
    if kept is None or not isinstance(saved[kept], Mapping):
        return "state.client_store holds neither the clients' rows nor their hashes"
    why = other_keys(saved[kept], store.fields, f"state.client_store.{kept}")
    for name, dim in store.fields.items():
        array = saved[kept].get(name) if why is None else None
        if kept == "arrays":
            dtype, shape = store.np_dtype, (len(created), dim)
        else:
            dtype, shape = np.dtype(np.uint64), (int(created.sum()),)
        if why is None and not (isinstance(array, np.ndarray) and array.dtype == dtype and array.shape == shape):
            why = f"state.client_store.{kept}.{name} is a {describe(array)}, the run's is a ndarray {shape} of {dtype}"
    return why


#: the columns every recorded row holds (None where a metric is not measured): the metric and timing tables'
COLUMNS = tuple(dict.fromkeys((*METRIC_COLUMNS, *TIMING_COLUMNS)))


def _rows_mismatch(rows: Any, rounds: int, metrics_csv: Path) -> str | None:
    """How ``rows`` is not the metric records up to round ``rounds`` (dicts of numbers with every column of
    :data:`COLUMNS`, rounds increasing), or differs from the rows ``metrics_csv`` holds up to that round (it may lack
    the last ones: it is not synced as it grows)."""
    if not isinstance(rows, list):
        return f"rows is a {type(rows).__name__}, expected a list of records"
    previous = -1
    for k, row in enumerate(rows):
        values = row.items() if isinstance(row, dict) else [(None, None)]
        if not all(isinstance(c, str) and (v is None or _number(v)) for c, v in values):
            return f"rows[{k}] is not a record of numbers"
        missing = sorted(set(COLUMNS).difference(row))
        if missing:
            return f"rows[{k}] lacks the column{'s' if len(missing) > 1 else ''} {', '.join(missing[:3])}"
        at = row.get("round")
        if type(at) is not int or not previous < at <= rounds:
            return f"rows[{k}] is of round {at!r}, after round {previous} and up to the checkpoint's {rounds}"
        previous = at
    try:
        table = csv.DictReader(io.StringIO(read_text(metrics_csv), newline=""))
        written = [int(r["round"]) for r in table if int(r["round"]) <= rounds]
    except (OSError, csv.Error, ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None  # no table to hold the rows against (it is written again from them)
    held = [row["round"] for row in rows]
    if written != held[: len(written)]:
        return f"rows hold rounds {held[:8]}{'...' if len(held) > 8 else ''}, {metrics_csv.name} rounds {written[:8]}"
    return None


def check_state(saved: Mapping[str, Any], sim: Any, path: Path) -> None:
    """Refuse (the ``damaged checkpoint (...)`` line) a decoded checkpoint that is not of ``sim``'s own state: the keys
    of :meth:`state_dict`, its tensors' dtypes and shapes, integer counters, and the rows as records of numbers
    consistent with ``metrics.csv``. Nothing of the run is read or changed (a file-backed client store is not
    asked for its state, which writes its journal)."""
    store = getattr(sim, "store", None)
    own = {**Server.state_dict(sim), "client_store": None} if store is not None else sim.state_dict()
    state = saved.get("simulation")
    special = ("counters", "last_extras", "client_store")
    why = (
        other_keys(saved, ("simulation", "rows"), "checkpoint")
        or (None if isinstance(state, Mapping) else f"state is a {type(state).__name__}, expected a dict")
        or other_keys(state, own, "state")
        or mismatch({k: state[k] for k in own if k not in special}, {k: own[k] for k in own if k not in special})
        or _counters_mismatch(state["counters"])
        or _extras_mismatch(state["last_extras"])
        or _store_mismatch(state.get("client_store"), store)
        or _rows_mismatch(saved["rows"], state["counters"]["rounds"], path.with_name("metrics.csv"))
    )
    if why:
        raise ConfigError(str(path), f"damaged checkpoint ({why}); {REMEDY}")


def load_checkpoint(path: Path, sim: Any, run: Mapping[str, Any], total: int) -> list[dict[str, Any]]:
    """Restore ``sim`` from a checkpoint of ``run`` (config hash, variant, seed), checked against ``sim``'s own state
    (:func:`check_state`); returns the metric rows recorded up to it."""
    recorded, saved = read_checkpoint(path, run)
    check_state(saved, sim, path)
    state, rows = saved["simulation"], saved["rows"]
    rounds = state["counters"]["rounds"]
    if recorded.get("round") != rounds or rounds > total:
        why = f"recorded for round {recorded.get('round')!r}, holds round {rounds}, the run has {total}"
        raise ConfigError(str(path), f"damaged checkpoint ({why}); {REMEDY}")
    sim.load_state_dict(state)
    return rows


class MetricTables(Callback):
    """``metrics.csv`` (deterministic columns) and ``timing.csv`` (measured), one appended row per evaluation;
    opened with the rows so far (a resumed run's rows past its checkpoint are dropped)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.tables: list[AppendedTable] = []

    def on_start(self, loop: RoundLoop) -> None:
        for name, columns in (("metrics.csv", METRIC_COLUMNS), ("timing.csv", TIMING_COLUMNS)):
            self.tables.append(AppendedTable(self.run_dir / name, loop.rows, columns))

    def on_evaluation(self, loop: RoundLoop, row: Mapping[str, Any]) -> None:
        for table in self.tables:
            table.append(row)

    def on_end(self, loop: RoundLoop, status: str, message: str) -> None:
        for table in self.tables:  # the finished tables are what summary.json seals: on disk before it
            table.sync()

    def close(self) -> None:
        for table in self.tables:
            table.close()
        self.tables = []


class SinkLog(Callback):
    """Every row to the run's sinks (TensorBoard, MLflow: :mod:`fedshuffle.experiments.sinks`)."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self.sinks = list(sinks)

    def on_evaluation(self, loop: RoundLoop, row: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class Checkpoints(Callback):
    """``checkpoint.pt`` (the server's state and every row so far, recorded for ``owner``: config hash, variant,
    seed) and ``metrics.parquet`` on ``cadence``, and at the round a paused run stops."""

    def __init__(self, run_dir: Path, owner: Mapping[str, Any], every: int, seconds: float) -> None:
        self.run_dir, self.owner = Path(run_dir), dict(owner)
        self.every, self.seconds = every, seconds
        self.cadence: CheckpointCadence | None = None

    def on_start(self, loop: RoundLoop) -> None:
        self.cadence = CheckpointCadence(self.every, self.seconds, loop.stop)

    def after_round(self, loop: RoundLoop, evaluated: bool) -> None:
        if self.cadence.due(loop.sim.counters.rounds, evaluated):
            self.save(loop)

    def save(self, loop: RoundLoop) -> None:
        """The resume point: the server's state and every row so far (the tables past it are rewritten from these
        rows on resume)."""
        sim = loop.sim
        save_checkpoint(
            self.run_dir / "checkpoint.pt",
            {"simulation": sim.state_dict(), "rows": loop.rows},
            {**self.owner, "round": sim.counters.rounds},
        )
        sim.commit_checkpoint()
        write_parquet(self.run_dir / "metrics.parquet", loop.rows)
        self.cadence.saved()


class Progress(Callback):
    """``on_round(n)`` with the rounds done: those of a resumed run at the start, then 1 per round."""

    def __init__(self, on_round: Callable[[int], None]) -> None:
        self.on_round = on_round

    def on_start(self, loop: RoundLoop) -> None:
        if loop.sim.counters.rounds:
            self.on_round(loop.sim.counters.rounds)

    def after_round(self, loop: RoundLoop, evaluated: bool) -> None:
        self.on_round(1)


class FinalFiles(Callback):
    """At the end: ``metrics.parquet``, ``final_params.npy`` (flat float64), ``summary.json`` (status, message,
    final metrics, rounds and ``meta``: label, point, seed; sealed with the files' SHA-256) and ``timing.json``."""

    def __init__(self, run_dir: Path, meta: Mapping[str, Any]) -> None:
        self.run_dir, self.meta = Path(run_dir), dict(meta)

    def on_end(self, loop: RoundLoop, status: str, message: str) -> None:
        rows = loop.rows
        write_parquet(self.run_dir / "metrics.parquet", rows)
        npy = io.BytesIO()
        np.save(npy, loop.sim.params.detach().double().cpu().numpy())
        write_atomic(self.run_dir / "final_params.npy", npy.getvalue())
        final = {k: v for k, v in rows[-1].items() if k in METRIC_COLUMNS}
        summary = {
            "status": status,
            "message": message,
            "final": final,
            "rounds": loop.sim.counters.rounds,
            **self.meta,
        }
        write_json(self.run_dir / "summary.json", sealed(summary, self.run_dir))
        write_json(self.run_dir / "timing.json", {k: rows[-1][k] for k in TIMING_COLUMNS})


def folder_callbacks(
    run_dir: Path, run: Any, owner: Mapping[str, Any], meta: Mapping[str, Any], sinks: Sequence[MetricSink]
) -> list[Callback]:
    """The callbacks that write a run's results folder, in the order they must act (tables before sinks; the
    final files, which seal the tables, last); ``run`` is the spec's ``[run]`` section."""
    return [
        MetricTables(run_dir),
        SinkLog(sinks),
        Checkpoints(run_dir, owner, run.checkpoint_every, run.checkpoint_seconds),
        FinalFiles(run_dir, meta),
    ]
