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

import base64
import datetime
import html
import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedshuffle import metrics
from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.core.io import read_text, write_atomic
from fedshuffle.experiments.claims import FRACTIONS, ROLES, VERDICTS, Claim, Verdict, is_log, parse_claims, score
from fedshuffle.experiments.folders import MANIFEST, FolderLock, folder_name, read_manifest
from fedshuffle.experiments.report import collect_runs, group_runs
from fedshuffle.experiments.schema import Experiment, TuneConfig, _deep_merge, load_experiment, preset_names
from fedshuffle.experiments.session import run_experiment, run_sweep

BUDGETS = ("cpu", "gpu")
#: the store of every preset's verdicts in a reproduce folder
STORE = "verdicts.json"

#: the verdict of every claim of an experiment the paper's data cannot be had for (``experiment.not_reproducible``)
NOT_REPRODUCIBLE = "not reproducible"


@dataclass(frozen=True)
class ClaimResult:
    """One row of the report; ``fractions``: an ordering's verdict as if the runs had stopped at 25 %, 50 %, 100 %."""

    preset: str
    paper: str
    figure: str
    claim: str
    quote: str
    measured: str
    verdict: str
    why: str
    role: str = "primary"
    seeds: int = 0
    fractions: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Tuning:
    """One variant's tuning: its protocol, each grid point's score (mean over the tuning seeds; None when a
    seed did not complete or has no value) and the point chosen (None when no point scored)."""

    variant: str
    metric: str
    at: str
    seeds: list[int]
    points: list[dict[str, Any]]
    scores: list[float | None]
    selected: dict[str, Any] | None
    rounds: int | None = None  # the tuning horizon, where shorter than the judged runs'


@dataclass(frozen=True)
class Robustness:
    """A claim's verdict at one grid point, on the tuning seeds (``point``: the arms and settings varied)."""

    claim: str
    point: str
    verdict: str


@dataclass(frozen=True)
class Diagnostic:
    """A method's own per-round quantity (a metric of kind ``method``, e.g. FedCDR's prox residual) for one
    variant of a preset: the evaluated rounds and, at each, the mean over the complete seeds."""

    preset: str
    variant: str
    metric: str
    rounds: list[int]
    values: list[float]


#: at most this many rounds of a diagnostic in the report (evenly spaced, the last one always)
DIAGNOSTIC_ROWS = 26


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
            out.append(Diagnostic(name, label, metric, [int(r) for r in by_round.index], [float(v) for v in by_round.values]))
    return out


def _shown_rows(count: int) -> list[int]:
    if count <= DIAGNOSTIC_ROWS:
        return list(range(count))
    step = (count - 1) / (DIAGNOSTIC_ROWS - 1)
    return sorted({round(k * step) for k in range(DIAGNOSTIC_ROWS)})


def _row(name: str, experiment: Experiment, claim: Claim, measured: str, verdict: str, why: str, seeds: int = 0, fractions: Mapping[float, str] | None = None) -> ClaimResult:
    meta = experiment.experiment
    shown = {f"{f:.0%}": v for f, v in (fractions or {}).items()}
    return ClaimResult(name, meta.paper, claim.figure or meta.figure, claim.describe(), claim.quote, measured, verdict, why, claim.role, seeds, shown)


def _claims(experiment: Experiment) -> list[Claim]:
    return parse_claims(experiment.claims, [v.label for v in experiment.variants])


def _skipped(name: str, experiment: Experiment, reason: str, verdict: str = "not run") -> list[ClaimResult]:
    return [_row(name, experiment, c, "—", verdict, reason) for c in _claims(experiment)]


def _complete_runs(folder: Path) -> dict[str, list[Path]]:
    """label → the ``metrics.csv`` of the complete runs of the experiment stored in ``folder`` (not of folders nested in it)."""
    runs = [r for r in collect_runs([folder]) if r.experiment == Path(folder).resolve()]
    return {label: [r.path / "metrics.csv" for r in members if r.status == "complete"] for label, members in group_runs(runs).items()} if runs else {}


def judge(name: str, experiment: Experiment, folder: Path) -> list[ClaimResult]:
    """Every claim of ``experiment`` on the complete runs stored in ``folder``."""
    runs = _complete_runs(folder)
    rows, unavailable = [], experiment.experiment.not_reproducible
    for claim in _claims(experiment):
        verdict = claim.judge(runs)
        if unavailable:  # what the substitute setup measured is shown, but it is no evidence about the paper
            verdict = Verdict(verdict.measured, NOT_REPRODUCIBLE, f"{unavailable}; on the substitute it {verdict.verdict}: {verdict.why}", verdict.seeds)
        rows.append(_row(name, experiment, claim, verdict.measured, verdict.verdict, verdict.why, verdict.seeds, dict(verdict.fractions)))
    return rows


# -- tuning ---------------------------------------------------------------------------------------------


def tuning_root(out: Path, name: str) -> Path:
    """The folder of a preset's tuning sweeps: beside the judged runs, never inside their folder."""
    return Path(out) / f"{name}.tuning"


def tuning_folder(out: Path, name: str, label: str) -> Path:
    """Where a variant's tuning sweep lives."""
    return tuning_root(out, name) / folder_name(label)


def _point_key(point: Mapping[str, Any]) -> str:
    return json.dumps(point, sort_keys=True)


def _point_text(point: Mapping[str, Mapping[str, Any]] | None) -> str:
    return ", ".join(f"{section}.{key} = {value}" for section, settings in (point or {}).items() for key, value in settings.items()) or "—"


def _tuning_runs(folder: Path, seeds: Sequence[int]) -> dict[str, list[Path]]:
    """point key → the ``metrics.csv`` of the complete tuning runs at that point on ``seeds`` (others in the folder are left out)."""
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
        scores.append(None if stat is None else 10 ** stat.mean if stat.log else stat.mean)
    sign = -1.0 if metrics.METRICS[tune.metric].defaults["better"] == "max" else 1.0
    ranked = [k for k, v in enumerate(scores) if v is not None]
    best = min(ranked, key=lambda k: sign * scores[k]) if ranked else None  # type: ignore[operator]
    return Tuning(label, tune.metric, tune.at, list(tune.seeds), points, scores, points[best] if best is not None else None, tune.rounds)


def at_selected(experiment: Experiment, tunings: Sequence[Tuning]) -> Experiment:
    """The experiment with each tuned variant's settings at its selected point (the point overrides the variant)."""
    chosen = {t.variant: t.selected for t in tunings}
    variants = []
    for v in experiment.variants:
        point = chosen.get(v.label)
        variants.append(v.model_copy(update={s: _deep_merge(getattr(v, s), settings) for s, settings in point.items()}) if point else v)
    return experiment.model_copy(update={"variants": variants})


def tune(name: str, experiment: Experiment, out: Path, *, run: bool, workers: int, show_progress: bool) -> tuple[list[Tuning], dict[str, dict[str, list[Path]]]]:
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
            run_sweep(alone, folder, variant.tune.points(), seeds=variant.tune.seeds, overrides=horizon, variants=None, pick=None, extend=False,
                      workers=workers, show_progress=show_progress, record={"tuning": {"variant": variant.label, **variant.tune.model_dump()}})
        runs[variant.label] = _tuning_runs(folder, variant.tune.seeds)
        tunings.append(select(variant.label, variant.tune, runs[variant.label]))
    return tunings, runs


def robustness(experiment: Experiment, tunings: Sequence[Tuning], tuning_runs: Mapping[str, Mapping[str, list[Path]]], judged: Mapping[str, list[Path]]) -> list[Robustness]:
    """Every claim's verdict at every grid point of its tuned arms, on the tuning seeds (untuned arms: their judged runs).

    When the claim's tuned arms share one grid, all of them sit at the same point (the papers compare
    methods at equal multipliers); otherwise each tuned arm goes through its grid with the others at their selected points.
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
            cases = [(_point_text(p), {v: p for v in tuned}) for p in by_label[tuned[0]].points]
        else:
            cases = [(f"{v}: {_point_text(p)}", {**{u: by_label[u].selected for u in tuned}, v: p}) for v in tuned for p in by_label[v].points]
        for text, points in cases:
            runs = {**fixed, **{v: tuning_runs[v].get(_point_key(p), []) if p is not None else [] for v, p in points.items()}}
            out.append(Robustness(claim.describe(), text, claim.evaluate(runs).verdict))
    return out


# -- one preset -----------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _provenance(out: Path, folder: Path, tunings: Sequence[Tuning]) -> dict[str, Any]:
    """The runs the verdicts come from: each judged run folder (relative to ``out``) with its config hash, and the tuning folders."""
    manifest = read_manifest(folder) if (folder / MANIFEST).is_file() else None
    recorded = (manifest or {}).get("runs", {})
    runs = {f"{folder.name}/{where}": entry.get("config_hash", "") for where, entry in sorted(recorded.items()) if isinstance(entry, dict)}
    seeds = sorted({entry.get("seed") for entry in recorded.values() if isinstance(entry, dict) and isinstance(entry.get("seed"), int)})
    tuning = {t.variant: sum(len(p) for p in _tuning_runs(tuning_folder(out, folder.name, t.variant), t.seeds).values()) for t in tunings}
    return {"runs": runs, "seeds": seeds, "tuning_runs": tuning}


def _record(name: str, experiment: Experiment, rows: Sequence[ClaimResult], *, provenance: Mapping[str, Any] | None = None, tunings: Sequence[Tuning] = (),
            robust: Sequence[Robustness] = (), extra: Sequence[Diagnostic] = (), plot: str | None = None) -> dict[str, Any]:
    meta = experiment.experiment
    return {"name": name, "paper": meta.paper, "figure": meta.figure, "title": meta.title, "deviations": list(meta.deviations), "computed": _now(),
            "provenance": dict(provenance or {}), "claims": [asdict(r) for r in rows], "tuning": [asdict(t) for t in tunings],
            "robustness": [asdict(r) for r in robust], "diagnostics": [asdict(d) for d in extra], "plot": plot}


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


def _one(experiment: Experiment, out: Path, *, budget: str | None, run: bool, workers: int, show_progress: bool, note: Any, watch: Stopwatch) -> tuple[dict[str, Any], bool]:
    """The record of one preset, and whether it holds verdicts (False: skipped, nothing judged); ``watch`` times its tuning and runs."""
    name = experiment.experiment.name
    sized = experiment.experiment.budget or "cpu"
    if budget == "cpu" and sized == "gpu":
        if note:
            note(f"{name}: skipped, sized for a GPU")
        reason = f"sized for a GPU (budget = gpu, about {experiment.experiment.expected_minutes or '?'} min there); run with --budget gpu"
        return _record(name, experiment, _skipped(name, experiment, reason)), False
    folder = Path(out) / name
    watch.lap("tuning")
    tunings, tuning_runs = tune(name, experiment, out, run=run, workers=workers, show_progress=show_progress)
    unselected = [t.variant for t in tunings if t.selected is None]
    if unselected:
        verdict = "not run" if not run else "not measured"
        reason = f"tuning chose no point for {', '.join(unselected)}: " + ("no finished tuning runs (judged without running)" if not run else "at no grid point did every tuning seed complete")
        return _record(name, experiment, _skipped(name, experiment, reason, verdict), tunings=tunings), run
    judged = at_selected(experiment, tunings)
    if not run and not (folder / "summary.json").is_file():  # written once every run of the preset has ended
        return _record(name, experiment, _skipped(name, experiment, f"no finished results in {folder} (judged without running)"), tunings=tunings), False
    if run:
        if note:
            note(f"{name}: {'continuing' if (folder / MANIFEST).is_file() else 'running'} in {folder}" + (f" ({', '.join(f'{t.variant} at {_point_text(t.selected)}' for t in tunings)})" if tunings else ""))
        watch.lap("runs")
        run_experiment(judged, folder, resume=(folder / MANIFEST).is_file(), show_progress=show_progress, workers=workers)
    rows = judge(name, judged, folder)
    robust = robustness(judged, tunings, tuning_runs, _complete_runs(folder)) if tunings else []
    plot = f"{name}/plot.png" if (folder / "plot.png").is_file() else None
    return _record(name, experiment, rows, provenance=_provenance(Path(out), folder, tunings), tunings=tunings, robust=robust, extra=diagnostics(name, folder), plot=plot), True


def reproduce(presets: Sequence[str], out: Path, *, budget: str | None = None, run: bool = True, show_progress: bool = True, note: Any = None, workers: int = 1) -> list[ClaimResult]:
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
        continued = (Path(out) / name).exists() or tuning_root(out, name).exists()  # this call's time adds to that spent on these folders
        try:
            record, has_verdicts = _one(experiment, Path(out), budget=budget, run=run, workers=workers, show_progress=show_progress, note=note, watch=watch)
        finally:  # also when interrupted: a later call continues these folders and adds its own time
            watch.lap(None)
            if run and watch.seconds:
                add_time(Path(out), name, watch.seconds, continued)
        rows += [ClaimResult(**r) for r in record["claims"]]
        save(Path(out), record, replace=has_verdicts)
    return rows


# -- the store of verdicts ------------------------------------------------------------------------------


def _load(out: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float]]]:
    """The records and the seconds kept in ``out/verdicts.json``, each checked (empty when there is no file)."""
    path = Path(out) / STORE
    if not path.is_file():
        return {}, {}
    try:
        doc = json.loads(read_text(path))  # a regular file only: never blocks on a FIFO
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(str(path), f"unreadable verdicts ({exc.__class__.__name__}: {exc}); remove it to start the report afresh") from None
    presets = doc.get("presets") if isinstance(doc, dict) else None
    if not isinstance(presets, dict) or not all(isinstance(r, dict) and r.get("name") == name and isinstance(r.get("claims"), list) for name, r in presets.items()):
        raise ConfigError(str(path), "not a verdicts file (expected an object with 'presets'); remove it to start the report afresh")
    try:
        for record in presets.values():
            [ClaimResult(**row) for row in record["claims"]]
            [Diagnostic(**d) for d in record.get("diagnostics", [])]
    except TypeError as exc:
        raise ConfigError(str(path), f"a verdict of another form ({exc}); remove it to start the report afresh") from None
    seconds = doc.get("seconds", {})
    if not isinstance(seconds, dict) or not all(
        isinstance(t, dict) and set(t) == {"tuning", "runs"} and all(isinstance(v, (int, float)) for v in t.values()) for t in seconds.values()
    ):
        raise ConfigError(str(path), "'seconds' is not preset → {tuning, runs} seconds; remove it to start the report afresh")
    return presets, seconds


def _write_store(out: Path, store: Mapping[str, Any], seconds: Mapping[str, Any]) -> None:
    write_atomic(out / STORE, json.dumps({"format": 1, "presets": store, "seconds": seconds}, indent=1, ensure_ascii=False))


def add_time(out: Path, name: str, seconds: Mapping[str, float], continued: bool) -> None:
    """Add a call's wall ``seconds`` (``tuning``, ``runs``) to the preset's time in ``out`` (in place of it when the call
    started the preset's folders afresh), holding the folder's lock."""
    out = Path(out)
    try:
        with FolderLock(out):
            store, times = _load(out)
            earlier = times.get(name, {}) if continued else {}
            times[name] = {k: round(earlier.get(k, 0.0) + seconds.get(k, 0.0), 1) for k in ("tuning", "runs")}
            _write_store(out, store, times)
    except OSError as exc:
        raise ResultsError(f"cannot write the report into {out} ({exc.strerror or exc}); the runs' results are kept") from None


def save(out: Path, record: Mapping[str, Any], *, replace: bool = True) -> dict[str, dict[str, Any]]:
    """Add ``record`` to the store (in place of the preset's earlier one; with ``replace = False`` only
    when it has none) and write the store and both reports, holding the folder's lock."""
    out = Path(out)
    try:
        with FolderLock(out):
            store, times = _load(out)
            if replace or record["name"] not in store:
                store[record["name"]] = dict(record)
            _write_store(out, store, times)
            write_reports({name: {**r, "seconds": times.get(name)} for name, r in store.items()}, out)
    except OSError as exc:
        raise ResultsError(f"cannot write the report into {out} ({exc.strerror or exc}); the runs' results are kept") from None
    return store


def counts(rows: Sequence[ClaimResult | Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """paper → verdict → number of *primary* claims (the paper's totals)."""
    out: dict[str, Counter] = {}
    for r in map(_as_row, rows):
        if r.role == "primary":
            out.setdefault(r.paper, Counter())[r.verdict] += 1
        else:
            out.setdefault(r.paper, Counter())
    return {paper: dict(c) for paper, c in out.items()}


def other_roles(rows: Sequence[ClaimResult | Mapping[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """paper → role → verdict → number of the claims that are not primary (listed beside the totals)."""
    out: dict[str, dict[str, Counter]] = {}
    for r in map(_as_row, rows):
        if r.role != "primary":
            out.setdefault(r.paper, {}).setdefault(r.role, Counter())[r.verdict] += 1
    return {paper: {role: dict(c) for role, c in sorted(roles.items(), key=lambda kv: ROLES.index(kv[0]))} for paper, roles in out.items()}


def _as_row(r: ClaimResult | Mapping[str, Any]) -> ClaimResult:
    return r if isinstance(r, ClaimResult) else ClaimResult(**r)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


COLUMNS = (*VERDICTS, "not measured", NOT_REPRODUCIBLE, "not run")


def _all_rows(store: Mapping[str, Mapping[str, Any]]) -> list[ClaimResult]:
    return [ClaimResult(**r) for record in store.values() for r in record["claims"]]


def _fractions_text(r: ClaimResult) -> str:
    return " / ".join(r.fractions.get(f"{f:.0%}", "—") for f in FRACTIONS) if r.fractions else ""


def _tuning_lines(record: Mapping[str, Any]) -> list[str]:
    lines = []
    for t in record.get("tuning", []):
        scores = ", ".join(f"{_point_text(p)}: {'—' if v is None else f'{v:.4g}'}" for p, v in zip(t["points"], t["scores"]))
        mean = "geometric mean" if is_log(t["metric"]) else "mean"
        horizon = f" of {t['rounds']}-round runs" if t.get("rounds") else ""
        lines.append(f"{t['variant']}: selected {_point_text(t['selected'])} by the {mean} of {t['metric']} {t['at']}{horizon} over tuning seeds "
                     f"{', '.join(map(str, t['seeds']))}; every point: {scores}")
    return lines


def _provenance_text(record: Mapping[str, Any]) -> str:
    prov = record.get("provenance") or {}
    runs, seeds = prov.get("runs", {}), prov.get("seeds", [])
    text = f"computed {record.get('computed', '?')}"
    if runs:
        text += f" from {len(runs)} runs in {record['name']}/ (seeds {', '.join(map(str, seeds))}; config hashes in {STORE})"
    tuning = prov.get("tuning_runs") or {}
    if tuning:
        text += f"; tuning: {sum(tuning.values())} runs in {record['name']}.tuning/"
    seconds = record.get("seconds")
    if seconds:
        text += f"; running it took {_minutes(seconds['tuning'] + seconds['runs'])} (tuning {_minutes(seconds['tuning'])}, runs {_minutes(seconds['runs'])})"
    return text


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _time_line(store: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The wall time spent on the presets' tuning grids and runs (every call that built their folders, added up)."""
    timed = [r["seconds"] for r in store.values() if r.get("seconds")]
    if not timed:
        return []
    tuning, runs = sum(t["tuning"] for t in timed), sum(t["runs"] for t in timed)
    return ["", f"Wall time of {len(timed)} presets, every `reproduce` call that built their folders added up: {_minutes(tuning + runs)} "
                f"(tuning grids {_minutes(tuning)}, judged runs {_minutes(runs)})."]


def markdown(store: Mapping[str, Mapping[str, Any]]) -> str:
    """The report as Markdown: the primary claims' totals per paper, the other roles beside them, then per
    preset its provenance, deviations from the paper, tuning, claims (with an ordering's verdict at 25 / 50 /
    100 % of the run) and the methods' own per-round quantities."""
    rows = _all_rows(store)
    lines = ["# Reproduction of the papers' claims", "", "Totals of the primary claims (one per statement of the paper, on its setup):", "",
             "| paper | " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * len(COLUMNS)]
    for paper, c in counts(rows).items():
        lines.append(f"| {_cell(paper)} | " + " | ".join(str(c.get(v, 0)) for v in COLUMNS) + " |")
    others = other_roles(rows)
    if others:
        lines += ["", "Not in the totals: claims on a proxy, an extrapolation, duplicates and post-hoc readings.", "",
                  "| paper | role | " + " | ".join(COLUMNS) + " |", "| --- | --- |" + " ---: |" * len(COLUMNS)]
        for paper, roles in others.items():
            for role, c in roles.items():
                lines.append(f"| {_cell(paper)} | {role} | " + " | ".join(str(c.get(v, 0)) for v in COLUMNS) + " |")
    lines += _time_line(store)
    for record in store.values():
        lines += ["", f"## {record['name']}: {_cell(record.get('paper', ''))}, {_cell(record.get('figure', ''))}", "", _provenance_text(record) + "."]
        if record.get("deviations"):
            lines += ["", "Deviations from the paper:", ""] + [f"- {_cell(d)}" for d in record["deviations"]]
        tuning = _tuning_lines(record)
        if tuning:
            lines += ["", "Tuning (the paper's protocol):", ""] + [f"- {_cell(t)}" for t in tuning]
        lines += ["", "| role | figure | claim | measured | verdict | ordering at 25 / 50 / 100 % of the run |", "| --- | --- | --- | --- | --- | --- |"]
        for r in (ClaimResult(**c) for c in record["claims"]):
            claim = f"“{_cell(r.quote)}” — {_cell(r.claim)}"
            lines.append(f"| {r.role} | {_cell(r.figure)} | {claim} | {_cell(r.measured)} | **{r.verdict}**: {_cell(r.why)} | {_fractions_text(r)} |")
        if record.get("robustness"):
            lines += ["", "Verdict at every grid point (tuning seeds):", "", "| claim | point | verdict |", "| --- | --- | --- |"]
            lines += [f"| {_cell(b['claim'])} | {_cell(b['point'])} | {b['verdict']} |" for b in record["robustness"]]
        for d in (Diagnostic(**d) for d in record.get("diagnostics", [])):
            lines += ["", f"### {d.preset}, {_cell(d.variant)}: {d.metric} per round", "", f"{_cell(metrics.label(d.metric))}, mean over seeds.", "",
                      f"| round | {d.metric} |", "| ---: | ---: |"]
            lines += [f"| {d.rounds[k]} | {d.values[k]:.4g} |" for k in _shown_rows(len(d.rounds))]
    return "\n".join(lines) + "\n"


_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:13px}th{background:#f4f4f4}
.holds{background:#e3f6e3}.partly{background:#fff4d6}.does-not-hold{background:#fbe0e0}.not-run,.not-measured{background:#eee}
blockquote{margin:0;color:#444;font-style:italic}img{max-width:100%}.meta{color:#555}"""


def _totals_html(rows: Sequence[ClaimResult]) -> list[str]:
    e = html.escape
    parts = ["<p>Totals of the primary claims (one per statement of the paper, on its setup):</p><table><tr><th>paper</th>" + "".join(f"<th>{v}</th>" for v in COLUMNS) + "</tr>"]
    parts += [f"<tr><td>{e(paper)}</td>" + "".join(f"<td>{c.get(v, 0)}</td>" for v in COLUMNS) + "</tr>" for paper, c in counts(rows).items()]
    parts.append("</table>")
    others = other_roles(rows)
    if others:
        parts.append("<p>Not in the totals: claims on a proxy, an extrapolation, duplicates and post-hoc readings.</p><table><tr><th>paper</th><th>role</th>"
                     + "".join(f"<th>{v}</th>" for v in COLUMNS) + "</tr>")
        parts += [f"<tr><td>{e(paper)}</td><td>{role}</td>" + "".join(f"<td>{c.get(v, 0)}</td>" for v in COLUMNS) + "</tr>"
                  for paper, roles in others.items() for role, c in roles.items()]
        parts.append("</table>")
    return parts


def html_page(store: Mapping[str, Mapping[str, Any]], out: Path) -> str:
    """The report as one HTML page, the plots (``out/<preset>/plot.png``) inside it as base64 PNG."""
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Reproduction of the papers' claims</title><style>{_STYLE}</style></head><body>",
             "<h1>Reproduction of the papers' claims</h1>", *_totals_html(_all_rows(store)), *(f"<p>{html.escape(t)}</p>" for t in _time_line(store) if t)]
    for record in store.values():
        name = record["name"]
        parts.append(f"<h2 id='{e(name)}'>{e(name)}: {e(record.get('paper', ''))}, {e(record.get('figure', ''))}</h2><p class='meta'>{e(_provenance_text(record))}</p>")
        if record.get("deviations"):
            parts.append("<p>Deviations from the paper:</p><ul>" + "".join(f"<li>{e(d)}</li>" for d in record["deviations"]) + "</ul>")
        tuning = _tuning_lines(record)
        if tuning:
            parts.append("<p>Tuning (the paper's protocol):</p><ul>" + "".join(f"<li>{e(t)}</li>" for t in tuning) + "</ul>")
        parts.append("<table><tr><th>role</th><th>figure</th><th>claim</th><th>measured</th><th>verdict</th><th>ordering at 25 / 50 / 100 % of the run</th></tr>")
        for r in (ClaimResult(**c) for c in record["claims"]):
            parts.append(f"<tr class='{e(r.verdict.replace(' ', '-'))}'><td>{e(r.role)}</td><td>{e(r.figure)}</td><td><blockquote>“{e(r.quote)}”</blockquote>{e(r.claim)}</td>"
                         f"<td>{e(r.measured)}</td><td><b>{e(r.verdict)}</b>: {e(r.why)}</td><td>{e(_fractions_text(r))}</td></tr>")
        parts.append("</table>")
        if record.get("robustness"):
            parts.append("<p>Verdict at every grid point (tuning seeds):</p><table><tr><th>claim</th><th>point</th><th>verdict</th></tr>"
                         + "".join(f"<tr class='{e(str(b['verdict']).replace(' ', '-'))}'><td>{e(b['claim'])}</td><td>{e(b['point'])}</td><td>{e(b['verdict'])}</td></tr>" for b in record["robustness"])
                         + "</table>")
        for d in (Diagnostic(**d) for d in record.get("diagnostics", [])):
            shown = "".join(f"<tr><td>{d.rounds[k]}</td><td>{d.values[k]:.4g}</td></tr>" for k in _shown_rows(len(d.rounds)))
            parts.append(f"<h3>{e(d.preset)}, {e(d.variant)}: {e(d.metric)} per round (mean over seeds)</h3><table><tr><th>round</th><th>{e(d.metric)}</th></tr>{shown}</table>")
        plot = Path(out) / name / "plot.png" if record.get("plot") else None  # the preset's own folder, whatever the file says
        if plot is not None and plot.is_file():
            parts.append(f"<img alt='{e(name)}' src='data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_reports(store: Mapping[str, Mapping[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "report.md", markdown(store).encode())
    write_atomic(out / "report.html", html_page(store, out).encode())


def as_json(rows: Sequence[ClaimResult]) -> dict[str, Any]:
    """This call's claims, the primary claims' totals per paper, and the other roles' counts beside them."""
    return {"claims": [asdict(r) for r in rows], "counts": counts(rows), "other_roles": other_roles(rows)}
