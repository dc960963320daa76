"""Running experiments: building seeded runs, and the results folder each one is written into.

A run's rounds, evaluations, divergence stop, checkpoints and final files are those of
:class:`~fedshuffle.experiments.loop.RoundLoop` and its callbacks, whoever does the clients' work:
:func:`run_single` in this process, :mod:`fedshuffle.integrations.flower` on Flower nodes; both go
through :class:`RunFolder`, so both write the same folder.

Layout of a results folder::

    OUT/
      manifest.json             what the folder holds (see fedshuffle.experiments.folders)
      summary.json              final metrics per variant (mean ± std over seeds)
      plot.png, plot.pdf        the comparison figure
      <variant>/seed-<s>/
        config.json             resolved run spec, config hash, data-file hashes, seed, versions, DP accounting
        metrics.csv             one row per evaluation (fedshuffle.metrics; byte-identical across executors and resumes)
        timing.csv              measured seconds per evaluation (differ between runs)
        summary.json            status (complete | diverged), final metrics
        metrics.parquet         the rows of metrics.csv as a Parquet table
        final_params.npy        final global model, flat float64
        timing.json             the last row of timing.csv
        checkpoint.pt           latest checkpoint (resume with --resume)
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedshuffle import metrics
from fedshuffle.problems.solution import solution_key
from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.core.io import open_regular, write_json
from fedshuffle.core.streams import Stream, generator
from fedshuffle.core.threads import operator_threads
from fedshuffle.data.catalog import SOURCES, load_samples
from fedshuffle.executors.choice import run_threads
from fedshuffle.experiments.build import (
    build_algorithm_from,
    build_executor,
    build_problem_and_data,
    build_sampler,
    resolve_step_sizes,
)
from fedshuffle.experiments.folders import (
    experiment_root,
    FolderLock,
    check_run_folder,
    config_hash,
    data_hashes,
    identity,
    intact,
    remove_leftovers,
    stored_run,
)
from fedshuffle.experiments.loop import Callback, Driver, Progress, RoundLoop, folder_callbacks, load_checkpoint
from fedshuffle.experiments.results import METRIC_COLUMNS
from fedshuffle.experiments.schema import RunSpec
from fedshuffle.experiments.sinks import check_sinks, flatten, open_sinks
from fedshuffle.local.plan import LocalPlanner
from fedshuffle.methods.client_models import keep_client_models
from fedshuffle.simulation import Simulation

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
    return {
        "fedshuffle": version,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
    }


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
        raise ResultsError(
            f"cannot write to {folder} ({f'{exc.filename}: ' if exc.filename else ''}{exc.strerror or exc})"
        ) from None
    if free < needed_bytes:
        raise ResultsError(
            f"{folder} has {free / 2**20:.1f} MiB free, a run needs about {needed_bytes / 2**20:.1f} MiB for its "
            "checkpoints and results"
        )


def _per_client(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def check_against_data(spec: RunSpec, num_clients: int) -> None:
    """Per-client lists must have one value per client; aggregation weights cannot all be 0 (the model would never
    move)."""
    lists = {
        "local.step_normalization": spec.local.step_normalization,
        "aggregation.weighting": spec.aggregation.weighting,
        "sampler.probabilities": spec.sampler.own_settings().get("probabilities"),
        "data.weights": spec.data.weights,
    }
    for field, value in lists.items():
        if _per_client(value) and len(value) != num_clients:
            raise ConfigError(field, f"expected {num_clients} values (one per client), got {len(value)}")
    for field in ("aggregation.weighting", "sampler.probabilities", "data.weights"):
        value = lists[field]
        if _per_client(value) and not any(v > 0 for v in value):
            raise ConfigError(field, "every value is 0: no client would count; give at least one positive value")


def check_local_work(spec: RunSpec, planner: LocalPlanner, sizes: np.ndarray) -> None:
    """``local.epoch_batches`` = K splits every client's epoch into K minibatches, so K ≤ the smallest client's size
    (found here, before the first round, not when that client first takes part); ``local.drop_last_steps`` leaves
    some client more than the one step every client keeps: dropping as many steps as the most any client plans
    (τ_max) leaves each client one step whatever the value, which says nothing."""
    batches = spec.local.epoch_batches
    if batches is not None and len(sizes) and batches > int(np.min(sizes)):
        smallest = int(np.argmin(sizes))
        why = (
            f"{batches} minibatches per epoch need at least as many samples; client {smallest} has "
            f"{int(sizes[smallest])} (accepted: 1..{int(np.min(sizes))}, or batch_size instead)"
        )
        raise ConfigError("local.epoch_batches", why)
    drop = spec.local.drop_last_steps
    if drop:
        most = planner.max_planned_steps(np.asarray(sizes))
        if drop >= most:
            why = (
                f"{drop} drops every planned step of every client (the most a client plans is {most}), so each "
                f"would run the one step always kept; accepted: 0..{most - 1}"
            )
            raise ConfigError("local.drop_last_steps", why)


#: problems and datasets built inside :func:`sharing_builds`, and the sources' samples they were split from, by the
#: settings that make them (None: outside it)
_BUILT: OrderedDict[str, Any] | None = None
_BUILDING = threading.RLock()  # runs in threads (replicas: fedshuffle.replicas) build one shared copy, not one each
#: the most bytes of data kept for later runs (the least recently used go first)
SHARED_DATA_BYTES = 1 << 30


@contextmanager
def sharing_builds() -> Iterator[None]:
    """Within the block, runs with equal ``[problem]`` and ``[data]`` settings and split seed (``data.seed``, else
    ``run.seed``) share one build of the problem and dataset (neither is changed by a run): the preflight's, for
    every variant and seed that has those settings; and runs whose data differ in the split only (the partition, its
    settings, the weights) share the samples read from their source. Up to :data:`SHARED_DATA_BYTES` of data are
    kept; the block is one command (``run``, ``sweep``), so a data file changed between commands is read again."""
    global _BUILT
    outer, _BUILT = _BUILT, (OrderedDict() if _BUILT is None else _BUILT)
    try:
        yield
    finally:
        _BUILT = outer


def _data_bytes(data: Any) -> int:
    arrays = (getattr(data, name, None) for name in ("features", "labels", "test_features", "test_labels"))
    return sum(
        a.element_size() * a.nelement() if isinstance(a, torch.Tensor) else a.nbytes
        for a in arrays
        if isinstance(a, (torch.Tensor, np.ndarray))
    )


def _shared(key: str, build: Callable[[], Any], data: Callable[[Any], Any]) -> Any:
    """``build()``, kept under ``key`` within :func:`sharing_builds` (the least recently used dropped past
    :data:`SHARED_DATA_BYTES` of ``data(value)``)."""
    assert _BUILT is not None
    with _BUILDING:
        if key in _BUILT:
            _BUILT.move_to_end(key)
            return _BUILT[key]
        built = _BUILT[key] = build()
        while len(_BUILT) > 1 and sum(_data_bytes(data(v)) for v in _BUILT.values()) > SHARED_DATA_BYTES:
            _BUILT.popitem(last=False)
        return built


def _shared_samples(settings: dict[str, Any], seed: int) -> tuple[Any, np.random.Generator]:
    """:func:`~fedshuffle.data.catalog.load_samples`, shared by runs whose sources read the same samples: the key is
    the source's settings and where it looks for files, and the split seed only where the source draws from it.
    The partition stream is the run's own: as the source left it (a copy for each run) where the source draws from
    it, else new from the run's split seed (runs of other split seeds share such a source's samples)."""
    entry = SOURCES[settings["source"]]
    drawn = bool({"rng", "seed"} & set(inspect.signature(entry.factory).parameters))
    split_seed = seed if settings.get("seed") is None else settings["seed"]
    source = {k: settings.get(k) for k in ("source", "path", *entry.setting_names(), *SOURCES.runtime) if k != "seed"}
    source["split_seed"] = split_seed if drawn else None
    key = "samples " + json.dumps(source, sort_keys=True, default=str)
    samples, rng = _shared(key, lambda: load_samples(settings, seed), lambda v: v[0])
    return samples, copy.deepcopy(rng) if drawn else generator(split_seed, Stream.PARTITION)


def _problem_and_data(spec: RunSpec) -> tuple[Any, Any]:
    """:func:`~fedshuffle.experiments.build.build_problem_and_data`, or the build shared under
    :func:`sharing_builds`."""
    if _BUILT is None:
        return build_problem_and_data(spec)
    data = spec.data.model_dump()
    split_seed = spec.run.seed if data["seed"] is None else data["seed"]
    settings = {"problem": spec.problem.model_dump(), "data": data, "split_seed": split_seed}
    key = "build " + json.dumps(settings, sort_keys=True, default=str)
    return _shared(key, lambda: build_problem_and_data(spec, _shared_samples), lambda v: v[1])


def seeded(spec: RunSpec, seed: int) -> RunSpec:
    """``spec`` at ``seed`` (``run.seed``)."""
    return spec.model_copy(update={"run": spec.run.model_copy(update={"seed": seed})})


def build_simulation(spec: RunSpec, seed: int, state_dir: str | None = None) -> tuple[Simulation, dict[str, Any]]:
    """The simulation a spec describes (and the step sizes it resolved), without running anything."""
    spec = seeded(spec, seed)
    problem, data = _problem_and_data(spec)
    check_against_data(spec, data.num_clients)
    sampler = build_sampler(spec.sampler, data)
    spec, step_sizes = resolve_step_sizes(spec, problem, data, sampler)
    algorithm = build_algorithm_from(spec)
    check_local_work(spec, algorithm.local, data.sizes)
    if spec.run.score_client_models:
        algorithm = replace(algorithm, method=keep_client_models(algorithm.method))
    sim = Simulation(
        problem,
        data,
        algorithm,
        sampler,
        seed=seed,
        dtype=DTYPES[spec.run.dtype],
        executor=build_executor(spec.run, problem),
        device=spec.run.device,
        state_memory_limit=spec.run.state_memory_mb << 20,
        state_dir=state_dir,
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
                check_sinks(job.spec.run.sinks, job.spec.run.own_settings())
                sim, _ = build_simulation(job.spec, job.seed, str(Path(scratch) / str(k)))
                sim.round_info()
                if unrecorded:
                    scores = metrics.ModelScores(sim.problem, sim.data)(sim.params)
                    unrecorded -= {m for m in unrecorded if scores.get(m) is not None}
    if unrecorded:
        raise ConfigError(
            "plot.metric",
            f"no run records {', '.join(sorted(unrecorded))} (f_gap and dist_sq need a problem with a known optimum, "
            "test_* a test set, accuracies a classification problem); plot another metric, e.g. loss",
        )


def run_identity(spec: RunSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """The spec as stored in ``config.json`` and the hashes of the data files it names."""
    dumped = spec.model_dump()
    return dumped, data_hashes(dumped)


class RunFolder:
    """The results folder of one run (``spec`` at its seed; ``label``: the variant, ``point``: a sweep's overrides):
    the run it belongs to, the checks before writing it, and the writing itself, through one
    :class:`~fedshuffle.experiments.loop.RoundLoop`.

    ``out_option`` and ``resume_option`` name the settings that chose the folder and continue a run, for the
    messages (``--out``, ``--resume``; a Flower app's run config).
    """

    def __init__(
        self,
        run_dir: Path,
        spec: RunSpec,
        *,
        label: str = "",
        point: Mapping[str, Any] | None = None,
        out_option: str = "--out",
        resume_option: str = "--resume",
    ) -> None:
        self.run_dir, self.spec, self.out_option, self.resume_option = Path(run_dir), spec, out_option, resume_option
        self.dumped, self.hashes = run_identity(spec)
        self.config_hash = config_hash(identity(self.dumped, self.hashes))
        self.meta = {"label": label, "point": dict(point or {}), "seed": spec.run.seed}
        self.owner = {
            "config_hash": self.config_hash,
            "label": label,
            "seed": spec.run.seed,
        }  # what a checkpoint must be recorded for

    @property
    def solution_key(self) -> str:
        """Where the problem's optimum is cached (:func:`~fedshuffle.problems.solution.solution_key`)."""
        return solution_key(self.dumped, self.hashes)

    def check(self, *, resume: bool, extend: bool) -> dict[str, Any] | None:
        """Refuse a folder holding a run (unless ``resume``) or another run
        (:func:`~fedshuffle.experiments.folders.check_run_folder`);
        returns the summary of a finished run (complete at ``run.rounds``, or diverged) that is intact, else None."""
        if not resume and stored_run(self.run_dir) is not None:
            raise ConfigError(
                self.out_option,
                f"{self.run_dir} already holds a run; continue it with {self.resume_option}, or give another folder",
            )
        check_run_folder(self.run_dir, self.dumped, self.hashes, extend=extend)
        done = (
            intact(self.run_dir) if resume else None
        )  # a finished run whose files changed is finished again from its checkpoint
        if done is not None and (
            done.get("status") == "diverged"
            or (done.get("status") == "complete" and done.get("rounds") == self.spec.run.rounds)
        ):
            return done
        return None

    def run(
        self,
        build: Callable[[], Driver],
        *,
        resume: bool = False,
        extend: bool = False,
        on_round: Callable[[int], None] | None = None,
        experiment: str = "fedshuffle",
        callbacks: Sequence[Callback] = (),
        until: int | None = None,
    ) -> RunOutcome:
        """Check the folder (holding its lock), ``build`` the run's :class:`Driver` and run it into the folder.

        With ``resume``, the run continues from its checkpoint, and a finished run is not run again; with
        ``extend``, a run asked for fewer rounds continues to ``run.rounds``. ``callbacks`` are told what the loop
        does after the folder's own; ``until`` pauses the run after that round (a checkpoint, no summary).
        """
        run_dir = self.run_dir
        with FolderLock(run_dir):
            done = self.check(resume=resume, extend=extend)
            if done is not None:
                if on_round:
                    on_round(self.spec.run.rounds)
                return RunOutcome(run_dir, done["status"], done["final"], str(done.get("message", "")))
            for folder in (run_dir, run_dir / "client_state"):
                remove_leftovers(folder)
            driver = build()
            sim = driver.sim
            ensure_writable(run_dir, needed_bytes=4 * sim.bytes_per_model * (4 + len(sim.server_state)) + (1 << 20))
            threads, reason = run_threads(sim.problem, self.spec.run.device)
            LOGGER.info("%s: %d operator thread(s): %s", run_dir, threads, reason)
            recorded = {"operator_threads": {"count": threads, "reason": reason}}
            callbacks = [*callbacks, Progress(on_round)] if on_round else list(callbacks)
            try:
                with operator_threads(threads):
                    return _train(self, driver, recorded, resume, experiment, callbacks, until)
            except OSError as exc:
                raise ResultsError(
                    f"writing results to {run_dir} failed ({exc.strerror or exc}); everything written before is kept, "
                    "and the run continues from its last checkpoint when resumed"
                ) from None


def _train(
    folder: RunFolder,
    driver: Driver,
    recorded: Mapping[str, Any],
    resume: bool,
    experiment: str,
    callbacks: Sequence[Callback],
    until: int | None,
) -> RunOutcome:
    """The run's rounds into its folder: ``config.json``, then the loop with the folder's callbacks."""
    spec, run_dir, sim = folder.spec, folder.run_dir, driver.sim
    rows: list[dict[str, Any]] = []
    checkpoint = run_dir / "checkpoint.pt"
    if resume and checkpoint.exists():
        rows = load_checkpoint(checkpoint, sim, folder.owner, spec.run.rounds)
        # a run extended past its end drops the evaluation it made only because it ended there
        rows = [row for row in rows if row["round"] % spec.run.eval_every == 0 or row["round"] == spec.run.rounds]
    stored = {"spec": folder.dumped, "config_hash": folder.config_hash, "data_hashes": folder.hashes, **recorded}
    privacy = (
        {"privacy": sim.privacy.describe()} if getattr(sim, "privacy", None) is not None else {}
    )  # how ε(δ) is accounted
    write_json(
        run_dir / "config.json",
        {
            **stored,
            **folder.meta,
            "step_sizes": driver.step_sizes,
            "executor": driver.executor,
            **privacy,
            "environment": environment(),
        },
    )
    (run_dir / "summary.json").unlink(missing_ok=True)  # from here on the folder holds an unfinished run
    meta = folder.meta
    sinks = open_sinks(
        spec.run.sinks,
        run_dir,
        experiment_root(run_dir),
        settings=spec.run.own_settings(),
        experiment=experiment,
        label=meta["label"],
        point=meta["point"],
        seed=meta["seed"],
        params=flatten(spec.model_dump()),
    )
    loop = RoundLoop(
        driver,
        rounds=spec.run.rounds,
        eval_every=spec.run.eval_every,
        bandwidth_mib_s=spec.run.bandwidth_mib_s,
        rows=rows,
    )
    status, message = loop.run([*folder_callbacks(run_dir, spec.run, folder.owner, meta, sinks), *callbacks], until)
    final = {k: v for k, v in loop.rows[-1].items() if k in METRIC_COLUMNS}
    return RunOutcome(run_dir, status, final, message)


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
    """Run one seeded spec into ``run_dir`` in this process (:class:`RunFolder`); with ``resume``, continue from its
    checkpoint.

    ``label`` (the variant) and ``point`` (a sweep's overrides) are recorded for ``plot``/``table``.
    Resuming refuses a folder whose run has other settings (:func:`~fedshuffle.experiments.folders.check_run_folder`);
    with ``extend``, a run asked for fewer rounds continues to ``spec.run.rounds`` and gives the numbers
    of a run asked for them from the start. A finished run (complete or diverged) is not run again.
    Without ``resume``, a folder already holding a run is refused. One process writes a run folder at a time.
    ``adopt(sim, evaluator)`` gives the simulation the run steps and the evaluator it scores the model with (a
    replica of a batched group: :mod:`fedshuffle.replicas`).
    """
    folder = RunFolder(run_dir, seeded(spec, seed), label=label, point=point)

    def build() -> Driver:
        sim, step_sizes = build_simulation(folder.spec, seed, str(folder.run_dir / "client_state"))
        evaluator = metrics.ModelScores(sim.problem, sim.data, folder.solution_key, gradient=spec.run.grad_norm)
        if adopt is not None:
            sim, evaluator = adopt(sim, evaluator)
        chosen = getattr(sim.executor, "chosen", None)
        if chosen:
            LOGGER.info("%s: executor %s", folder.run_dir, chosen)
        executor = {"name": sim.executor.name, **({"chosen": chosen} if chosen else {})}
        return Driver(
            sim, sim.step, lambda: {**evaluator(sim.params), **metrics.local_model_scores(sim)}, executor, step_sizes
        )

    return folder.run(build, resume=resume, extend=extend, on_round=on_round, experiment=experiment)
