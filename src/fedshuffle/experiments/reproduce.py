"""Reproduce presets and check their papers' claims: run what is missing, judge every claim, write the report.

Each preset runs into ``OUT/<name>`` as ``fedshuffle run`` would (a folder that holds its runs is
continued, one that holds another experiment is refused), then each of its claims
(:mod:`fedshuffle.experiments.claims`) is judged on the complete seeds. The report is one row per
claim — paper, figure, claim, measured, verdict and why — as ``OUT/report.md`` and a self-contained
``OUT/report.html`` (the plots embedded as base64 PNG).
"""

from __future__ import annotations

import base64
import html
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedshuffle import metrics
from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.core.io import write_atomic
from fedshuffle.experiments.claims import VERDICTS, parse_claims
from fedshuffle.experiments.folders import MANIFEST
from fedshuffle.experiments.schema import Experiment, load_experiment, preset_names

BUDGETS = ("cpu", "gpu")


@dataclass(frozen=True)
class ClaimResult:
    """One row of the report."""

    preset: str
    paper: str
    figure: str
    claim: str
    quote: str
    measured: str
    verdict: str
    why: str


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

    from fedshuffle.experiments.report import collect_runs, group_runs

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


def _skipped(name: str, experiment: Experiment, reason: str) -> list[ClaimResult]:
    meta = experiment.experiment
    claims = parse_claims(experiment.claims, [v.label for v in experiment.variants])
    return [ClaimResult(name, meta.paper, c.figure or meta.figure, c.describe(), c.quote, "—", "not run", reason) for c in claims]


def judge(name: str, experiment: Experiment, folder: Path) -> list[ClaimResult]:
    """Every claim of ``experiment`` on the complete runs stored in ``folder``."""
    from fedshuffle.experiments.report import collect_runs, group_runs

    meta = experiment.experiment
    claims = parse_claims(experiment.claims, [v.label for v in experiment.variants])
    groups = group_runs(collect_runs([folder]))
    runs = {label: [r.path / "metrics.csv" for r in members if r.status == "complete"] for label, members in groups.items()}
    rows = []
    for claim in claims:
        verdict = claim.evaluate(runs)
        rows.append(ClaimResult(name, meta.paper, claim.figure or meta.figure, claim.describe(), claim.quote, verdict.measured, verdict.verdict, verdict.why))
    return rows


def reproduce(presets: Sequence[str], out: Path, *, budget: str | None = None, run: bool = True, show_progress: bool = True, note: Any = None) -> list[ClaimResult]:
    """Run (or continue) each preset into ``out/<name>`` and judge its claims; a preset sized for
    another budget than ``budget`` is not run and its claims say so. With ``run=False`` nothing runs:
    the complete runs already in ``out`` are judged. Writes the reports into ``out``."""
    from fedshuffle.experiments.session import run_experiment

    if budget is not None and budget not in BUDGETS:
        raise ConfigError("--budget", f"unknown {budget!r}; accepted: {', '.join(BUDGETS)}")
    if not presets:
        raise ConfigError("presets", f"give at least one preset (or --all); presets: {', '.join(preset_names())}")
    loaded = [(p, load_experiment(p)) for p in presets]  # every config checked before anything runs
    rows: list[ClaimResult] = []
    plots: dict[str, Path] = {}
    extra: list[Diagnostic] = []
    for given, experiment in loaded:
        name = experiment.experiment.name
        sized = experiment.experiment.budget or "cpu"
        if budget == "cpu" and sized == "gpu":
            rows += _skipped(name, experiment, f"sized for a GPU (budget = gpu, about {experiment.experiment.expected_minutes or '?'} min there); run with --budget gpu")
            if note:
                note(f"{name}: skipped, sized for a GPU")
            continue
        folder = Path(out) / name
        if not run and not (folder / "summary.json").is_file():  # written once every run of the preset has ended
            rows += _skipped(name, experiment, f"no finished results in {folder} (judged without running)")
            continue
        if run:
            if note:
                note(f"{name}: {'continuing' if (folder / MANIFEST).is_file() else 'running'} in {folder}")
            run_experiment(experiment, folder, resume=(folder / MANIFEST).is_file(), show_progress=show_progress)
        rows += judge(name, experiment, folder)
        extra += diagnostics(name, folder)
        if (folder / "plot.png").is_file():
            plots[name] = folder / "plot.png"
    write_reports(rows, Path(out), plots, extra)
    return rows


def counts(rows: Sequence[ClaimResult]) -> dict[str, dict[str, int]]:
    """paper → verdict → number of claims."""
    out: dict[str, Counter] = {}
    for r in rows:
        out.setdefault(r.paper, Counter())[r.verdict] += 1
    return {paper: dict(c) for paper, c in out.items()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: Sequence[ClaimResult], extra: Sequence[Diagnostic] = ()) -> str:
    """The report as Markdown: verdict counts per paper, one row per claim, then the methods' own per-round quantities."""
    columns = (*VERDICTS, "not measured", "not run")
    lines = ["# Reproduction of the papers' claims", "", "| paper | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for paper, c in counts(rows).items():
        lines.append(f"| {_cell(paper)} | " + " | ".join(str(c.get(v, 0)) for v in columns) + " |")
    lines += ["", "| preset | paper | figure | claim | measured | verdict |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        claim = f"“{_cell(r.quote)}” — {_cell(r.claim)}"
        lines.append(f"| {r.preset} | {_cell(r.paper)} | {_cell(r.figure)} | {claim} | {_cell(r.measured)} | **{r.verdict}**: {_cell(r.why)} |")
    for d in extra:
        lines += ["", f"### {d.preset}, {_cell(d.variant)}: {d.metric} per round", "", f"{_cell(metrics.label(d.metric))}, mean over seeds.", "",
                  f"| round | {d.metric} |", "| ---: | ---: |"]
        lines += [f"| {d.rounds[k]} | {d.values[k]:.4g} |" for k in _shown_rows(len(d.rounds))]
    return "\n".join(lines) + "\n"


_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:13px}th{background:#f4f4f4}
.holds{background:#e3f6e3}.partly{background:#fff4d6}.does-not-hold{background:#fbe0e0}.not-run,.not-measured{background:#eee}
blockquote{margin:0;color:#444;font-style:italic}img{max-width:100%}"""


def html_page(rows: Sequence[ClaimResult], plots: dict[str, Path], extra: Sequence[Diagnostic] = ()) -> str:
    """The report as one HTML page, the plots inside it as base64 PNG."""
    e = html.escape
    columns = (*VERDICTS, "not measured", "not run")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Reproduction of the papers' claims</title><style>{_STYLE}</style></head><body>",
             "<h1>Reproduction of the papers' claims</h1><table><tr><th>paper</th>" + "".join(f"<th>{v}</th>" for v in columns) + "</tr>"]
    for paper, c in counts(rows).items():
        parts.append(f"<tr><td>{e(paper)}</td>" + "".join(f"<td>{c.get(v, 0)}</td>" for v in columns) + "</tr>")
    parts.append("</table><table><tr><th>preset</th><th>paper</th><th>figure</th><th>claim</th><th>measured</th><th>verdict</th></tr>")
    for r in rows:
        css = r.verdict.replace(" ", "-")
        parts.append(f"<tr class='{css}'><td><a href='#{e(r.preset)}'>{e(r.preset)}</a></td><td>{e(r.paper)}</td><td>{e(r.figure)}</td>"
                     f"<td><blockquote>“{e(r.quote)}”</blockquote>{e(r.claim)}</td><td>{e(r.measured)}</td><td><b>{e(r.verdict)}</b>: {e(r.why)}</td></tr>")
    parts.append("</table>")
    for d in extra:
        shown = "".join(f"<tr><td>{d.rounds[k]}</td><td>{d.values[k]:.4g}</td></tr>" for k in _shown_rows(len(d.rounds)))
        parts.append(f"<h3>{e(d.preset)}, {e(d.variant)}: {e(d.metric)} per round (mean over seeds)</h3><table><tr><th>round</th><th>{e(d.metric)}</th></tr>{shown}</table>")
    for name, path in plots.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h2 id='{e(name)}'>{e(name)}</h2><img alt='{e(name)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_reports(rows: Sequence[ClaimResult], out: Path, plots: dict[str, Path], extra: Sequence[Diagnostic] = ()) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "report.md", markdown(rows, extra).encode())
        write_atomic(out / "report.html", html_page(rows, plots, extra).encode())
    except OSError as exc:
        raise ResultsError(f"cannot write the report into {out} ({exc.strerror or exc}); the runs' results are kept") from None


def as_json(rows: Sequence[ClaimResult]) -> dict[str, Any]:
    return {"claims": [asdict(r) for r in rows], "counts": counts(rows)}
