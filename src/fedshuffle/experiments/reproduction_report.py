"""The report of a reproduce folder: ``report.md`` and a self-contained ``report.html`` (plots embedded as base64 PNG).

It opens with the primary claims' totals per paper (a claim read two ways counts at its own reading, the other
reading's verdict beside it), the other roles beside them and the wall time; then, per preset, where its verdicts come
from, its deviations from the paper, its tuning, every claim (with an ordering's verdict at 25 / 50 / 100 % of the run
and the rounds where its arms change order), the verdicts at every grid point, and the methods' own per-round
quantities.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedshuffle import metrics
from fedshuffle.core.io import write_atomic
from fedshuffle.experiments.claims import FRACTIONS, is_log
from fedshuffle.experiments.verdicts import COLUMNS, STORE, ClaimResult, Diagnostic, all_rows, counts, other_roles

#: at most this many rounds of a diagnostic in the report (evenly spaced, the last one always)
DIAGNOSTIC_ROWS = 26
TOTALS = "Totals of the primary claims (the paper's statements on its setup, one per sentence and panel):"
OTHERS = "Not in the totals: reduced twins, ablations, proxies, extrapolations, duplicates and post-hoc readings."


def shown_rows(count: int) -> list[int]:
    """The rows of a long diagnostic to show: :data:`DIAGNOSTIC_ROWS` evenly spaced, the first and last among them."""
    if count <= DIAGNOSTIC_ROWS:
        return list(range(count))
    step = (count - 1) / (DIAGNOSTIC_ROWS - 1)
    return sorted({round(k * step) for k in range(DIAGNOSTIC_ROWS)})


def point_text(point: Mapping[str, Mapping[str, Any]] | None) -> str:
    """A grid point as ``section.key = value, …`` (— for none)."""
    return (
        ", ".join(
            f"{section}.{key} = {value}"
            for section, settings in (point or {}).items()
            for key, value in settings.items()
        )
        or "—"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def fractions_text(r: ClaimResult) -> str:
    """An ordering's verdicts at 25 / 50 / 100 % of the run, and where its arms change order."""
    text = " / ".join(r.fractions.get(f"{f:.0%}", "—") for f in FRACTIONS) if r.fractions else ""
    return f"{text}; {r.flips}" if r.flips else text


def verdict_text(r: ClaimResult) -> str:
    """The verdict and why, with each reading's verdict for a claim read two ways."""
    readings = "; ".join(f"{v} at {name}" for name, v in r.readings.items())
    return f"{r.verdict}" + (f" ({readings})" if readings else "") + f": {r.why}"


def _tuning_lines(record: Mapping[str, Any]) -> list[str]:
    lines = []
    for t in record.get("tuning", []):
        scores = ", ".join(
            f"{point_text(p)}: {'—' if v is None else f'{v:.4g}'}" for p, v in zip(t["points"], t["scores"])
        )
        mean = "geometric mean" if is_log(t["metric"]) else "mean"
        horizon = f" of {t['rounds']}-round runs" if t.get("rounds") else ""
        lines.append(
            f"{t['variant']}: selected {point_text(t['selected'])} by the {mean} of {t['metric']} {t['at']}"
            f"{horizon} over tuning seeds {', '.join(map(str, t['seeds']))}; every point: {scores}"
        )
    return lines


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _provenance_text(record: Mapping[str, Any]) -> str:
    prov = record.get("provenance") or {}
    runs, seeds = prov.get("runs", {}), prov.get("seeds", [])
    text = f"computed {record.get('computed', '?')}"
    if runs:
        text += (
            f" from {len(runs)} runs in {record['name']}/ (seeds {', '.join(map(str, seeds))}; config hashes in "
            f"{STORE}), judged again from them for this report"
        )
    tuning = prov.get("tuning_runs") or {}
    if tuning:
        text += f"; tuning: {sum(tuning.values())} runs in {record['name']}.tuning/"
    seconds = record.get("seconds")
    if seconds:
        text += (
            f"; running it took {_minutes(seconds['tuning'] + seconds['runs'])} (tuning "
            f"{_minutes(seconds['tuning'])}, runs {_minutes(seconds['runs'])})"
        )
    return text


def _time_line(store: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The wall time spent on the presets' tuning grids and runs (every call that built their folders, added up)."""
    timed = [r["seconds"] for r in store.values() if r.get("seconds")]
    if not timed:
        return []
    tuning, runs = sum(t["tuning"] for t in timed), sum(t["runs"] for t in timed)
    return [
        "",
        f"Wall time of {len(timed)} presets, every `reproduce` call that built their folders added up: "
        f"{_minutes(tuning + runs)} (tuning grids {_minutes(tuning)}, judged runs {_minutes(runs)}).",
    ]


def _totals(rows: Sequence[ClaimResult]) -> tuple[list[list[str]], list[list[str]]]:
    """The totals table's rows (paper, then a count per verdict; papers with no primary claim left out) and the other
    roles' (paper, role, counts)."""
    primary = [[paper, *(str(c.get(v, 0)) for v in COLUMNS)] for paper, c in counts(rows).items() if c]
    others = [
        [paper, role, *(str(c.get(v, 0)) for v in COLUMNS)]
        for paper, roles in other_roles(rows).items()
        for role, c in roles.items()
    ]
    return primary, others


def markdown(store: Mapping[str, Mapping[str, Any]]) -> str:
    """The report as Markdown (see the module docstring)."""
    primary, others = _totals(all_rows(store))
    lines = ["# Reproduction of the papers' claims", ""]
    if primary:
        lines += [TOTALS, "", "| paper | " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * len(COLUMNS)]
        lines += ["| " + " | ".join(map(_cell, r)) + " |" for r in primary]
    else:
        lines += ["No primary claims judged here: every claim below is one of the other roles."]
    if others:
        lines += [
            "",
            OTHERS,
            "",
            "| paper | role | " + " | ".join(COLUMNS) + " |",
            "| --- | --- |" + " ---: |" * len(COLUMNS),
        ]
        lines += ["| " + " | ".join(map(_cell, r)) + " |" for r in others]
    lines += _time_line(store)
    for record in store.values():
        lines += [
            "",
            f"## {record['name']}: {_cell(record.get('paper', ''))}, {_cell(record.get('figure', ''))}",
            "",
            _provenance_text(record) + ".",
        ]
        if record.get("deviations"):
            lines += ["", "Deviations from the paper:", ""] + [f"- {_cell(d)}" for d in record["deviations"]]
        tuning = _tuning_lines(record)
        if tuning:
            lines += ["", "Tuning (the paper's protocol):", ""] + [f"- {_cell(t)}" for t in tuning]
        lines += [
            "",
            "| role | figure | claim | measured | verdict | ordering at 25 / 50 / 100 % of the run |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in (ClaimResult(**c) for c in record["claims"]):
            claim = f"“{_cell(r.quote)}” — {_cell(r.claim)}"
            verdict = verdict_text(r).replace(r.verdict, f"**{r.verdict}**", 1)
            lines.append(
                f"| {r.role} | {_cell(r.figure)} | {claim} | {_cell(r.measured)} | {_cell(verdict)} | "
                f"{_cell(fractions_text(r))} |"
            )
        if record.get("robustness"):
            lines += [
                "",
                "Verdict at every grid point (tuning seeds):",
                "",
                "| claim | point | verdict |",
                "| --- | --- | --- |",
            ]
            lines += [f"| {_cell(b['claim'])} | {_cell(b['point'])} | {b['verdict']} |" for b in record["robustness"]]
        for d in (Diagnostic(**d) for d in record.get("diagnostics", [])):
            lines += [
                "",
                f"### {d.preset}, {_cell(d.variant)}: {d.metric} per round",
                "",
                f"{_cell(metrics.label(d.metric))}, mean over seeds.",
                "",
                f"| round | {d.metric} |",
                "| ---: | ---: |",
            ]
            lines += [f"| {d.rounds[k]} | {d.values[k]:.4g} |" for k in shown_rows(len(d.rounds))]
    return "\n".join(lines) + "\n"


_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:13px}th{background:#f4f4f4}
.holds{background:#e3f6e3}.partly{background:#fff4d6}.does-not-hold{background:#fbe0e0}
.not-run,.not-measured,.not-re-checked{background:#eee}
blockquote{margin:0;color:#444;font-style:italic}img{max-width:100%}.meta{color:#555}"""


def _table_html(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    e = html.escape
    return (
        "<table><tr>"
        + "".join(f"<th>{e(h)}</th>" for h in header)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
        + "</table>"
    )


def html_page(store: Mapping[str, Mapping[str, Any]], out: Path) -> str:
    """The report as one HTML page, the plots (``out/<preset>/plot.png``) inside it as base64 PNG."""
    e = html.escape
    primary, others = _totals(all_rows(store))
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>Reproduction of the papers' claims</title>"
        f"<style>{_STYLE}</style></head><body>",
        "<h1>Reproduction of the papers' claims</h1>",
    ]
    if primary:
        parts += [f"<p>{e(TOTALS)}</p>", _table_html(("paper", *COLUMNS), primary)]
    if others:
        parts += [f"<p>{e(OTHERS)}</p>", _table_html(("paper", "role", *COLUMNS), others)]
    parts += [f"<p>{e(t)}</p>" for t in _time_line(store) if t]
    for record in store.values():
        name = record["name"]
        parts.append(
            f"<h2 id='{e(name)}'>{e(name)}: {e(record.get('paper', ''))}, {e(record.get('figure', ''))}</h2>"
            f"<p class='meta'>{e(_provenance_text(record))}</p>"
        )
        if record.get("deviations"):
            parts.append(
                "<p>Deviations from the paper:</p><ul>"
                + "".join(f"<li>{e(d)}</li>" for d in record["deviations"])
                + "</ul>"
            )
        tuning = _tuning_lines(record)
        if tuning:
            parts.append(
                "<p>Tuning (the paper's protocol):</p><ul>" + "".join(f"<li>{e(t)}</li>" for t in tuning) + "</ul>"
            )
        parts.append(
            "<table><tr><th>role</th><th>figure</th><th>claim</th><th>measured</th><th>verdict</th>"
            "<th>ordering at 25 / 50 / 100 % of the run</th></tr>"
        )
        for r in (ClaimResult(**c) for c in record["claims"]):
            parts.append(
                f"<tr class='{e(r.verdict.replace(' ', '-'))}'><td>{e(r.role)}</td><td>{e(r.figure)}</td>"
                f"<td><blockquote>“{e(r.quote)}”</blockquote>{e(r.claim)}</td><td>{e(r.measured)}</td>"
                f"<td>{e(verdict_text(r))}</td><td>{e(fractions_text(r))}</td></tr>"
            )
        parts.append("</table>")
        if record.get("robustness"):
            parts.append(
                "<p>Verdict at every grid point (tuning seeds):</p>"
                + _table_html(
                    ("claim", "point", "verdict"),
                    [(b["claim"], b["point"], str(b["verdict"])) for b in record["robustness"]],
                )
            )
        for d in (Diagnostic(**d) for d in record.get("diagnostics", [])):
            shown = [(str(d.rounds[k]), f"{d.values[k]:.4g}") for k in shown_rows(len(d.rounds))]
            parts.append(
                f"<h3>{e(d.preset)}, {e(d.variant)}: {e(d.metric)} per round (mean over seeds)</h3>"
                + _table_html(("round", d.metric), shown)
            )
        plot = (
            Path(out) / name / "plot.png" if record.get("plot") else None
        )  # the preset's own folder, whatever the file says
        if plot is not None and plot.is_file():
            parts.append(
                f"<img alt='{e(name)}' src='data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()}'>"
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_reports(store: Mapping[str, Mapping[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "report.md", markdown(store).encode())
    write_atomic(out / "report.html", html_page(store, out).encode())
