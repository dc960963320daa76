"""What ``fedshuffle run`` and ``fedshuffle sweep`` (and the Python API's :meth:`~fedshuffle.api.Experiment.run`)
do around the runs.

First the arguments, read alike by the command line and the API: the results folder
(:func:`check_out`, :func:`pick_folder`), the seeds (:func:`requested_seeds`) and the overrides
(:func:`normalize_overrides`, :func:`~fedshuffle.experiments.sweep.merge_overrides`, :func:`extend_rounds`). Then, in
this order,

1. plan every job and build every distinct run once (:func:`~fedshuffle.experiments.runner.preflight`):
   bad input stops here, before any folder is created (exit status 2); where the jobs will run in worker
   processes, the fork server they start from loads what they need meanwhile
   (:func:`~fedshuffle.experiments.sweep.start_workers_early`);
2. open the results folder (:class:`ResultsFolder`): create it, take its lock, remove temporary
   files of writes cut short, check that it may take these runs (same experiment, same settings per
   run, rounds only extended when asked), write the manifest;
3. run the jobs, then write the summary (and the plot, or ``sweep.json``).

A folder that cannot be written, at any step, is :class:`~fedshuffle.core.errors.ResultsError`
(exit status 4), and what was written before is kept.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedshuffle.core.errors import ConfigError, ResultsError, did_you_mean
from fedshuffle.core.io import write_json
from fedshuffle.experiments import folders, report
from fedshuffle.experiments.results import check_metrics
from fedshuffle.experiments.runner import ensure_writable, preflight, run_identity, sharing_builds
from fedshuffle.experiments.schema import SECTIONS, Experiment, parse_overrides
from fedshuffle.experiments.sweep import (
    Job,
    Outcome,
    check_seeds,
    check_workers,
    jobs_for,
    parse_integers,
    run_jobs,
    select_best,
    start_workers_early,
)


# -- the arguments ---------------------------------------------------------------------------------------


def check_out(out: Any, argument: str = "--out") -> Path | None:
    """A results folder given as ``out`` (None when not given): a path, neither empty nor the filesystem's root."""
    if out is None:
        return None
    if not isinstance(out, (str, os.PathLike)):
        raise ConfigError(argument, f"expected a folder path, got {type(out).__name__}")
    if not str(out).strip():
        raise ConfigError(argument, "empty; give a folder")
    if Path(out).resolve() == Path(Path(out).resolve().anchor):
        raise ConfigError(argument, f"{out} is the root of the filesystem; give a folder for the results")
    return Path(out)


def pick_folder(requested: Path, resume_hint: str) -> tuple[Path, str]:
    """The folder a new run writes to, and the note that says so when it is not ``requested``.

    One rule for ``fedshuffle run`` and :meth:`~fedshuffle.api.Experiment.run`, whether the folder was
    named or is the default ``results/<name>``: a new or empty folder is used; one that already holds
    anything is left alone and the run goes into the first free ``requested-2``, ``requested-3``, ...;
    ``resume_hint`` (``--resume DIR`` or ``resume=True``) says how to continue ``requested`` instead."""
    requested = Path(requested)
    if requested.exists() and not requested.is_dir():
        raise ResultsError(f"cannot write to {requested} (it is a file, not a folder)")
    if not requested.exists() or not any(requested.iterdir()):
        return requested, ""
    base = requested.resolve() if not requested.name else requested
    k = 2
    while (candidate := base.with_name(f"{base.name}-{k}")).exists():
        k += 1
    manifest = folders.read_object(requested / folders.MANIFEST)
    held = f"results of {manifest['experiment']!r}" if isinstance(manifest.get("experiment"), str) else "other files"
    return (
        candidate,
        f"{requested} already holds {held}; writing to {candidate} (to continue the runs in {requested}: "
        f"{resume_hint})",
    )


def resume_folder(folder: Path, argument: str = "--resume") -> Path:
    """The results folder of an experiment to continue: a folder, and not the folder of one of its runs."""
    if not folder.is_dir():
        raise ConfigError(argument, f"{folder} is not a results folder to continue")
    if (folder / "config.json").exists() and (folder / "checkpoint.pt").exists():
        raise ConfigError(
            argument,
            f"{folder} is the folder of one run; give the folder of the experiment (the one the first run wrote to)",
        )
    return folder


def requested_seeds(
    seeds: Any, overrides: Mapping[str, Mapping[str, Any]], argument: str = "--seeds", override: str = "--set run.seed"
) -> list[int] | None:
    """The seeds asked for: ``seeds`` (text ``a..b`` or ``a,b,c``, an integer, or a sequence of distinct integers
    >= 0), or the seed of a ``run.seed`` override, which then runs alone (also where the config lists seeds).
    None: the config's seeds."""
    values: list[Any] | None
    if seeds is None:
        values = None
    elif isinstance(seeds, str):
        values = parse_integers(seeds, argument)
    elif isinstance(seeds, (int, np.integer)) and not isinstance(seeds, bool):
        values = [seeds]
    elif isinstance(seeds, (list, tuple, range, np.ndarray)) and len(seeds):
        values = list(seeds)
    else:
        raise ConfigError(argument, f"expected distinct integers >= 0 (e.g. [0, 1, 2] or range(5)), got {seeds!r}")
    if values is not None:
        check_seeds(values, argument)
    if "seed" in overrides.get("run", {}):
        if values is not None:
            raise ConfigError(argument, f"give the seeds either with {argument} or with {override}, not both")
        values = [overrides["run"]["seed"]]
        check_seeds(values, override)
    return None if values is None else [int(s) for s in values]


def only_variants(experiment: Experiment, labels: Any, argument: str = "--variant") -> Experiment:
    """``experiment`` with only the variants labelled ``labels`` (all when None); an unknown label names the
    variants."""
    if labels is None:
        return experiment
    if isinstance(labels, str) or not isinstance(labels, Sequence) or not labels:
        raise ConfigError(argument, f"expected a list of variant labels, got {labels!r}")
    known = [v.label for v in experiment.variants]
    unknown = [label for label in labels if label not in known]
    if unknown:
        raise ConfigError(argument, f"no variant {unknown[0]!r}; the variants are: {', '.join(known) or '(none)'}")
    return experiment.model_copy(update={"variants": [v for v in experiment.variants if v.label in labels]})


def normalize_overrides(value: Any, argument: str = "--set") -> dict[str, dict[str, Any]]:
    """``["run.rounds=50"]`` (what ``--set`` gives), ``{"run.rounds": 50}`` or ``{"run": {"rounds": 50}}`` →
    ``{"run": {"rounds": 50}}``."""
    if value is None:
        return {}
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        try:
            return parse_overrides(list(value))
        except ConfigError as exc:
            raise ConfigError(argument, exc.message) from None
    if not isinstance(value, Mapping):
        raise ConfigError(
            argument,
            f"expected a dict such as {{'run.rounds': 50}} or a list of 'section.setting=value' strings, got "
            f"{type(value).__name__}",
        )
    out: dict[str, dict[str, Any]] = {}
    for key, setting in value.items():
        parts = str(key).split(".")
        if len(parts) == 2 and parts[0] in SECTIONS:
            out.setdefault(parts[0], {})[parts[1]] = setting
        elif len(parts) == 1 and key in SECTIONS and isinstance(setting, Mapping):
            out.setdefault(key, {}).update(setting)
        else:
            raise ConfigError(
                argument,
                "keys are 'section.setting' (or a section with a dict of settings), section one of "
                f"{', '.join(SECTIONS)}; got {key!r}{did_you_mean(parts[0], SECTIONS)}",
            )
    return out


def extend_rounds(extend_to: int | None, overrides: dict[str, dict[str, Any]]) -> None:
    """``--extend-to N`` is ``run.rounds = N``, allowed to continue runs asked for fewer rounds."""
    if extend_to is None:
        return
    if extend_to < 1:
        raise ConfigError("--extend-to", f"must be >= 1, got {extend_to}")
    given = overrides.get("run", {}).get("rounds")
    if given is not None and given != extend_to:
        raise ConfigError("--extend-to", f"conflicts with --set run.rounds={given}; give one of them")
    overrides.setdefault("run", {})["rounds"] = extend_to


# -- the runs --------------------------------------------------------------------------------------------


def variant_identities(experiment: Experiment, overrides: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """label → the settings of every variant (without grid, seed and rounds), recorded in the manifest."""
    out = {}
    for label, spec in experiment.runs(overrides):
        dumped = spec.model_dump()
        out[label] = folders.identity(dumped, folders.data_hashes(dumped), seed=False)
    return out


class ResultsFolder:
    """Step 2 above, as a context: the lock is held until the runs and summaries are written."""

    def __init__(
        self,
        out: Path,
        kind: str,
        experiment: Experiment,
        overrides: Mapping[str, Any] | None,
        jobs: Sequence[Job],
        *,
        resume: bool,
        extend: bool,
    ) -> None:
        self.out, self.kind, self.experiment, self.jobs = Path(out), kind, experiment, jobs
        self.overrides, self.resume, self.extend = overrides, resume, extend
        self.lock = folders.FolderLock(self.out)
        self.finished = 0

    def __enter__(self) -> ResultsFolder:
        if self.resume and self.kind == "run" and not (self.out / folders.MANIFEST).is_file():
            raise ConfigError(
                "--resume",
                f"{self.out} holds no fedshuffle results (no {folders.MANIFEST}); give the folder that --out named",
            )
        ensure_writable(self.out)
        self.lock.__enter__()
        try:
            folders.remove_leftovers(self.out)
            variants = variant_identities(self.experiment, self.overrides)
            relative = [job.run_dir.relative_to(self.out).as_posix() for job in self.jobs]
            previous = folders.check_folder(
                self.out, kind=self.kind, variants=variants, runs=relative, resume=self.resume
            )
            runs = {}
            for job, where in zip(self.jobs, relative):
                folders.check_no_links(self.out, job.run_dir)
                spec = job.spec.model_copy(update={"run": job.spec.run.model_copy(update={"seed": job.seed})})
                dumped, hashes = run_identity(spec)
                folders.check_run_folder(job.run_dir, dumped, hashes, extend=self.extend)
                done = folders.intact(job.run_dir)
                self.finished += done is not None and (
                    done.get("status") == "diverged"
                    or (done.get("status") == "complete" and done.get("rounds") == spec.run.rounds)
                )
                runs[where] = {
                    "label": job.label,
                    "point": job.point,
                    "seed": job.seed,
                    "config_hash": folders.config_hash(folders.identity(dumped, hashes)),
                }
            try:
                folders.write_manifest(
                    self.out,
                    previous,
                    kind=self.kind,
                    experiment=self.experiment.experiment.name,
                    variants=variants,
                    runs=runs,
                )
            except OSError as exc:
                raise ResultsError(f"cannot write to {self.out} ({exc.strerror or exc})") from None
        except BaseException:
            self.lock.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__()

    def write(self, name: str, obj: Any) -> None:
        try:
            write_json(self.out / name, obj)
        except OSError as exc:
            raise ResultsError(
                f"writing {self.out / name} failed ({exc.strerror or exc}); the runs' results are kept"
            ) from None


def _sharing_builds(command: Callable[..., Any]) -> Callable[..., Any]:
    """The command's preflight and runs share their builds of equal data
    (:func:`~fedshuffle.experiments.runner.sharing_builds`)."""

    @functools.wraps(command)
    def shared(*args: Any, **kwargs: Any) -> Any:
        with sharing_builds():
            return command(*args, **kwargs)

    return shared


@_sharing_builds
def run_experiment(
    experiment: Experiment,
    out_dir: Path,
    *,
    overrides: Mapping[str, Any] | None = None,
    seeds: Sequence[int] | None = None,
    resume: bool = False,
    extend: bool = False,
    show_progress: bool = True,
    workers: int = 1,
    on_open: Any = None,
) -> tuple[dict[str, Any], list[Outcome]]:
    """All variants × seeds of an experiment into ``out_dir``, then the overall summary and the plot."""

    check_workers(workers)
    out_dir = Path(out_dir)
    jobs = jobs_for(experiment, out_dir, [{}], seeds=seeds, overrides=overrides)
    plot = jobs[0].spec.plot
    plotted = check_metrics([plot.metric] if isinstance(plot.metric, str) else plot.metric, "plot.metric")
    start_workers_early(jobs, workers)
    preflight(
        jobs, plotted if "metric" in plot.model_fields_set else ()
    )  # a metric asked for must be one the runs record
    name = experiment.experiment.name
    with ResultsFolder(out_dir, "run", experiment, overrides, jobs, resume=resume, extend=extend) as folder:
        if on_open:
            on_open(folder)
        outcomes = run_jobs(
            jobs,
            workers=workers,
            resume=resume,
            extend=extend,
            experiment=name,
            show_progress=show_progress,
            title=name,
        )
        runs = [
            report.StoredRun(o.job.run_dir, o.job.label, o.job.point, o.job.seed, o.status, o.final, o.message)
            for o in outcomes
        ]
        groups = report.group_runs(runs)
        summary = {
            "experiment": experiment.experiment.model_dump(),
            "variants": {label: report.summarize_runs(group, out_dir) for label, group in groups.items()},
            "plots": ["plot.png", "plot.pdf"],
        }
        folder.write("summary.json", summary)
        try:
            report.plot_runs(
                groups,
                out_dir / "plot",
                metric=plot.metric,
                x=plot.x,
                band=plot.band,
                log_y=plot.log_y,
                title=experiment.experiment.title or name,
                recorded_only="metric" not in plot.model_fields_set,
            )  # the default f_gap: not recorded where no optimum is known
        except OSError as exc:
            raise ResultsError(
                f"writing the plot into {out_dir} failed ({exc.strerror or exc}); the runs' results and summary.json "
                "are kept"
            ) from None
    return summary, outcomes


@_sharing_builds
def run_sweep(
    experiment: Experiment,
    out_dir: Path,
    points: Sequence[Mapping[str, Any]],
    *,
    seeds: Sequence[int] | None,
    overrides: Mapping[str, Any] | None,
    variants: Sequence[str] | None,
    pick: str | None,
    extend: bool,
    workers: int,
    show_progress: bool,
    record: Mapping[str, Any],
    on_open: Any = None,
) -> tuple[dict[str, Any], list[Outcome]]:
    """Every grid point × variant × seed into ``out_dir`` (finished runs are kept), then ``sweep.json``."""
    check_workers(workers)
    jobs = jobs_for(experiment, Path(out_dir), points, seeds, overrides, variants)
    start_workers_early(jobs, workers)
    preflight(jobs)
    name = experiment.experiment.name
    with ResultsFolder(Path(out_dir), "sweep", experiment, overrides, jobs, resume=True, extend=extend) as folder:
        if on_open:
            on_open(folder)
        outcomes = run_jobs(
            jobs,
            workers=workers,
            resume=True,
            extend=extend,
            experiment=name,
            show_progress=show_progress,
            title=f"{name} sweep",
        )
        result = {
            **record,
            "title": experiment.experiment.title or name,  # the title of its figures
            "seeds": sorted({j.seed for j in jobs}),
            "points": list(points),
            "runs": len(jobs),
            "status": {s: sum(o.status == s for o in outcomes) for s in sorted({o.status for o in outcomes})},
        }
        if pick:
            result["best"] = select_best(outcomes, pick)
        folder.write("sweep.json", result)
    return result, outcomes


def figure_title(runs: Sequence[report.StoredRun]) -> str:
    """The title of a figure of ``runs``: for the runs of one sweep, the title of the experiment it swept (recorded in
    its ``sweep.json``), else the one ``fedshuffle run`` gives (:func:`~fedshuffle.experiments.report.plot_title`)."""
    experiments = {r.experiment for r in runs}
    if len(experiments) == 1 and None not in experiments:
        title = folders.read_object(Path(next(iter(experiments))) / "sweep.json").get("title")
        if isinstance(title, str) and title:
            return title
    return report.plot_title(runs)
