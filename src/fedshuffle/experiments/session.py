"""What ``fedshuffle run`` and ``fedshuffle sweep`` do around the runs: in this order,

1. plan every job and build every distinct run once (:func:`~fedshuffle.experiments.runner.preflight`):
   bad input stops here, before any folder is created (exit status 2);
2. open the results folder (:class:`ResultsFolder`): create it, take its lock, remove temporary
   files of writes cut short, check that it may take these runs (same experiment, same settings per
   run, rounds only extended when asked), write the manifest;
3. run the jobs, then write the summary (and the plot, or ``sweep.json``).

A folder that cannot be written, at any step, is :class:`~fedshuffle.core.errors.ResultsError`
(exit status 4), and what was written before is kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.core.io import write_json
from fedshuffle.experiments import folders, report
from fedshuffle.experiments.results import check_metrics
from fedshuffle.experiments.schema import Experiment
from fedshuffle.experiments.sweep import Job, Outcome, check_workers, jobs_for, run_jobs, select_best
from fedshuffle.experiments.runner import ensure_writable, preflight, run_identity, sharing_builds


def variant_identities(experiment: Experiment, overrides: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """label → the settings of every variant (without grid, seed and rounds), recorded in the manifest."""
    out = {}
    for label, spec in experiment.runs(overrides):
        dumped = spec.model_dump()
        out[label] = folders.identity(dumped, folders.data_hashes(dumped), seed=False)
    return out


class ResultsFolder:
    """Step 2 above, as a context: the lock is held until the runs and summaries are written."""

    def __init__(self, out: Path, kind: str, experiment: Experiment, overrides: Mapping[str, Any] | None, jobs: Sequence[Job], *, resume: bool, extend: bool) -> None:
        self.out, self.kind, self.experiment, self.jobs = Path(out), kind, experiment, jobs
        self.overrides, self.resume, self.extend = overrides, resume, extend
        self.lock = folders.FolderLock(self.out)
        self.finished = 0

    def __enter__(self) -> ResultsFolder:
        if self.resume and self.kind == "run" and not (self.out / folders.MANIFEST).is_file():
            raise ConfigError("--resume", f"{self.out} holds no fedshuffle results (no {folders.MANIFEST}); give the folder that --out named")
        ensure_writable(self.out)
        self.lock.__enter__()
        try:
            folders.remove_leftovers(self.out)
            variants = variant_identities(self.experiment, self.overrides)
            relative = [job.run_dir.relative_to(self.out).as_posix() for job in self.jobs]
            previous = folders.check_folder(self.out, kind=self.kind, variants=variants, runs=relative, resume=self.resume)
            runs = {}
            for job, where in zip(self.jobs, relative):
                folders.check_no_links(self.out, job.run_dir)
                spec = job.spec.model_copy(update={"run": job.spec.run.model_copy(update={"seed": job.seed})})
                dumped, hashes = run_identity(spec)
                folders.check_run_folder(job.run_dir, dumped, hashes, extend=self.extend)
                done = folders.intact(job.run_dir)
                self.finished += done is not None and (done.get("status") == "diverged" or (done.get("status") == "complete" and done.get("rounds") == spec.run.rounds))
                runs[where] = {"label": job.label, "point": job.point, "seed": job.seed, "config_hash": folders.config_hash(folders.identity(dumped, hashes))}
            try:
                folders.write_manifest(self.out, previous, kind=self.kind, experiment=self.experiment.experiment.name, variants=variants, runs=runs)
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
            raise ResultsError(f"writing {self.out / name} failed ({exc.strerror or exc}); the runs' results are kept") from None


def _sharing_builds(command: Callable[..., Any]) -> Callable[..., Any]:
    """The command's preflight and runs share their builds of equal data (:func:`~fedshuffle.experiments.runner.sharing_builds`)."""

    @functools.wraps(command)
    def shared(*args: Any, **kwargs: Any) -> Any:
        with sharing_builds():
            return command(*args, **kwargs)

    return shared


@_sharing_builds
def run_experiment(
    experiment: Experiment, out_dir: Path, *, overrides: Mapping[str, Any] | None = None, seeds: Sequence[int] | None = None, resume: bool = False,
    extend: bool = False, show_progress: bool = True, workers: int = 1, on_open: Any = None,
) -> tuple[dict[str, Any], list[Outcome]]:
    """All variants × seeds of an experiment into ``out_dir``, then the overall summary and the plot."""

    check_workers(workers)
    out_dir = Path(out_dir)
    jobs = jobs_for(experiment, out_dir, [{}], seeds=seeds, overrides=overrides)
    plot = jobs[0].spec.plot
    plotted = check_metrics([plot.metric] if isinstance(plot.metric, str) else plot.metric, "plot.metric")
    preflight(jobs, plotted if "metric" in plot.model_fields_set else ())  # a metric asked for must be one the runs record
    name = experiment.experiment.name
    with ResultsFolder(out_dir, "run", experiment, overrides, jobs, resume=resume, extend=extend) as folder:
        if on_open:
            on_open(folder)
        outcomes = run_jobs(jobs, workers=workers, resume=resume, extend=extend, experiment=name, show_progress=show_progress, title=name)
        runs = [report.StoredRun(o.job.run_dir, o.job.label, o.job.point, o.job.seed, o.status, o.final, o.message) for o in outcomes]
        groups = report.group_runs(runs)
        summary = {
            "experiment": experiment.experiment.model_dump(),
            "variants": {label: report.summarize_runs(group, out_dir) for label, group in groups.items()},
            "plots": ["plot.png", "plot.pdf"],
        }
        folder.write("summary.json", summary)
        try:
            report.plot_runs(groups, out_dir / "plot", metric=plot.metric, x=plot.x, band=plot.band, log_y=plot.log_y, title=experiment.experiment.title or name,
                      recorded_only="metric" not in plot.model_fields_set)  # the default f_gap: not recorded where no optimum is known
        except OSError as exc:
            raise ResultsError(f"writing the plot into {out_dir} failed ({exc.strerror or exc}); the runs' results and summary.json are kept") from None
    return summary, outcomes


@_sharing_builds
def run_sweep(
    experiment: Experiment, out_dir: Path, points: Sequence[Mapping[str, Any]], *, seeds: Sequence[int] | None, overrides: Mapping[str, Any] | None,
    variants: Sequence[str] | None, pick: str | None, extend: bool, workers: int, show_progress: bool, record: Mapping[str, Any], on_open: Any = None,
) -> tuple[dict[str, Any], list[Outcome]]:
    """Every grid point × variant × seed into ``out_dir`` (finished runs are kept), then ``sweep.json``."""
    check_workers(workers)
    jobs = jobs_for(experiment, Path(out_dir), points, seeds, overrides, variants)
    preflight(jobs)
    name = experiment.experiment.name
    with ResultsFolder(Path(out_dir), "sweep", experiment, overrides, jobs, resume=True, extend=extend) as folder:
        if on_open:
            on_open(folder)
        outcomes = run_jobs(jobs, workers=workers, resume=True, extend=extend, experiment=name, show_progress=show_progress, title=f"{name} sweep")
        result = {**record, "seeds": sorted({j.seed for j in jobs}), "points": list(points), "runs": len(jobs),
                  "status": {s: sum(o.status == s for o in outcomes) for s in sorted({o.status for o in outcomes})}}
        if pick:
            result["best"] = select_best(outcomes, pick)
        folder.write("sweep.json", result)
    return result, outcomes
