"""Jobs, grids and parallel execution: what ``fedshuffle run`` and ``fedshuffle sweep`` share.

A job is one (grid point, variant, seed) of an experiment, with its own results folder::

    OUT/[<point>/]<variant>/seed-<s>/

Jobs run in this process or in worker processes (each with its own PyTorch state, :func:`worker_context`); every
job resumes from its checkpoint and a finished one is skipped, so a sweep started again continues
where it stopped. Choosing the best grid point per variant by a metric is
:func:`select_best` (FedShuffle paper, Appendix F: grid search over lr × weight decay × clipping).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import queue as queue_mod
import re
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedshuffle import plugins
from fedshuffle.core.errors import ClusterError, ConfigError, ResultsError
from fedshuffle.core.signals import held_signals
from fedshuffle.data.catalog import PARTITIONS, SOURCES
from fedshuffle.executors import EXECUTORS
from fedshuffle.experiments.folders import folder_name, unique_folders
from fedshuffle.experiments.runner import run_single, sharing_builds
from fedshuffle.experiments.schema import SECTIONS, Experiment, RunSpec, parse_overrides
from fedshuffle.experiments.sinks import SINKS
from fedshuffle.methods import METHODS
from fedshuffle.problems import PROBLEMS
from fedshuffle.samplers import SAMPLERS
from fedshuffle.server import SERVER_OPTIMIZERS
from fedshuffle.replicas import describe_groups, replica_groups, run_together, spread, unbatched_note


@dataclass(frozen=True)
class Job:
    label: str
    point: dict[str, Any]
    spec: RunSpec
    seed: int
    run_dir: Path


@dataclass
class Outcome:
    job: Job
    status: str
    final: dict[str, Any] = field(default_factory=dict)
    message: str = ""


# -- grids and seeds ----------------------------------------------------------------------------------


MAX_VALUES = 10_000


def parse_integers(text: str, option: str, minimum: int = 0, ranges: bool = True, limit: int = MAX_VALUES) -> list[int]:
    """``"0..4"`` → 0,1,2,3,4 (when ``ranges``); ``"1,3,5"``; ``"7"`` — every value ≥ ``minimum``, at most ``limit``
    values."""
    accepted = f"{'a range a..b or ' if ranges else ''}comma-separated integers >= {minimum}"
    try:
        if ranges and ".." in text:
            low, high = (int(v) for v in text.split("..", 1))
            count = high - low + 1
            values = list(range(low, high + 1)) if count <= limit else []
        else:
            values = [int(v) for v in text.split(",") if v.strip()]
            count = len(values)
    except ValueError:
        raise ConfigError(option, f"expected {accepted}, got {text[:60]!r}") from None
    if count > limit:
        raise ConfigError(option, f"{text[:60]!r} is {count} values; at most {limit}")
    if not values or min(values) < minimum:
        raise ConfigError(option, f"expected {accepted}, got {text[:60]!r}")
    return values


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: a range or a list of distinct seeds ≥ 0."""
    seeds = parse_integers(text, "--seeds")
    check_seeds(seeds, "--seeds")
    return seeds


def check_workers(workers: Any) -> None:
    """``--workers``: a whole number from 1 to :data:`MAX_VALUES` (a larger one cannot even be handed to the OS)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_VALUES:
        raise ConfigError("--workers", f"must be a whole number from 1 to {MAX_VALUES}, got {workers!r}")


def check_seeds(seeds: Sequence[Any], field: str) -> None:
    """Seeds are distinct integers ≥ 0: a seed listed twice would be one run counted twice."""
    seen = set()
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ConfigError(field, f"seeds are integers >= 0, got {s!r}")
        if s in seen:
            raise ConfigError(field, f"seed {s} is listed twice; each seed is one run")
        seen.add(s)


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: ``0.1,[2,5],"x,y"`` → three values."""
    parts, depth, quote, current = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


#: the most grid points one sweep command takes (a larger grid is split over commands sharing one ``--out``)
MAX_POINTS = 10_000


def parse_grid(items: Sequence[str]) -> list[dict[str, Any]]:
    """``["local.lr=0.1,0.01", "local.clip_norm=1,10"]`` → every combination as override dicts; more than
    :data:`MAX_POINTS` combinations are refused before any is made."""
    axes: list[tuple[str, list[Any]]] = []
    for item in items:
        if "=" not in item:
            raise ConfigError("--grid", f"expected section.setting=v1,v2,..., got {item!r}")
        key, values = item.split("=", 1)
        try:
            parsed = [parse_overrides([f"{key}={v}"]) for v in _split_values(values)]
        except ConfigError as exc:
            raise ConfigError("--grid", exc.message) from None
        if not parsed:
            raise ConfigError("--grid", f"{key}: no values given")
        if key.strip() in (k for k, _ in axes):
            raise ConfigError("--grid", f"{key} is given twice")
        axes.append((key.strip(), parsed))
    count = math.prod(len(values) for _, values in axes)
    if count > MAX_POINTS:
        sizes = " × ".join(str(len(values)) for _, values in axes)
        raise ConfigError(
            "--grid",
            f"{sizes} = {count} points; a sweep takes at most {MAX_POINTS}: split the grid "
            "over several sweep commands with the same --out (a sweep started again keeps "
            "its finished runs and takes other points)",
        )
    points = []
    for combo in itertools.product(*(values for _, values in axes)):
        merged: dict[str, dict[str, Any]] = {}
        for override in combo:
            for section, settings in override.items():
                merged.setdefault(section, {}).update(settings)
        points.append(merged)
    return points or [{}]


def point_text(point: Mapping[str, Mapping[str, Any]]) -> str:
    return "_".join(f"{section}.{key}={value}" for section in SECTIONS for key, value in point.get(section, {}).items())


def _folder_text(point: Mapping[str, Mapping[str, Any]]) -> str:
    """:func:`point_text` with exponents written without their ``+`` (``1e+30`` → ``1e30``): a folder name turns
    ``+`` into ``-``, which would give 1e+30 the folder of 1e-30."""
    return re.sub(r"(?<=\d)e\+(?=\d)", "e", point_text(point))


def point_name(point: Mapping[str, Mapping[str, Any]]) -> str:
    """A folder name for a grid point: ``local.lr-0.1_local.clip_norm-10`` (see
    :func:`~fedshuffle.experiments.folders.folder_name`)."""
    return folder_name(_folder_text(point)) if point else ""


def variant_folders(experiment: Experiment) -> dict[str, str]:
    """label → the folder name of each variant; an empty label, a label given twice and two labels that would
    share a folder are refused (:func:`~fedshuffle.experiments.folders.unique_folders`)."""
    labels = [v.label for v in experiment.variants]
    if any(not label.strip() for label in labels):
        raise ConfigError("variants", "every variant needs a label (a non-empty name)")
    return unique_folders(labels, "variant label", "variants")


def jobs_for(
    experiment: Experiment,
    out_dir: Path,
    points: Sequence[Mapping[str, Any]],
    seeds: Sequence[int] | None = None,
    overrides: Mapping[str, Any] | None = None,
    variants: Sequence[str] | None = None,
) -> list[Job]:
    """Every point × variant (or only the named ``variants``) × seed, validated before anything runs.

    Folder names come from labels and points (:func:`~fedshuffle.experiments.folders.unique_folders`):
    labels or points that would share a folder, and seeds listed twice, are refused.
    """
    labels = [v.label for v in experiment.variants]
    folders = variant_folders(experiment)
    unknown = [v for v in variants or [] if v not in labels]
    if unknown:
        raise ConfigError("--variant", f"no variant {unknown[0]!r}; the variants are: {', '.join(labels) or '(none)'}")
    if variants:
        experiment = experiment.model_copy(update={"variants": [v for v in experiment.variants if v.label in variants]})
    names = unique_folders([_folder_text(p) for p in points if p], "grid point", "--grid")
    if seeds is not None:
        check_seeds(seeds, "--seeds")
    jobs = []
    for point in points:
        merged = merge_overrides(overrides or {}, point)
        folder = out_dir / names[_folder_text(point)] if point else out_dir
        try:
            runs = experiment.runs(merged)
        except ConfigError as exc:
            raise _blamed_on_grid(exc, point) from None
        for label, spec in runs:
            run_seeds = seeds if seeds is not None else experiment.seeds(spec)
            if seeds is None:
                check_seeds(run_seeds, "experiment.seeds")
            for seed in run_seeds:
                jobs.append(
                    Job(label, dict(point), spec, seed, folder / (folders[label] if label else "") / f"seed-{seed}")
                )
    return jobs


def _blamed_on_grid(exc: ConfigError, point: Mapping[str, Mapping[str, Any]]) -> ConfigError:
    """An error that :meth:`~fedshuffle.experiments.schema.Experiment.runs` lays on an override, laid on ``--grid``
    when the setting is one the grid point gives."""
    setting = exc.field.removeprefix("--set ")
    section, _, key = setting.partition(".")
    if exc.field.startswith("--set ") and key.split(".")[0] in point.get(section, {}):
        return ConfigError(f"--grid {setting}", exc.message.split("; to run each of several values")[0])
    return exc


def merge_overrides(
    base: Mapping[str, Mapping[str, Any]], update: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``base`` with the settings of ``update`` over it, section by section (later ones win)."""
    out = {section: dict(settings) for section, settings in base.items()}
    for section, settings in update.items():
        out.setdefault(section, {}).update(settings)
    return out


# -- running --------------------------------------------------------------------------------------------

UNWRITABLE = "unwritable"  # an outcome whose folder could not be written: the command stops with exit status 4


def _execute(
    job: Job,
    resume: bool,
    extend: bool,
    experiment: str,
    on_round: Callable[[int], None] | None,
    adopt: Callable[..., Any] | None = None,
) -> Outcome:
    try:
        result = run_single(
            job.spec,
            job.run_dir,
            job.seed,
            resume=resume,
            extend=extend,
            on_round=on_round,
            label=job.label,
            point=job.point,
            experiment=experiment,
            adopt=adopt,
        )
    except ResultsError as exc:
        return Outcome(job, UNWRITABLE, {}, str(exc))
    except (ConfigError, OSError) as exc:
        return Outcome(job, "failed", {}, str(exc))
    return Outcome(job, result.status, result.final, result.message)


def _execute_group(
    jobs: Sequence[Job], resume: bool, extend: bool, experiment: str, on_rounds: Sequence[Callable[[int], None] | None]
) -> list[Outcome]:
    """Run ``jobs``, one job as it is, several as the replicas of one simulation (:mod:`fedshuffle.replicas`)."""

    if len(jobs) == 1:
        return [_execute(jobs[0], resume, extend, experiment, on_rounds[0])]
    with sharing_builds():
        outcomes, _ = run_together(
            list(zip(jobs, on_rounds)),
            lambda pair, adopt: _execute(pair[0], resume, extend, experiment, pair[1], adopt),
        )
    return outcomes


#: the module a worker loads before its first job: imported once by the fork server the workers are forked from
PRELOAD = "fedshuffle.experiments.preload"
#: imported by the fork server before :data:`PRELOAD`: it ignores Ctrl-C from its start
IGNORE_CTRL_C = "fedshuffle.core.forkserver"


def worker_context() -> Any:
    """How worker processes start: forked from a fork server that has loaded :mod:`fedshuffle.experiments.preload`
    (PyTorch, the parts, the compiled streams) once, on Linux; spawned elsewhere. Either way a
    worker has its own PyTorch state (the fork server runs no PyTorch operator), and :func:`_start_worker` gives it
    this process' environment (the fork server keeps that of its own start); its working folder and ``sys.path`` are
    this process' as for a spawned one. The fork server stays for later pools of this process, and ends with it."""
    if (
        not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods()
    ):  # macOS: frameworks are not fork-safe
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([IGNORE_CTRL_C, PRELOAD])
    return context


def pool_workers(jobs: Sequence[Job], workers: int) -> int:
    """How many worker processes :func:`run_jobs` starts for ``jobs`` (0: it runs them in this process)."""
    workers = min(workers, len(spread(replica_groups([job.spec for job in jobs]), workers)))
    return workers if workers > 1 else 0


def start_workers_early(jobs: Sequence[Job], workers: int) -> None:
    """Start the fork server now where ``jobs`` will run in worker processes, so that it loads what they need while
    this process checks and builds the runs (the preflight): the workers fork from it warm once the runs start."""
    if pool_workers(jobs, workers):
        _start_fork_server(worker_context())


#: the longest folder whose ``pymp-XXXXXXXX/listener-XXXXXXXX`` socket paths fit in an AF_UNIX address (107 bytes)
MAX_SOCKET_DIR = 70
#: short folders tried, in order, when the temporary folder is too long for the workers' sockets
SHORT_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def _socket_folder() -> None:
    """Give multiprocessing a temporary folder short enough for its Unix sockets (the fork server's and the
    manager's). A ``TMPDIR`` of a cluster's per-job folder is often longer than an AF_UNIX address
    allows; then the first of :data:`SHORT_TEMP_DIRS` that is writable is used instead (removed at exit, as
    multiprocessing removes its own), or the command stops with one line."""
    import shutil
    import tempfile
    from multiprocessing import util

    config = mp.current_process()._config  # where multiprocessing keeps its temporary folder (util.get_temp_dir)
    if config.get("tempdir") is not None or len(os.fsencode(tempfile.gettempdir())) <= MAX_SOCKET_DIR:
        return
    for base in SHORT_TEMP_DIRS:
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            folder = tempfile.mkdtemp(prefix="pymp-", dir=base)
            util.Finalize(None, shutil.rmtree, args=[folder], exitpriority=-100)
            config["tempdir"] = folder
            return
    raise ConfigError(
        "--workers",
        f"the temporary folder {tempfile.gettempdir()} is too long for the workers' "
        f"sockets (at most {MAX_SOCKET_DIR} bytes) and none of {', '.join(SHORT_TEMP_DIRS)} "
        "is writable: set TMPDIR to a shorter folder, or run with --workers 1",
    )


def _start_fork_server(context: Any) -> None:
    """Start the fork server of ``context`` (if it uses one) in a temporary folder its sockets fit in, with Ctrl-C
    blocked in it from its first instruction: a terminal's Ctrl-C reaches the whole process group, and one landing
    while the server's interpreter starts printed Python's fatal start-up error (this command stops the server).

    multiprocessing's resource tracker is started first: starting it unblocks Ctrl-C on its way out (its own child
    is protected the same way), which let the fork server start unprotected (3 of 16 Ctrl-Cs as it started). In
    this process Ctrl-C and SIGTERM are held back until the server is recorded, so that :func:`stop_fork_server`
    always finds it."""
    _socket_folder()
    if context.get_start_method() == "forkserver":
        with held_signals():
            multiprocessing.resource_tracker.ensure_running()
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the child inherits the mask
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextlib.contextmanager
def _fork_server_stopped_on_interrupt() -> Iterator[None]:
    """Ctrl-C or SIGTERM inside: the fork server is stopped once the workers have ended."""
    try:
        yield
    except KeyboardInterrupt:
        stop_fork_server()
        raise


def stop_fork_server() -> None:
    """End the fork server (if this process started one) now, also while it still loads, and what it forked that
    is still alive (a worker forked as the interrupt landed, before its pool recorded it, or the manager process of
    the rounds' queue as it started; an interrupted pool's own workers have ended already): after Ctrl-C or SIGTERM
    nothing of the command may outlive it. Later pools start a new one.

    multiprocessing's resource tracker is left to end with this process (it ends when the last process holding its
    pipe has): this process's semaphores are unregistered by their own finalizers first. Stopped earlier, it
    unlinked the semaphores of queues still alive (a pool interrupted while it was built or still referenced), and
    their finalizers printed a FileNotFoundError traceback as the command exited (2 of 400 signal fuzz cases)."""
    server = multiprocessing.forkserver._forkserver  # the process-wide fork server multiprocessing keeps
    if server._forkserver_pid is None:
        return
    for pid in [*_children(server._forkserver_pid), server._forkserver_pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        server._stop()


def _children(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (Linux, where the fork server is used: read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:  # ended meanwhile
            continue
        if stat and int(stat[stat.rindex(")") + 2 :].split()[1]) == parent:  # state, ppid, ...
            found.append(int(entry.name))
    return found


#: why this worker process could not start (a plugin failed to import in it), raised by its tasks
_START_FAILED: ConfigError | None = None


def _start_worker(plugin_modules: Sequence[tuple[str, str]], environment: Mapping[str, str]) -> None:
    """A worker takes the parent's environment (a forked one has the fork server's), imports the plugins the
    parent imported (their parts are registered by import), and leaves Ctrl-C to the parent, which stops it (no
    traceback from every worker)."""
    global _START_FAILED
    os.environ.clear()
    os.environ.update(environment)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        plugins.load_imported(plugin_modules)
    except ConfigError as exc:  # said by the worker's first task (an initializer's error would kill the pool)
        _START_FAILED = exc


@contextlib.contextmanager
def _script_not_rerun() -> Iterator[None]:
    """Worker processes start without running the user's script again.

    A spawned or fork-server child imports the parent's ``__main__`` (by its module spec or file) before it runs a
    task, so a script without an ``if __name__ == "__main__":`` guard would run its experiment again in
    every worker. Nothing a worker runs comes from ``__main__`` (jobs name their parts; plugins are
    importable modules, :func:`fedshuffle.plugins.check_reachable`), so the children are started while
    ``__main__`` shows neither.
    """
    main = sys.modules.get("__main__")
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if main is not None and key in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _parts(spec: RunSpec) -> list[tuple[str, str, object]]:
    """(setting, name, factory) of every registered part a run builds."""
    chosen = [
        ("method.name", METHODS, spec.method.name),
        ("problem.name", PROBLEMS, spec.problem.name),
        ("data.source", SOURCES, spec.data.source),
        ("data.partition", PARTITIONS, spec.data.partition),
        ("sampler.name", SAMPLERS, spec.sampler.name),
        ("server.optimizer", SERVER_OPTIMIZERS, spec.server.optimizer),
        ("run.executor", EXECUTORS, spec.run.executor),
        *(("run.sinks", SINKS, name) for name in spec.run.sinks),
    ]
    return [(field, name, registry[name].factory) for field, registry, name in chosen]


def _worker(
    jobs: Sequence[Job],
    resume: bool,
    extend: bool,
    experiment: str,
    progress: Any,
    indices: Sequence[int],
    threads: int,
) -> list[Outcome]:
    import torch

    if _START_FAILED is not None:
        raise _START_FAILED
    torch.set_num_threads(threads)
    pending = dict.fromkeys(indices, 0)

    def ticker(index: int) -> Callable[[int], None]:
        def tick(k: int) -> None:
            pending[index] += k
            if pending[index] >= 10:
                progress.put((index, pending[index]))
                pending[index] = 0

        return tick

    outcomes = _execute_group(jobs, resume, extend, experiment, [ticker(index) for index in indices])
    for index, left in pending.items():
        if left:
            progress.put((index, left))
    return outcomes


class _Outcomes:
    """The sweep's outcomes as they come, from this process or from worker processes alike: each kept in its job's
    place with the progress bar brought to its rounds, a run that did not complete reported in one line, and the
    first outcome whose folder could not be written kept (it stops the sweep, :meth:`raise_unwritable`)."""

    def __init__(self, jobs: Sequence[Job], progress: Any, task: Any, console: Any) -> None:
        self.jobs, self.progress, self.task, self.console = jobs, progress, task, console
        self.outcomes: list[Outcome | None] = [None] * len(jobs)
        self.done_rounds = [0] * len(jobs)
        self.unwritable: Outcome | None = None

    def advance(self, index: int, rounds: int) -> None:
        """``rounds`` more rounds of job ``index`` done."""
        self.done_rounds[index] += rounds
        self.progress.advance(self.task, rounds)

    def finished(self, index: int, outcome: Outcome) -> bool:
        """Record job ``index``'s outcome; True when it is the first one whose folder could not be written."""
        rounds = self.jobs[index].spec.run.rounds
        self.advance(index, rounds - self.done_rounds[index])
        self.outcomes[index] = outcome
        job = outcome.job
        if outcome.status not in ("complete", UNWRITABLE):
            self.console.print(
                f"[yellow]{job.label or 'run'} seed {job.seed}{' ' + point_name(job.point) if job.point else ''}: "
                f"{outcome.status}: {outcome.message}",
                highlight=False,
                soft_wrap=True,
            )
        first = outcome.status == UNWRITABLE and self.unwritable is None
        if first:
            self.unwritable = outcome
        return first

    def drain(self, ticks: Any) -> None:
        """The rounds the workers reported done so far."""
        while True:
            try:
                index, k = ticks.get_nowait()
            except queue_mod.Empty:
                return
            self.advance(index, k)

    def raise_unwritable(self) -> None:
        if self.unwritable is not None:
            raise ResultsError(self.unwritable.message)

    def results(self) -> list[Outcome]:
        return [o for o in self.outcomes if o is not None]


def run_jobs(
    jobs: Sequence[Job],
    *,
    workers: int = 1,
    resume: bool = True,
    extend: bool = False,
    experiment: str = "fedshuffle",
    show_progress: bool = True,
    title: str = "",
) -> list[Outcome]:
    """Run ``jobs`` (in order of the list in the result), ``workers`` at a time, with one progress bar.

    Jobs that differ only in step sizes or seed run as the replicas of one simulation in one worker
    (:mod:`fedshuffle.replicas`: the same files as each run alone), and the command says so.

    A job whose folder cannot be written stops the others (running ones finish) and raises
    :class:`ResultsError`; Ctrl-C stops the workers and raises :class:`KeyboardInterrupt`. Either
    way everything written is kept and the jobs resume from their checkpoints.
    """
    from rich.console import Console

    check_workers(workers)
    grouped = replica_groups([job.spec for job in jobs])
    groups = spread(grouped, workers)  # runs that differ only in step sizes or seed: one simulation per worker
    lines = [describe_groups(groups), unbatched_note([job.spec for job in jobs], grouped)]
    workers = pool_workers(jobs, workers)
    console = Console(stderr=True)
    with _progress_bar(console, show_progress) as progress:
        task = progress.add_task(title or experiment, total=sum(job.spec.run.rounds for job in jobs))
        board = _Outcomes(jobs, progress, task, console)
        for line in lines:
            if line:
                console.print(line, highlight=False, soft_wrap=True)
        if workers:
            _run_in_pool(board, groups, workers, resume, extend, experiment)
        else:
            _run_in_process(board, groups, resume, extend, experiment, title or experiment)
    board.raise_unwritable()
    return board.results()


def _progress_bar(console: Any, show: bool) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not show,
        transient=False,
    )


def _run_in_process(
    board: _Outcomes, groups: Sequence[Sequence[int]], resume: bool, extend: bool, experiment: str, title: str
) -> None:
    """Each group in turn in this process; a folder that cannot be written stops before the next group."""
    jobs = board.jobs
    for group in groups:
        job = jobs[group[0]]
        replicas = f", {len(group)} replicas" if len(group) > 1 else ""
        board.progress.update(board.task, description=f"{title}: {job.label or 'run'} (seed {job.seed}{replicas})")
        ticks = [lambda n, k=k: board.advance(k, n) for k in group]
        for k, outcome in zip(group, _execute_group([jobs[k] for k in group], resume, extend, experiment, ticks)):
            board.finished(k, outcome)
        if board.unwritable is not None:
            return


def _run_in_pool(
    board: _Outcomes, groups: Sequence[Sequence[int]], workers: int, resume: bool, extend: bool, experiment: str
) -> None:
    """The groups on ``workers`` worker processes; a folder that cannot be written cancels the groups not started."""
    jobs = board.jobs
    threads = max(1, (os.cpu_count() or 1) // workers)
    for job in jobs:
        plugins.check_reachable(_parts(job.spec))
    context = worker_context()
    _start_fork_server(context)
    with _fork_server_stopped_on_interrupt(), _script_not_rerun(), context.Manager() as manager:
        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=context,
            initializer=_start_worker,
            initargs=(plugins.imported(), dict(os.environ)),
        )
        try:
            ticks = manager.Queue()
            futures: dict[Future, Sequence[int]] = {
                pool.submit(_worker, [jobs[k] for k in group], resume, extend, experiment, ticks, group, threads): group
                for group in groups
            }
            _collect(board, futures, ticks)
        except BrokenProcessPool as exc:
            _stop(pool)
            why = f"a worker process ended abruptly ({exc}); what it wrote stays resumable"
            raise ClusterError(why) from None
        except BaseException:
            _stop(pool)
            raise
        pool.shutdown(wait=True)


def _collect(board: _Outcomes, futures: Mapping[Future, Sequence[int]], ticks: Any) -> None:
    """The workers' outcomes and rounds as they come, until every group has answered or was cancelled."""
    pending = set(futures)
    while pending:
        finished_now, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
        board.drain(ticks)
        for future in finished_now:
            if future.cancelled():
                continue
            for k, outcome in zip(futures[future], future.result()):
                if board.finished(k, outcome):
                    for other in pending:
                        other.cancel()  # those not started yet; running ones finish


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop a pool at once: cancel what has not started and end the workers (their runs resume from checkpoints)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


# -- choosing -------------------------------------------------------------------------------------------


def higher_is_better(metric: str) -> bool:
    return "accuracy" in metric


def select_best(outcomes: Iterable[Outcome], metric: str) -> dict[str, dict[str, Any]]:
    """Per variant: the grid point with the best mean final ``metric`` over seeds.

    Lower is better, except for accuracies. A point with a diverged or failed seed is never chosen.
    ``at_edge`` lists the settings whose chosen value is the smallest or largest of at least three
    values tried: the best may lie outside the grid, so widen it there.
    """
    groups: dict[str, dict[str, list[Outcome]]] = {}
    for o in outcomes:
        groups.setdefault(o.job.label, {}).setdefault(point_name(o.job.point), []).append(o)
    sign = -1.0 if higher_is_better(metric) else 1.0
    best: dict[str, dict[str, Any]] = {}
    for label, points in groups.items():
        scores = {}
        for name, runs in points.items():
            values = [o.final.get(metric) for o in runs]
            ok = all(o.status == "complete" for o in runs) and all(v is not None and math.isfinite(v) for v in values)
            scores[name] = (
                (float(np.mean(values)), float(np.std(values)), runs[0].job.point)
                if ok
                else (math.nan, math.nan, runs[0].job.point)
            )
        finite = {k: v for k, v in scores.items() if math.isfinite(v[0])}
        if not finite:
            best[label or "run"] = {
                "point": None,
                "metric": metric,
                "mean": None,
                "std": None,
                "candidates": len(scores),
            }
            continue
        name = min(finite, key=lambda k: sign * finite[k][0])
        mean, std, point = finite[name]
        best[label or "run"] = {
            "point": point,
            "folder": name,
            "metric": metric,
            "mean": mean,
            "std": std,
            "candidates": len(scores),
            "at_edge": grid_edges(point, [p for _, _, p in scores.values()]),
        }
    return best


def grid_edges(
    chosen: Mapping[str, Mapping[str, Any]] | None, tried: Sequence[Mapping[str, Mapping[str, Any]] | None]
) -> list[str]:
    """``section.key`` of each numeric setting where ``chosen`` takes the smallest or largest of ≥ 3 values tried."""
    edges = []
    for section, settings in (chosen or {}).items():
        for key, value in settings.items():
            values = {p[section][key] for p in tried if p and isinstance(p.get(section, {}).get(key), (int, float))}
            if isinstance(value, (int, float)) and len(values) >= 3 and value in (min(values), max(values)):
                edges.append(f"{section}.{key}")
    return edges
