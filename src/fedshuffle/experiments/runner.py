"""Running experiments: seeded runs with metrics, checkpoints, divergence handling and results on disk.

Layout of a results folder::

    OUT/
      manifest.json             what the folder holds (see fedshuffle.experiments.folders)
      summary.json              final metrics per variant (mean ± std over seeds)
      plot.png, plot.pdf        the comparison figure
      <variant>/seed-<s>/
        config.json             resolved run spec, config hash, data-file hashes, seed, versions
        metrics.csv             one row per evaluation (fedshuffle.metrics; byte-identical across executors and resumes)
        timing.csv              measured seconds per evaluation (differ between runs)
        summary.json            status (complete | diverged), final metrics
        final_params.npy        final global model, flat float64
        checkpoint.pt           latest checkpoint (resume with --resume)
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedshuffle.analysis.theory import solution_key
from fedshuffle.experiments.build import build_algorithm_from, build_executor, build_problem_and_data, build_sampler, resolve_step_sizes
from fedshuffle.experiments.schema import RunSpec
from fedshuffle.simulation import Simulation
from fedshuffle.core.checkpoint import read_checkpoint, save_checkpoint as write_checkpoint
from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.core.io import open_regular, write_atomic, write_json
from fedshuffle.core.threads import operator_threads
from fedshuffle.executors.choice import run_threads
from fedshuffle import metrics
from fedshuffle.experiments.results import METRIC_COLUMNS, TIMING_COLUMNS, AppendedTable, write_parquet
from fedshuffle.experiments.sinks import check_tracking_server, flatten, open_sinks
from fedshuffle.experiments.folders import FolderLock, check_run_folder, config_hash, data_hashes, identity, intact, remove_leftovers, sealed, stored_run

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class RunOutcome:
    run_dir: Path
    status: str
    final: dict[str, Any]
    message: str = ""


LOGGER = logging.getLogger("fedshuffle")


def environment() -> dict[str, str]:
    try:
        version = metadata.version("fedshuffle")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"fedshuffle": version, "python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__, "platform": platform.platform()}


def ensure_writable(folder: Path, needed_bytes: int = 0) -> None:
    """Fail before training when ``folder`` cannot be created or written, or its disk lacks ``needed_bytes``
    (the probe file ``.write-test`` is never written through a link or into a FIFO)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ResultsError(f"cannot write to {folder} (it is a file, not a folder)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        os.close(open_regular(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        probe.unlink()
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise ResultsError(f"cannot write to {folder} ({f'{exc.filename}: ' if exc.filename else ''}{exc.strerror or exc})") from None
    if free < needed_bytes:
        raise ResultsError(f"{folder} has {free / 2**20:.1f} MiB free, a run needs about {needed_bytes / 2**20:.1f} MiB for its checkpoints and results")


def _per_client(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def check_against_data(spec: RunSpec, num_clients: int) -> None:
    """Per-client lists must have one value per client; aggregation weights cannot all be 0 (the model would never move)."""
    lists = {
        "local.step_normalization": spec.local.step_normalization, "aggregation.weighting": spec.aggregation.weighting,
        "sampler.probabilities": spec.sampler.own_settings().get("probabilities"), "data.weights": spec.data.weights,
    }
    for field, value in lists.items():
        if _per_client(value) and len(value) != num_clients:
            raise ConfigError(field, f"expected {num_clients} values (one per client), got {len(value)}")
    for field in ("aggregation.weighting", "sampler.probabilities", "data.weights"):
        value = lists[field]
        if _per_client(value) and not any(v > 0 for v in value):
            raise ConfigError(field, "every value is 0: no client would count; give at least one positive value")


#: problems and datasets built inside :func:`sharing_builds`, by the settings that make them (None: outside it)
_BUILT: OrderedDict[str, tuple[Any, Any]] | None = None
_BUILDING = threading.Lock()  # runs in threads (replicas: fedshuffle.replicas) build one shared copy, not one each
#: the most bytes of data kept for later runs (the least recently used go first)
SHARED_DATA_BYTES = 1 << 30


@contextmanager
def sharing_builds() -> Iterator[None]:
    """Within the block, runs with equal ``[problem]`` and ``[data]`` settings and split seed (``data.seed``, else
    ``run.seed``) share one build of the problem and dataset (neither is changed by a run): the preflight's, for
    every variant and seed that has those settings. Up to :data:`SHARED_DATA_BYTES` of data are kept; the block
    is one command (``run``, ``sweep``), so a data file changed between commands is read again."""
    global _BUILT
    outer, _BUILT = _BUILT, (OrderedDict() if _BUILT is None else _BUILT)
    try:
        yield
    finally:
        _BUILT = outer


def _data_bytes(data: Any) -> int:
    tensors = (getattr(data, name, None) for name in ("features", "labels", "test_features", "test_labels"))
    return sum(t.element_size() * t.nelement() for t in tensors if isinstance(t, torch.Tensor))


def _problem_and_data(spec: RunSpec) -> tuple[Any, Any]:
    """:func:`~fedshuffle.experiments.build.build_problem_and_data`, or the build shared under :func:`sharing_builds`."""
    if _BUILT is None:
        return build_problem_and_data(spec)
    data = spec.data.model_dump()
    key = json.dumps({"problem": spec.problem.model_dump(), "data": data, "split_seed": spec.run.seed if data["seed"] is None else data["seed"]},
                     sort_keys=True, default=str)
    with _BUILDING:
        if key in _BUILT:
            _BUILT.move_to_end(key)
            return _BUILT[key]
        built = _BUILT[key] = build_problem_and_data(spec)
        while len(_BUILT) > 1 and sum(_data_bytes(d) for _, d in _BUILT.values()) > SHARED_DATA_BYTES:
            _BUILT.popitem(last=False)
        return built


def build_simulation(spec: RunSpec, seed: int, state_dir: str | None = None) -> tuple[Simulation, dict[str, Any]]:
    """The simulation a spec describes (and the step sizes it resolved), without running anything."""
    spec = spec.model_copy(update={"run": spec.run.model_copy(update={"seed": seed})})
    problem, data = _problem_and_data(spec)
    check_against_data(spec, data.num_clients)
    sampler = build_sampler(spec.sampler, data)
    spec, step_sizes = resolve_step_sizes(spec, problem, data, sampler)
    algorithm = build_algorithm_from(spec)
    sim = Simulation(
        problem, data, algorithm, sampler, seed=seed, dtype=DTYPES[spec.run.dtype], executor=build_executor(spec.run, problem), device=spec.run.device,
        state_memory_limit=spec.run.state_memory_mb << 20, state_dir=state_dir,
    )
    return sim, step_sizes


def preflight(jobs: Sequence[Any], plot_metrics: Sequence[str] = ()) -> None:
    """Build every distinct run of ``jobs`` once and plan its first round, so that bad input stops
    everything before any folder is written (client state goes to a temporary folder). A model metric
    of ``plot_metrics`` that no run would record (f_gap without a known optimum, test accuracy without
    a test set) is refused too, as ``fedshuffle plot`` would refuse the folder."""
    seen = set()
    unrecorded = {m for m in plot_metrics if m in metrics.of_kind("model")}
    with tempfile.TemporaryDirectory(prefix="fedshuffle-preflight-") as scratch:
        for k, job in enumerate(jobs):
            key = json.dumps(job.spec.model_dump(exclude={"run": {"seed"}}), sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                if "mlflow" in job.spec.run.sinks and job.spec.run.mlflow_uri:
                    check_tracking_server(job.spec.run.mlflow_uri)
                sim, _ = build_simulation(job.spec, job.seed, str(Path(scratch) / str(k)))
                sim.round_info()
                if unrecorded:
                    scores = metrics.ModelScores(sim.problem, sim.data)(sim.params)
                    unrecorded -= {m for m in unrecorded if scores.get(m) is not None}
    if unrecorded:
        raise ConfigError("plot.metric", f"no run records {', '.join(sorted(unrecorded))} (f_gap and dist_sq need a problem with a known optimum, "
                          "test_* a test set, accuracies a classification problem); plot another metric, e.g. loss")


def run_identity(spec: RunSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """The spec as stored in ``config.json`` and the hashes of the data files it names."""
    dumped = spec.model_dump()
    return dumped, data_hashes(dumped)


def run_single(
    spec: RunSpec,
    run_dir: Path,
    seed: int,
    *,
    resume: bool = False,
    extend: bool = False,
    on_round: Callable[[int], None] | None = None,
    label: str = "",
    point: Mapping[str, Any] | None = None,
    experiment: str = "fedshuffle",
    adopt: Callable[[Simulation, Callable[[Any], Any]], tuple[Simulation, Callable[[Any], Any]]] | None = None,
) -> RunOutcome:
    """Run one seeded spec into ``run_dir``; with ``resume``, continue from its checkpoint.

    ``label`` (the variant) and ``point`` (a sweep's overrides) are recorded for ``plot``/``table``.
    Resuming refuses a folder whose run has other settings (:func:`~fedshuffle.experiments.folders.check_run_folder`);
    with ``extend``, a run asked for fewer rounds continues to ``spec.run.rounds`` and gives the numbers
    of a run asked for them from the start. A finished run (complete or diverged) is not run again.
    Without ``resume``, a folder already holding a run is refused. One process writes a run folder at a time.
    ``adopt(sim, evaluator)`` gives the simulation the run steps and the evaluator it scores the model with (a
    replica of a batched group: :mod:`fedshuffle.replicas`).
    """
    run_dir = Path(run_dir)
    spec = spec.model_copy(update={"run": spec.run.model_copy(update={"seed": seed})})
    dumped, hashes = run_identity(spec)
    with FolderLock(run_dir):
        if not resume and stored_run(run_dir) is not None:
            raise ConfigError("--out", f"{run_dir} already holds a run; continue it with --resume, or give another folder")
        check_run_folder(run_dir, dumped, hashes, extend=extend)
        done = intact(run_dir) if resume else None  # a finished run whose files changed is finished again from its checkpoint
        if done is not None and (done.get("status") == "diverged" or (done.get("status") == "complete" and done.get("rounds") == spec.run.rounds)):
            if on_round:
                on_round(spec.run.rounds)
            return RunOutcome(run_dir, done["status"], done["final"], str(done.get("message", "")))
        for folder in (run_dir, run_dir / "client_state"):
            remove_leftovers(folder)
        sim, step_sizes = build_simulation(spec, seed, str(run_dir / "client_state"))
        ensure_writable(run_dir, needed_bytes=4 * sim.bytes_per_model * (4 + len(sim.server_state)) + (1 << 20))
        evaluator = metrics.ModelScores(sim.problem, sim.data, solution_key(dumped, hashes))
        if adopt is not None:
            sim, evaluator = adopt(sim, evaluator)
        meta = {"label": label, "point": dict(point or {}), "seed": seed}
        stored = {"spec": dumped, "config_hash": config_hash(identity(dumped, hashes)), "data_hashes": hashes}
        threads, reason = run_threads(sim.problem, spec.run.device)
        LOGGER.info("%s: %d operator thread(s): %s", run_dir, threads, reason)
        meta_threads = {"operator_threads": {"count": threads, "reason": reason}}
        try:
            with operator_threads(threads):
                return _train(spec, run_dir, sim, evaluator, meta, {**stored, **meta_threads}, step_sizes, resume, on_round, experiment)
        except OSError as exc:
            raise ResultsError(f"writing results to {run_dir} failed ({exc.strerror or exc}); everything written before is kept, and the run continues from its last checkpoint when resumed") from None


def _load_checkpoint(path: Path, sim: Simulation, run: Mapping[str, Any], total: int) -> list[dict[str, Any]]:
    """Restore ``sim`` from a checkpoint of ``run`` (config hash, variant, seed); returns the metric rows recorded up to it."""
    recorded, saved = read_checkpoint(path, run)
    try:
        state, rows = saved["simulation"], list(saved["rows"])
        shape, rounds = tuple(state["params"].shape), int(state["counters"]["rounds"])
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ConfigError(str(path), f"damaged checkpoint (no {exc}); the run cannot be continued: start it again in another folder") from None
    if recorded.get("round") != rounds or rounds > total:
        raise ConfigError(str(path), f"damaged checkpoint (recorded for round {recorded.get('round')!r}, holds round {rounds}, the run has {total}); "
                          "the run cannot be continued: start it again in another folder")
    if shape != tuple(sim.params.shape):
        raise ConfigError(str(path), f"the checkpoint's model has shape {shape}, this run's has {tuple(sim.params.shape)}")
    sim.load_state_dict(state)
    return rows


class CheckpointCadence:
    """When a run checkpoints: every ``rounds`` rounds (``run.checkpoint_every``), or, with ``rounds = 0``, at an
    evaluation once ``seconds`` (``run.checkpoint_seconds``) have passed since the last checkpoint, the first
    evaluation after the start included; always at the last round (a run can be extended from there).

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


def _train(spec, run_dir, sim, evaluator, meta, stored, step_sizes, resume, on_round, experiment) -> RunOutcome:
    rows: list[dict[str, Any]] = []
    checkpoint = run_dir / "checkpoint.pt"
    every, ckpt_every, total = spec.run.eval_every, spec.run.checkpoint_every, spec.run.rounds
    owner = {"config_hash": stored["config_hash"], "label": meta["label"], "seed": meta["seed"]}
    if resume and checkpoint.exists():
        rows = _load_checkpoint(checkpoint, sim, owner, total)
        # a run extended past its end drops the evaluation it made only because it ended there
        rows = [row for row in rows if row["round"] % every == 0 or row["round"] == total]
    chosen = getattr(sim.executor, "chosen", None)
    if chosen:
        LOGGER.info("%s: executor %s", run_dir, chosen)
    executor = {"name": sim.executor.name, **({"chosen": chosen} if chosen else {})}
    write_json(run_dir / "config.json", {**stored, **meta, "step_sizes": step_sizes, "executor": executor, "environment": environment()})
    (run_dir / "summary.json").unlink(missing_ok=True)  # from here on the folder holds an unfinished run
    sinks = open_sinks(spec.run.sinks, run_dir, uri=spec.run.mlflow_uri, experiment=experiment, label=meta["label"], point=meta["point"], seed=meta["seed"],
                       params=flatten(spec.model_dump()))
    total_samples = sim.data.num_samples
    tables: list[AppendedTable] = []
    cadence = CheckpointCadence(ckpt_every, spec.run.checkpoint_seconds, total)

    def record() -> dict[str, Any]:
        row = metrics.evaluate(metrics.Evaluation(sim.counters, total_samples, spec.run.bandwidth_mib_s, sim.last_extras, {**evaluator(sim.params), **metrics.local_model_scores(sim)}))
        rows.append(row)
        for table in tables:
            table.append(row)
        for sink in sinks:
            sink.log(row)
        return row

    def save_checkpoint() -> None:
        """The resume point: the simulation and every row so far (the tables past it are rewritten from these rows on resume)."""
        write_checkpoint(checkpoint, {"simulation": sim.state_dict(), "rows": rows}, {**owner, "round": sim.counters.rounds})
        sim.commit_checkpoint()
        write_parquet(run_dir / "metrics.parquet", rows)
        cadence.saved()

    status, message = "complete", ""
    try:
        for name, columns in (("metrics.csv", METRIC_COLUMNS), ("timing.csv", TIMING_COLUMNS)):
            tables.append(AppendedTable(run_dir / name, rows, columns))
        if not rows:
            record()
        if on_round and sim.counters.rounds:
            on_round(sim.counters.rounds)
        while sim.counters.rounds < total:
            sim.step()
            r = sim.counters.rounds
            finite = bool(torch.isfinite(sim.params).all())
            evaluated = not finite or r % every == 0 or r == total
            if evaluated:
                row = record()
                if not finite or not math.isfinite(row["loss"]):
                    status, message = "diverged", f"diverged at round {r}: {'model' if not finite else 'loss'} is not finite"
                    break
            if cadence.due(r, evaluated):
                save_checkpoint()
            if on_round:
                on_round(1)
        for table in tables:  # the finished tables are what summary.json seals: on disk before it
            table.sync()
    finally:
        for table in tables:
            table.close()
        for sink in sinks:
            sink.close()
    write_parquet(run_dir / "metrics.parquet", rows)
    npy = io.BytesIO()
    np.save(npy, sim.params.detach().double().cpu().numpy())
    write_atomic(run_dir / "final_params.npy", npy.getvalue())
    final = {k: v for k, v in rows[-1].items() if k in METRIC_COLUMNS}
    write_json(run_dir / "summary.json", sealed({"status": status, "message": message, "final": final, "rounds": sim.counters.rounds, **meta}, run_dir))
    write_json(run_dir / "timing.json", {k: rows[-1][k] for k in TIMING_COLUMNS})
    return RunOutcome(run_dir, status, final, message)
