"""Reproduce presets and check their papers' claims: tune, run what is missing, judge every claim, write the report.

Each preset (or experiment file with ``[[claims]]``) runs into ``OUT/<name>`` as ``fedshuffle run``
would (a folder that holds its runs is continued, one that holds another experiment is refused). A
variant with a tuning protocol (``tune`` in its ``[[variants]]`` table: the paper's grid and selection
rule) is first run at every grid point on its tuning seeds, as ``fedshuffle sweep`` would, into
``OUT/<name>.tuning/<variant>/``; the point with the best mean of the rule's metric is chosen, and the
judged runs in ``OUT/<name>`` use it on the experiment's own seeds. Each claim
(:mod:`fedshuffle.experiments.claims`) is then judged on the complete seeds.

The verdicts of every preset judged into ``OUT`` are kept in ``OUT/verdicts.json``, with when they were
computed and from which runs: the report (``OUT/report.md`` and a self-contained ``OUT/report.html``,
plots embedded as base64 PNG) shows them all, so ``reproduce B`` after ``reproduce A`` keeps A's
verdicts. Only *primary* claims enter a paper's totals; the others are counted beside them by role.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedshuffle import metrics
from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.experiments.claims import Claim, Verdict, parse_claims, score
from fedshuffle.experiments.folders import MANIFEST, FolderLock, folder_name, read_manifest
from fedshuffle.experiments.report import collect_runs, group_runs
from fedshuffle.experiments.reproduction_report import point_text, write_reports
from fedshuffle.experiments.runner import sharing_builds
from fedshuffle.experiments.schema import Experiment, TuneConfig, _deep_merge, load_experiment, preset_names
from fedshuffle.experiments.session import run_experiment, run_sweep
from fedshuffle.experiments.verdicts import (
    NOT_RUN,
    ClaimResult,
    Diagnostic,
    Robustness,
    Tuning,
    complete_runs,
    counts,
    definition,
    judge_definition,
    load,
    other_roles,
    recheck,
    row,
    write,
)

BUDGETS = ("cpu", "gpu")


def diagnostics(name: str, folder: Path) -> list[Diagnostic]:
    """The method metrics recorded by the complete runs in ``folder``, per variant, averaged over seeds by round."""
    import pandas as pd

    out = []
    for label, members in group_runs(collect_runs([folder])).items():
        frames = [pd.read_csv(r.path / "metrics.csv") for r in members if r.status == "complete"]
        if not frames:
            continue
        table = pd.concat(frames)
        for metric in metrics.of_kind("method"):
            if metric not in table or table[metric].isna().all():
                continue
            by_round = table.dropna(subset=[metric]).groupby("round")[metric].mean()
            out.append(
                Diagnostic(name, label, metric, [int(r) for r in by_round.index], [float(v) for v in by_round.values])
            )
    return out


def _claims(experiment: Experiment) -> list[Claim]:
    return parse_claims(experiment.claims, [v.label for v in experiment.variants])


def _definition(experiment: Experiment) -> dict[str, Any]:
    meta = experiment.experiment
    return definition(
        experiment.claims, [v.label for v in experiment.variants], meta.paper, meta.figure, meta.not_reproducible
    )


def _skipped(name: str, experiment: Experiment, reason: str, verdict: str = NOT_RUN) -> list[ClaimResult]:
    meta = experiment.experiment
    return [row(name, meta.paper, meta.figure, c, Verdict("—", verdict, reason)) for c in _claims(experiment)]


def judge(name: str, experiment: Experiment, folder: Path) -> list[ClaimResult]:
    """Every claim of ``experiment`` on the complete runs stored in ``folder``."""
    return judge_definition(name, _definition(experiment), complete_runs(folder))


# -- tuning ---------------------------------------------------------------------------------------------


def tuning_root(out: Path, name: str) -> Path:
    """The folder of a preset's tuning sweeps: beside the judged runs, never inside their folder."""
    return Path(out) / f"{name}.tuning"


def tuning_folder(out: Path, name: str, label: str) -> Path:
    """Where a variant's tuning sweep lives."""
    return tuning_root(out, name) / folder_name(label)


def _point_key(point: Mapping[str, Any]) -> str:
    return json.dumps(point, sort_keys=True)


def _tuning_runs(folder: Path, seeds: Sequence[int]) -> dict[str, list[Path]]:
    """point key → the ``metrics.csv`` of the complete tuning runs at that point on ``seeds`` (others in the folder
    are left out)."""
    if not (Path(folder) / "sweep.json").is_file():
        return {}
    out: dict[str, list[Path]] = {}
    for r in collect_runs([folder]):
        if r.status == "complete" and r.seed in seeds:
            out.setdefault(_point_key(r.point), []).append(r.path / "metrics.csv")
    return out


def select(label: str, tune: TuneConfig, runs: Mapping[str, Sequence[Path]]) -> Tuning:
    """The paper's selection rule on the tuning runs: per grid point, the mean over the tuning seeds of
    ``tune.metric`` read ``tune.at`` (the geometric mean for errors that go to zero); the best point wins
    (lowest, or highest where higher is better; the first in grid order on a tie). A point where a
    tuning seed did not complete, or has no value, is never chosen."""
    points = tune.points()
    scores: list[float | None] = []
    for point in points:
        files = runs.get(_point_key(point), [])
        stat = score(files, tune.metric, tune.at) if len(files) == len(tune.seeds) else None
        scores.append(None if stat is None else 10**stat.mean if stat.log else stat.mean)
    sign = -1.0 if metrics.METRICS[tune.metric].defaults["better"] == "max" else 1.0
    ranked = [k for k, v in enumerate(scores) if v is not None]
    best = min(ranked, key=lambda k: sign * scores[k]) if ranked else None  # type: ignore[operator]
    return Tuning(
        label,
        tune.metric,
        tune.at,
        list(tune.seeds),
        points,
        scores,
        points[best] if best is not None else None,
        tune.rounds,
    )


def at_selected(experiment: Experiment, tunings: Sequence[Tuning]) -> Experiment:
    """The experiment with each tuned variant's settings at its selected point (the point overrides the variant)."""
    chosen = {t.variant: t.selected for t in tunings}
    variants = []
    for v in experiment.variants:
        point = chosen.get(v.label)
        variants.append(
            v.model_copy(update={s: _deep_merge(getattr(v, s), settings) for s, settings in point.items()})
            if point
            else v
        )
    return experiment.model_copy(update={"variants": variants})


def tune(
    name: str, experiment: Experiment, out: Path, *, run: bool, workers: int, show_progress: bool
) -> tuple[list[Tuning], dict[str, dict[str, list[Path]]]]:
    """Run (or continue) every tuned variant's grid on its tuning seeds, then select its point.
    Returns the tunings and, per variant, the tuning runs by point key."""
    tunings, runs = [], {}
    for variant in experiment.variants:
        if variant.tune is None:
            continue
        folder = tuning_folder(out, name, variant.label)
        if run:  # the sweep folder records this variant alone: another variant's settings do not touch its tuning
            alone = experiment.model_copy(update={"variants": [variant]})
            horizon = {"run": {"rounds": variant.tune.rounds}} if variant.tune.rounds is not None else None
            run_sweep(
                alone,
                folder,
                variant.tune.points(),
                seeds=variant.tune.seeds,
                overrides=horizon,
                variants=None,
                pick=None,
                extend=False,
                workers=workers,
                show_progress=show_progress,
                record={"tuning": {"variant": variant.label, **variant.tune.model_dump()}},
            )
        runs[variant.label] = _tuning_runs(folder, variant.tune.seeds)
        tunings.append(select(variant.label, variant.tune, runs[variant.label]))
    return tunings, runs


def robustness(
    experiment: Experiment,
    tunings: Sequence[Tuning],
    tuning_runs: Mapping[str, Mapping[str, list[Path]]],
    judged: Mapping[str, list[Path]],
) -> list[Robustness]:
    """Every claim's verdict at every grid point of its tuned arms, on the tuning seeds (untuned arms: their judged
    runs).

    When the claim's tuned arms share one grid, all of them sit at the same point (the papers compare
    methods at equal multipliers); otherwise each tuned arm goes through its grid with the others at their selected
    points.
    """
    by_label = {t.variant: t for t in tunings}
    out = []
    for claim in _claims(experiment):
        tuned = [v for v in claim.variants() if v in by_label]
        if not tuned:
            continue
        fixed = {v: judged.get(v, []) for v in claim.variants() if v not in by_label}
        grids = {json.dumps(by_label[v].points, sort_keys=True) for v in tuned}
        if len(grids) == 1:
            cases = [(point_text(p), {v: p for v in tuned}) for p in by_label[tuned[0]].points]
        else:
            cases = [
                (f"{v}: {point_text(p)}", {**{u: by_label[u].selected for u in tuned}, v: p})
                for v in tuned
                for p in by_label[v].points
            ]
        for text, points in cases:
            runs = {
                **fixed,
                **{v: tuning_runs[v].get(_point_key(p), []) if p is not None else [] for v, p in points.items()},
            }
            out.append(Robustness(claim.describe(), text, claim.evaluate(runs).verdict))
    return out


# -- one preset -----------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _provenance(out: Path, folder: Path, tunings: Sequence[Tuning]) -> dict[str, Any]:
    """The runs the verdicts come from: each judged run folder (relative to ``out``) with its config hash, and the
    tuning folders."""
    manifest = read_manifest(folder) if (folder / MANIFEST).is_file() else None
    recorded = (manifest or {}).get("runs", {})
    runs = {
        f"{folder.name}/{where}": entry.get("config_hash", "")
        for where, entry in sorted(recorded.items())
        if isinstance(entry, dict)
    }
    seeds = sorted(
        {
            entry.get("seed")
            for entry in recorded.values()
            if isinstance(entry, dict) and isinstance(entry.get("seed"), int)
        }
    )
    tuning = {
        t.variant: sum(len(p) for p in _tuning_runs(tuning_folder(out, folder.name, t.variant), t.seeds).values())
        for t in tunings
    }
    return {"runs": runs, "seeds": seeds, "tuning_runs": tuning}


def _record(
    name: str,
    experiment: Experiment,
    rows: Sequence[ClaimResult],
    *,
    provenance: Mapping[str, Any] | None = None,
    tunings: Sequence[Tuning] = (),
    robust: Sequence[Robustness] = (),
    extra: Sequence[Diagnostic] = (),
    plot: str | None = None,
) -> dict[str, Any]:
    meta = experiment.experiment
    return {
        "name": name,
        "paper": meta.paper,
        "figure": meta.figure,
        "title": meta.title,
        "deviations": list(meta.deviations),
        "computed": _now(),
        "definition": _definition(experiment),
        "provenance": dict(provenance or {}),
        "claims": [asdict(r) for r in rows],
        "tuning": [asdict(t) for t in tunings],
        "robustness": [asdict(r) for r in robust],
        "diagnostics": [asdict(d) for d in extra],
        "plot": plot,
    }


class Stopwatch:
    """Wall seconds per phase of a preset: :meth:`lap` ends the phase running (if any) and starts the next."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._phase: str | None = None
        self._started = 0.0

    def lap(self, phase: str | None) -> None:
        now = time.perf_counter()
        if self._phase is not None:
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + now - self._started
        self._phase, self._started = phase, now


def _one(
    experiment: Experiment,
    out: Path,
    *,
    budget: str | None,
    run: bool,
    workers: int,
    show_progress: bool,
    note: Any,
    watch: Stopwatch,
) -> tuple[dict[str, Any], bool]:
    """The record of one preset, and whether it holds verdicts (False: skipped, nothing judged); ``watch`` times its
    tuning and runs."""
    name = experiment.experiment.name
    sized = experiment.experiment.budget or "cpu"
    if budget == "cpu" and sized == "gpu":
        if note:
            note(f"{name}: skipped, sized for a GPU")
        reason = (
            f"sized for a GPU (budget = gpu, about {experiment.experiment.expected_minutes or '?'} min there); "
            "run with --budget gpu"
        )
        return _record(name, experiment, _skipped(name, experiment, reason)), False
    folder = Path(out) / name
    watch.lap("tuning")
    tunings, tuning_runs = tune(name, experiment, out, run=run, workers=workers, show_progress=show_progress)
    unselected = [t.variant for t in tunings if t.selected is None]
    if unselected:
        verdict = "not run" if not run else "not measured"
        reason = f"tuning chose no point for {', '.join(unselected)}: " + (
            "no finished tuning runs (judged without running)"
            if not run
            else "at no grid point did every tuning seed complete"
        )
        return _record(name, experiment, _skipped(name, experiment, reason, verdict), tunings=tunings), run
    judged = at_selected(experiment, tunings)
    if not run and not (folder / "summary.json").is_file():  # written once every run of the preset has ended
        return _record(
            name,
            experiment,
            _skipped(name, experiment, f"no finished results in {folder} (judged without running)"),
            tunings=tunings,
        ), False
    if run:
        if note:
            note(
                f"{name}: {'continuing' if (folder / MANIFEST).is_file() else 'running'} in {folder}"
                + (f" ({', '.join(f'{t.variant} at {point_text(t.selected)}' for t in tunings)})" if tunings else "")
            )
        watch.lap("runs")
        run_experiment(
            judged, folder, resume=(folder / MANIFEST).is_file(), show_progress=show_progress, workers=workers
        )
    rows = judge(name, judged, folder)
    robust = robustness(judged, tunings, tuning_runs, complete_runs(folder)) if tunings else []
    plot = f"{name}/plot.png" if (folder / "plot.png").is_file() else None
    return _record(
        name,
        experiment,
        rows,
        provenance=_provenance(Path(out), folder, tunings),
        tunings=tunings,
        robust=robust,
        extra=diagnostics(name, folder),
        plot=plot,
    ), True


def reproduce(
    presets: Sequence[str],
    out: Path,
    *,
    budget: str | None = None,
    run: bool = True,
    show_progress: bool = True,
    note: Any = None,
    workers: int = 1,
) -> list[ClaimResult]:
    """Tune, run (or continue) each preset into ``out/<name>`` and judge its claims; a preset sized for
    another budget than ``budget`` is not run and its claims say so. With ``run=False`` nothing runs:
    the complete runs already in ``out`` are judged. ``workers``: worker processes for each preset's runs and tuning
    grid (its seeds and grid points batched as replicas, :mod:`fedshuffle.replicas`, spread over them). The verdicts
    join those already in ``out`` (a preset judged again replaces its own; one skipped keeps the verdicts it had)
    and the reports show them all. Returns this call's rows."""
    if budget is not None and budget not in BUDGETS:
        raise ConfigError("--budget", f"unknown {budget!r}; accepted: {', '.join(BUDGETS)}")
    if not presets:
        raise ConfigError("presets", f"give at least one preset (or --all); presets: {', '.join(preset_names())}")
    if workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {workers}")
    loaded = [load_experiment(p) for p in presets]  # every config checked before anything runs
    rows: list[ClaimResult] = []
    for experiment in loaded:
        name, watch = experiment.experiment.name, Stopwatch()
        continued = (Path(out) / name).exists() or tuning_root(
            out, name
        ).exists()  # this call's time adds to that spent on these folders
        try:
            with sharing_builds():  # the preset's tuning, preflight and judged runs read each data once
                record, has_verdicts = _one(
                    experiment,
                    Path(out),
                    budget=budget,
                    run=run,
                    workers=workers,
                    show_progress=show_progress,
                    note=note,
                    watch=watch,
                )
        finally:  # also when interrupted: a later call continues these folders and adds its own time
            watch.lap(None)
            if run and watch.seconds:
                add_time(Path(out), name, watch.seconds, continued)
        rows += [ClaimResult(**r) for r in record["claims"]]
        save(Path(out), record, replace=has_verdicts, note=note)
    return rows


# -- the store of verdicts ------------------------------------------------------------------------------


def add_time(out: Path, name: str, seconds: Mapping[str, float], continued: bool) -> None:
    """Add a call's wall ``seconds`` (``tuning``, ``runs``) to the preset's time in ``out`` (in place of it when the
    call
    started the preset's folders afresh), holding the folder's lock."""
    out = Path(out)
    try:
        with FolderLock(out):
            store, times = load(out)
            earlier = times.get(name, {}) if continued else {}
            times[name] = {k: round(earlier.get(k, 0.0) + seconds.get(k, 0.0), 1) for k in ("tuning", "runs")}
            write(out, store, times)
    except OSError as exc:
        raise ResultsError(
            f"cannot write the report into {out} ({exc.strerror or exc}); the runs' results are kept"
        ) from None


def save(out: Path, record: Mapping[str, Any], *, replace: bool = True, note: Any = None) -> dict[str, dict[str, Any]]:
    """Add ``record`` to the store (in place of the preset's earlier one; with ``replace = False`` only
    when it has none), check every kept record against its runs (:func:`~fedshuffle.experiments.verdicts.recheck`),
    and write the store and both reports, holding the folder's lock."""
    out = Path(out)
    try:
        with FolderLock(out):
            store, times = load(out)
            if replace or record["name"] not in store:
                store[record["name"]] = dict(record)
            store = recheck(out, store, note)
            write(out, store, times)
            write_reports({name: {**r, "seconds": times.get(name)} for name, r in store.items()}, out)
    except OSError as exc:
        raise ResultsError(
            f"cannot write the report into {out} ({exc.strerror or exc}); the runs' results are kept"
        ) from None
    return store


def as_json(rows: Sequence[ClaimResult]) -> dict[str, Any]:
    """This call's claims, the primary claims' totals per paper, and the other roles' counts beside them."""
    return {"claims": [asdict(r) for r in rows], "counts": counts(rows), "other_roles": other_roles(rows)}
