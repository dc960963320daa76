"""The verdicts of a reproduce folder, kept in ``OUT/verdicts.json`` across calls and checked before every report.

A record per preset holds its claim rows (:class:`ClaimResult`), its tuning, its claims' verdicts at every grid
point, its methods' own per-round quantities, and what it was judged from: the claims as the experiment gave them
(``definition``) and the runs with their config hashes (``provenance``). A kept record is never taken as written
(:func:`recheck`): its claims are judged again from its definition on its runs, so a verdict edited by hand or copied
in never shows; a record whose folder is gone is dropped with a line; one whose runs changed since (another config
hash, a broken seal) or that was never judged on runs reads *not re-checked*; a malformed file is a one-line error
naming the field. Only primary claims enter a paper's totals (:func:`counts`); the other roles are counted beside them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import read_text, write_atomic
from fedshuffle.experiments.claims import (
    NOT_MEASURED,
    NOT_REPRODUCIBLE,
    ROLES,
    VERDICTS,
    Claim,
    Verdict,
    parse_claims,
)
from fedshuffle.experiments.folders import MANIFEST, read_manifest
from fedshuffle.experiments.report import collect_runs, group_runs

#: the store of every preset's verdicts in a reproduce folder
STORE = "verdicts.json"
NOT_RUN = "not run"
#: a kept verdict whose runs changed since it was judged, or that names no runs it could be judged again on
NOT_RECHECKED = "not re-checked"
#: every verdict a report row can carry, in the order the totals show them
COLUMNS = (*VERDICTS, NOT_MEASURED, NOT_REPRODUCIBLE, NOT_RUN, NOT_RECHECKED)


@dataclass(frozen=True)
class ClaimResult:
    """One row of the report. ``fractions``: an ordering's verdict as if the runs had stopped at 25 %, 50 %, 100 %;
    ``flips``: where its arms' mean curves change order; ``readings``: each reading's verdict, for a claim read two
    ways."""

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
    flips: str = ""
    readings: dict[str, str] = field(default_factory=dict)


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


# -- judging ---------------------------------------------------------------------------------------------------------


def definition(
    claims: Sequence[Mapping[str, Any]], labels: Sequence[str], paper: str, figure: str, not_reproducible: str = ""
) -> dict[str, Any]:
    """What a preset's claims are judged from, as kept in its record (the experiment's ``[[claims]]`` as given)."""
    return {
        "claims": [dict(c) for c in claims],
        "labels": list(labels),
        "paper": paper,
        "figure": figure,
        "not_reproducible": not_reproducible,
    }


def row(name: str, paper: str, figure: str, claim: Claim, verdict: Verdict) -> ClaimResult:
    """The report row of one judged claim."""
    return ClaimResult(
        name,
        paper,
        claim.figure or figure,
        claim.describe(),
        claim.quote,
        verdict.measured,
        verdict.verdict,
        verdict.why,
        claim.role,
        verdict.seeds,
        {f"{f:.0%}": v for f, v in verdict.fractions},
        verdict.flips,
        dict(verdict.readings),
    )


def judge_definition(name: str, spec: Mapping[str, Any], runs: Mapping[str, Sequence[Path]]) -> list[ClaimResult]:
    """Every claim of a :func:`definition` judged on ``runs`` (label → the complete seeds' ``metrics.csv``); an
    experiment whose paper data cannot be had reads *not reproducible* whatever its substitute measured."""
    rows = []
    unavailable = spec.get("not_reproducible", "")
    for claim in parse_claims(spec["claims"], spec["labels"]):
        verdict = claim.judge(runs)
        if unavailable:  # what the substitute setup measured is shown, but it is no evidence about the paper
            verdict = Verdict(
                verdict.measured,
                NOT_REPRODUCIBLE,
                f"{unavailable}; on the substitute it {verdict.verdict}: {verdict.why}",
                verdict.seeds,
                verdict.fractions,
                verdict.flips,
                verdict.readings,
            )
        rows.append(row(name, spec["paper"], spec["figure"], claim, verdict))
    return rows


def complete_runs(folder: Path) -> dict[str, list[Path]]:
    """label → the ``metrics.csv`` of the complete runs of the experiment stored in ``folder`` (not of folders nested
    in it)."""
    runs = [r for r in collect_runs([folder]) if r.experiment == Path(folder).resolve()]
    if not runs:
        return {}
    return {
        label: [r.path / "metrics.csv" for r in members if r.status == "complete"]
        for label, members in group_runs(runs).items()
    }


# -- the store -------------------------------------------------------------------------------------------------------

_TEXT = ("preset", "paper", "figure", "claim", "quote", "measured", "why", "flips")


def _check_row(where: str, raw: Any) -> ClaimResult:
    """A stored claim row, its types and vocabulary checked; errors name the row's field."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {f.name for f in fields(ClaimResult)})
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a field of a verdict")
    for name in _TEXT:
        if name in raw and not isinstance(raw[name], str):
            raise ValueError(f"{where}.{name}: expected text, got {raw[name]!r}")
    if raw.get("verdict") not in COLUMNS:
        raise ValueError(f"{where}.verdict: {raw.get('verdict')!r} is not a verdict; accepted: {', '.join(COLUMNS)}")
    if raw.get("role", "primary") not in ROLES:
        raise ValueError(f"{where}.role: {raw.get('role')!r} is not a role; accepted: {', '.join(ROLES)}")
    if not isinstance(raw.get("seeds", 0), int) or isinstance(raw.get("seeds"), bool):
        raise ValueError(f"{where}.seeds: expected a whole number, got {raw.get('seeds')!r}")
    for name in ("fractions", "readings"):
        value = raw.get(name, {})
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"{where}.{name}: expected an object of texts")
    try:
        return ClaimResult(**raw)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _check_record(key: str, record: Any) -> None:
    where = f"presets[{key!r}]"
    if not isinstance(record, dict) or record.get("name") != key:
        raise ValueError(f"{where}: expected an object whose name is {key!r}")
    for name in ("paper", "figure", "title", "computed"):
        if not isinstance(record.get(name, ""), str):
            raise ValueError(f"{where}.{name}: expected text, got {record[name]!r}")
    if not isinstance(record.get("claims"), list):
        raise ValueError(f"{where}.claims: expected a list of verdicts")
    for k, raw in enumerate(record["claims"]):
        _check_row(f"{where}.claims[{k}]", raw)
    for name in ("provenance", "definition"):
        if not isinstance(record.get(name) or {}, dict):
            raise ValueError(f"{where}.{name}: expected an object")
    runs = (record.get("provenance") or {}).get("runs", {})
    if not isinstance(runs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in runs.items()):
        raise ValueError(f"{where}.provenance.runs: expected run folder → config hash")
    for k, d in enumerate(record.get("diagnostics", [])):
        try:
            Diagnostic(**d)
        except TypeError as exc:
            raise ValueError(f"{where}.diagnostics[{k}]: {exc}") from None


def load(out: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float]]]:
    """The records and the seconds kept in ``out/verdicts.json`` (empty when there is none), every field checked: a
    malformed file is a one-line error naming the field."""
    path = Path(out) / STORE
    if not path.is_file():
        return {}, {}
    fresh = "; remove it to start the report afresh"
    try:
        doc = json.loads(read_text(path))  # a regular file only: never blocks on a FIFO
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(str(path), f"unreadable verdicts ({exc.__class__.__name__}: {exc}){fresh}") from None
    presets = doc.get("presets") if isinstance(doc, dict) else None
    if not isinstance(presets, dict):
        raise ConfigError(str(path), f"not a verdicts file (expected an object with 'presets'){fresh}")
    try:
        for key, record in presets.items():
            _check_record(key, record)
    except ValueError as exc:
        raise ConfigError(str(path), f"{exc}{fresh}") from None
    seconds = doc.get("seconds", {})
    if not isinstance(seconds, dict) or not all(
        isinstance(t, dict) and set(t) == {"tuning", "runs"} and all(isinstance(v, (int, float)) for v in t.values())
        for t in seconds.values()
    ):
        raise ConfigError(str(path), f"'seconds' is not preset → {{tuning, runs}} seconds{fresh}")
    return presets, seconds


def write(out: Path, store: Mapping[str, Any], seconds: Mapping[str, Any]) -> None:
    write_atomic(
        Path(out) / STORE, json.dumps({"format": 2, "presets": store, "seconds": seconds}, indent=1, ensure_ascii=False)
    )


# -- re-checking kept verdicts ---------------------------------------------------------------------------------------

#: verdicts a record may keep without runs to judge them on
WITHOUT_RUNS = (NOT_RUN, NOT_MEASURED)


def _unchecked(record: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """The record with every verdict that rests on runs marked :data:`NOT_RECHECKED`, saying why."""
    rows = []
    for raw in record["claims"]:
        r = ClaimResult(**raw)
        if r.verdict not in WITHOUT_RUNS:
            r = ClaimResult(**{**raw, "verdict": NOT_RECHECKED, "why": f"{reason}; it read {r.verdict}: {r.why}"})
        rows.append(r.__dict__)
    return {**record, "claims": rows}


def _changed(out: Path, name: str, recorded: Mapping[str, str]) -> str:
    """Why the runs a record names cannot be judged again as they were ('' when they can)."""
    folder = Path(out) / name
    try:
        manifest = read_manifest(folder) if (folder / MANIFEST).is_file() else None
    except ConfigError as exc:
        return exc.message
    if manifest is None:
        return f"{folder} holds no manifest of its runs"
    stored = manifest.get("runs", {})
    for where, digest in recorded.items():
        entry = stored.get(where.removeprefix(f"{name}/"))
        if not isinstance(entry, dict) or entry.get("config_hash") != digest:
            return f"the run {where} is gone or holds other settings than when it was judged"
    return ""


def recheck(
    out: Path, store: Mapping[str, Mapping[str, Any]], note: Callable[[str], None] | None = None
) -> dict[str, dict[str, Any]]:
    """Every record of ``store`` as its runs support it now: judged again from its definition on its complete runs;
    dropped, with a ``note``, when its folder is gone; verdicts that rest on runs marked :data:`NOT_RECHECKED` when
    the runs changed, cannot be read, the definition does not parse (a claim given twice), or the record names none."""
    checked = {}
    for name, record in store.items():
        runs = (record.get("provenance") or {}).get("runs") or {}
        spec = record.get("definition")
        if not runs:
            checked[name] = _unchecked(record, "it names no runs it was judged on")
            continue
        if not (Path(out) / name).is_dir():
            if note:
                note(f"{name}: dropped from the report, its runs ({Path(out) / name}) are gone")
            continue
        reason = _changed(out, name, runs) or (
            "" if spec else "it keeps no definition of its claims to judge them again"
        )
        if not reason:
            try:
                rows = judge_definition(name, spec, complete_runs(Path(out) / name))
            except ConfigError as exc:  # a run whose seal broke, a definition that no longer parses
                reason = f"{exc.field}: {exc.message}"
        if reason:
            checked[name] = _unchecked(record, f"not judged again: {reason}")
        else:
            checked[name] = {**record, "claims": [r.__dict__ for r in rows]}
    return checked


# -- totals ----------------------------------------------------------------------------------------------------------


def as_row(r: ClaimResult | Mapping[str, Any]) -> ClaimResult:
    return r if isinstance(r, ClaimResult) else ClaimResult(**r)


def counts(rows: Sequence[ClaimResult | Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """paper → verdict → number of *primary* claims (the paper's totals)."""
    out: dict[str, Counter] = {}
    for r in map(as_row, rows):
        out.setdefault(r.paper, Counter())
        if r.role == "primary":
            out[r.paper][r.verdict] += 1
    return {paper: dict(c) for paper, c in out.items()}


def other_roles(rows: Sequence[ClaimResult | Mapping[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """paper → role → verdict → number of the claims that are not primary (listed beside the totals)."""
    out: dict[str, dict[str, Counter]] = {}
    for r in map(as_row, rows):
        if r.role != "primary":
            out.setdefault(r.paper, {}).setdefault(r.role, Counter())[r.verdict] += 1
    return {
        paper: {role: dict(c) for role, c in sorted(roles.items(), key=lambda kv: ROLES.index(kv[0]))}
        for paper, roles in out.items()
    }


def all_rows(store: Mapping[str, Mapping[str, Any]]) -> list[ClaimResult]:
    return [ClaimResult(**r) for record in store.values() for r in record["claims"]]
