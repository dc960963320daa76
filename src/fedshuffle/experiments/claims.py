"""The papers' claims, as data a preset carries and the tool checks.

A preset lists its claims as ``[[claims]]`` tables; each has a ``kind`` registered in :data:`CLAIMS`,
the paper's words (``quote``) and the figure or table they are about. Kinds:

* ``ordering``: variants ordered on a metric (``order``, best first; a tier ``["A", "B"]`` puts several
  on one rank), at the end of the run, at their best, at a budget (``at = "round=500"``,
  ``"epochs=10"``, ``"mib=5"``), on the mean over the last fraction of the run (``at = "last:0.25"``) or
  on the area under the curve (``at = "auc"``, the curve's mean over the rounds run); the verdict is
  also given as if the run had stopped at 25 % and 50 % of its rounds, so that a flip is visible;
* ``value``: a variant's metric within ``tolerance`` of ``value`` (or at most / at least it): the
  paper's reported number or a closed form;
* ``reaches_first``: ``first`` reaches a target (``"test_accuracy=0.95"``) with less rounds, MiB or
  seconds than ``second`` (optionally ``ratio`` times less);
* ``reaches``: a variant reaches a target with a cost (rounds, MiB, seconds) within ``tolerance`` of
  ``value``, or at most / at least it: the paper's rounds to a target.

A target that no arm of a claim reaches is *not measured*: the run says nothing about the order of
costs it never paid. Every verdict accounts for the seeds; errors that go to zero (f_gap, dist_sq,
grad_norm_sq) are compared by their log10 (geometric means), as the papers plot them, unless
``scale = "linear"``. With n ≥ 2 seeds per variant, a comparison of means m_A, m_B with standard
errors s = std/√n *holds* when the gap exceeds ``k`` standard errors of the difference,
k·√(s_A² + s_B²) (a value: when m ± k·s lies inside the interval); it holds *partly* when the means
are in the claimed order but not that far apart; else it *does not hold*. With a single seed there is
no standard error: the verdict compares the values and says so. A claim judged on fewer seeds than
its ``seeds`` (3 unless the paper states its count) says so in its verdict.

Each claim has a ``role`` (:data:`ROLES`): only ``primary`` claims count in a paper's totals.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from fedshuffle import metrics
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Registry
from fedshuffle.core.validation import validate
from fedshuffle.experiments.readings import At, valid_metric
from fedshuffle.experiments.results import read_metrics
from fedshuffle.experiments.targets import COLUMNS as TARGET_AXES, Target, time_to_target

CLAIMS = Registry("claims.kind")
VERDICTS = ("holds", "partly", "does not hold")
NOT_MEASURED = "not measured"
#: the verdict of a statement that cannot be reproduced as stated (the paper's data cannot be had, or its target is
#: beyond what the model can reach): what the runs measured is shown beside it, never "holds" or "does not hold"
NOT_REPRODUCIBLE = "not reproducible"
#: what a claim is to the paper. Only ``primary`` claims enter the paper's totals: the paper's statement on the paper's
#: setup, one per sentence and panel (no two presets hold the same one). The others are reported beside them:
#:
#: * ``reduced``: the statement on a cut-down twin of a paper-scale preset (fewer rounds, workers or a smaller model);
#: * ``ablation``: the statement with an arm under another rule than the primary comparison's (another theorem's step);
#: * ``proxy``: another metric or setting than the statement's (a training loss for a test-accuracy table);
#: * ``extrapolation``: a setup, or settings that decide the verdict (step sizes, arms, a horizon), the paper does not
#: give;
#: * ``duplicate``: a judgement made elsewhere again (a demonstration preset, a panel that is an exact multiple of
#: another);
#: * ``post_hoc``: a reading added after seeing the results.
ROLES = ("primary", "reduced", "ablation", "proxy", "extrapolation", "duplicate", "post_hoc")
#: the fields an alternative reading may change (``alternative`` of a claim)
ALTERNATIVE_FIELDS = ("metric", "reading", "order", "variant", "first", "second", "at", "scale")


#: the fractions of the run at which an ordering is judged again (the run as if it had stopped there)
FRACTIONS = (0.25, 0.5, 1.0)


@dataclass(frozen=True)
class Verdict:
    """What a claim measured, and whether it holds (one of :data:`VERDICTS`, ``not measured`` or
    ``not reproducible``) and why; ``seeds``: the fewest complete seeds of an arm; ``fractions``: an ordering's verdict
    at each of :data:`FRACTIONS`; ``flips``: where its arms' mean curves change order; ``readings``: the verdict of each
    reading of a claim read two ways (its own first)."""

    measured: str
    verdict: str
    why: str
    seeds: int = 0
    fractions: tuple[tuple[float, str], ...] = ()
    flips: str = ""
    readings: tuple[tuple[str, str], ...] = ()


#: metrics compared on a log scale by default: errors that go to zero, plotted on log axes (noise floors differ by
#: orders of magnitude)
LOG_METRICS = ("f_gap", "dist_sq", "grad_norm_sq")
TINY = 1e-300


@dataclass(frozen=True)
class Stat:
    """Mean and standard error of the mean over seeds (se is None for a single seed); with ``log``, of log10 of the
    values."""

    values: tuple[float, ...]
    log: bool = False

    @classmethod
    def of(cls, values: Sequence[float], log: bool = False) -> Stat:
        return cls(tuple(math.log10(max(v, TINY)) for v in values) if log else tuple(values), log)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def se(self) -> float | None:
        return float(np.std(self.values, ddof=1) / math.sqrt(self.n)) if self.n > 1 else None

    def text(self) -> str:
        if self.log:
            spread = f" ×/÷ {10**self.se:.3g}" if self.se is not None else ""
            return f"{10**self.mean:.4g}{spread} (geometric mean, n={self.n})"
        return f"{self.mean:.4g}" + (f" ± {self.se:.2g}" if self.se is not None else "") + f" (n={self.n})"


class Claim(BaseModel):
    """What every claim has: the paper's words, where they are, the metric, and the seeds' separation k."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _other: Claim | None = PrivateAttr(None)

    kind: str
    quote: str = Field(min_length=1, description="the paper's words, quoted")
    figure: str = Field("", description="figure or table the words are about (default: the experiment's)")
    metric: str
    k: float = Field(2.0, ge=0, description="standard errors the means must be apart to hold")
    scale: Literal["linear", "log"] | None = Field(
        None,
        description=("compare means of the values or of their log10 (default: log for f_gap, dist_sq, grad_norm_sq)"),
    )
    role: Literal[ROLES] = Field(
        "primary",
        description=(
            "primary claims enter the paper's totals; the other roles (reduced, ablation, proxy, extrapolation, "
            "duplicate, "
            "post_hoc) are listed beside them"
        ),
    )
    seeds: int = Field(
        3,
        ge=1,
        description=(
            "seeds the protocol judges on (the paper's count where it states one); a verdict on fewer says so"
        ),
    )
    reading: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "variant → the metric read for it instead of `metric`: the evaluation point a paper reports that method "
            "at; "
            "same direction and scale as `metric`"
        ),
    )
    reads: str = Field(
        "",
        description=(
            "what this reading reads (e.g. 'the global model'): named beside an alternative reading's verdict"
        ),
    )
    alternative: dict[str, Any] | None = Field(
        None,
        description=(
            "another defensible reading of the same sentence: {name = '…', and the fields it changes: "
            f"{', '.join(ALTERNATIVE_FIELDS)}}}; judged and reported beside this one; the claim's verdict "
            "is its own reading's"
        ),
    )
    not_reproducible: str = Field(
        "",
        description=(
            "why the statement cannot be reproduced as stated (a target beyond what the model can reach); the "
            "verdict is "
            "'not reproducible', with the best value the runs reached beside it"
        ),
    )

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        return valid_metric(v)

    @model_validator(mode="after")
    def _readings(self) -> Claim:
        for label, name in self.reading.items():
            if label not in self.variants():
                compared = ", ".join(map(repr, self.variants()))
                raise ValueError(f"reading names {label!r}, which the claim does not compare; it compares: {compared}")
            valid_metric(name)
            same_direction = metrics.METRICS[name].defaults["better"] == metrics.METRICS[self.metric].defaults["better"]
            if not same_direction or is_log(name, self.scale) != self.log:
                raise ValueError(
                    f"reading[{label!r}] = {name!r} is not read like {self.metric!r} "
                    "(better direction and scale must match)"
                )
        return self

    @model_validator(mode="after")
    def _alternative_reading(self) -> Claim:
        if self.alternative is None:
            return self
        changes = dict(self.alternative)
        name = changes.pop("name", None)
        if not isinstance(name, str) or not name:
            raise ValueError("alternative needs a name: what it reads (e.g. name = 'the clients' own models')")
        unknown = sorted(set(changes) - set(ALTERNATIVE_FIELDS))
        if unknown:
            raise ValueError(f"alternative cannot change {unknown[0]!r}; it changes: {', '.join(ALTERNATIVE_FIELDS)}")
        if not self.reads:
            raise ValueError("a claim with an alternative reading names its own: reads = '…' (e.g. 'the global model')")
        derived = {"metric"} if self.kind in ("reaches", "reaches_first") else set()  # set from the target
        base = self.model_dump(exclude={"alternative", "reads", *derived}, exclude_defaults=True)
        self._other = type(self).model_validate({**base, "kind": self.kind, **changes, "reads": name})
        return self

    @property
    def other(self) -> Claim | None:
        """The alternative reading, as a claim of the same kind (None when the claim has one reading)."""
        return self._other

    def metric_of(self, label: str) -> str:
        """The metric read for variant ``label``."""
        return self.reading.get(label, self.metric)

    def variants(self) -> list[str]:
        """The variant labels the claim names (checked against the experiment's)."""
        return []

    def all_variants(self) -> list[str]:
        """The variants of this reading and of the alternative's."""
        extra = self.other.variants() if self.other is not None else []
        return list(dict.fromkeys([*self.variants(), *extra]))

    def describe(self) -> str:
        raise NotImplementedError

    def evaluate(self, runs: Mapping[str, Sequence[Path]]) -> Verdict:
        """The verdict on the complete seeds' ``metrics.csv`` of each variant."""
        raise NotImplementedError

    def judge(self, runs: Mapping[str, Sequence[Path]]) -> Verdict:
        """:meth:`evaluate`, with the seeds it was judged on (said in ``why`` when fewer than ``seeds``); a claim
        read two ways gets both verdicts (:func:`combine`), one not reproducible as stated reads so with its ceiling."""
        verdict = self._judged(runs)
        if self.other is not None:
            verdict = combine(verdict, self.other._judged(runs), self.reads, self.other.reads)
        if self.not_reproducible:
            ceiling = self.ceiling(runs)
            verdict = Verdict(
                f"{verdict.measured}; {ceiling}" if ceiling else verdict.measured,
                NOT_REPRODUCIBLE,
                f"as stated: {self.not_reproducible}; on these runs it {verdict.verdict}: {verdict.why}",
                verdict.seeds,
                verdict.fractions,
                verdict.flips,
                verdict.readings,
            )
        return verdict

    def _judged(self, runs: Mapping[str, Sequence[Path]]) -> Verdict:
        verdict = self.evaluate(runs)
        seeds = min((len(runs.get(label, [])) for label in self.variants()), default=0)
        why = verdict.why
        if 0 < seeds < self.seeds and verdict.verdict != NOT_MEASURED:
            why = (
                f"judged on {seeds} seed{'s' if seeds > 1 else ''}, fewer than the {self.seeds} the protocol asks "
                f"for; {why}"
            )
        return Verdict(verdict.measured, verdict.verdict, why, seeds, verdict.fractions, verdict.flips)

    def ceiling(self, runs: Mapping[str, Sequence[Path]]) -> str:
        """The best value of the claim's metric each variant reached in its runs (mean over seeds): what the runs can
        say about a statement that cannot be reproduced as stated."""
        parts = []
        for label in self.variants():
            name = self.metric_of(label)
            lower = metrics.METRICS[name].defaults["better"] == "min"
            best = [_value_at(read_metrics(f), name, "best", lower) for f in runs.get(label, [])]
            best = [b for b in best if b is not None]
            if best:
                parts.append(f"{label}: {Stat(tuple(best)).text()}")
        return f"best {self.metric} reached: " + "; ".join(parts) if parts else ""

    @property
    def log(self) -> bool:
        return is_log(self.metric, self.scale) and not reads_rounds(getattr(self, "at", ""))

    @property
    def lower_is_better(self) -> bool:
        return reads_rounds(getattr(self, "at", "")) or metrics.METRICS[self.metric].defaults["better"] == "min"


def combine(own: Verdict, other: Verdict, own_name: str, other_name: str) -> Verdict:
    """One claim read two ways: the verdict is its own reading's (the paper's stated objective), whatever the
    alternative's; both readings' verdicts are kept (``readings``) and named in ``why``, so a failure at the paper's
    objective is reported as a failure, with what the other reading shows beside it."""
    a, b = own.verdict, other.verdict
    measured = f"at {own_name}: {own.measured} — at {other_name}: {other.measured}"
    readings = ((own_name, a), (other_name, b))
    why = f"{a} at {own_name} ({own.why}); {b} at {other_name} ({other.why})"
    return Verdict(
        measured,
        a,
        why,
        min(own.seeds, other.seeds) or max(own.seeds, other.seeds),
        own.fractions,
        own.flips,
        readings,
    )


def _truncated(table: Mapping[str, np.ndarray], fraction: float) -> dict[str, np.ndarray]:
    """The rows of a run as if it had stopped at ``fraction`` of its last evaluated round (none when that
    leaves only the starting evaluation, where every variant is alike)."""
    rounds = table["round"]
    if fraction >= 1 or not rounds.size:
        return dict(table)
    keep = rounds <= fraction * rounds[-1] + 1e-9
    if not (rounds[keep] > rounds[0]).any():  # nothing evaluated after the start: no reading of the cut run
        keep[:] = False
    return {name: column[keep] for name, column in table.items()}


def _window_mean(rounds: np.ndarray, column: np.ndarray, at: str, log: bool) -> float:
    """``last:F``: the mean over the evaluations in the last fraction F of the run (rounds ≥ (1 − F)·R);
    ``auc``: the area under the curve over the rounds run, divided by their span (trapezoidal rule).
    With ``log``, of log10 of the values (a geometric mean, returned as a value)."""
    finite = np.isfinite(column) & (column > 0 if log else True)
    if not finite.all():  # a diverged evaluation inside the window: no mean to report
        return np.nan
    values = np.log10(column) if log else column
    if at == "auc":
        span = rounds[-1] - rounds[0]
        mean = float(np.sum(np.diff(rounds) * (values[1:] + values[:-1]) / 2) / span) if span > 0 else float(values[-1])
    else:
        fraction = float(at.removeprefix("last:"))
        mean = float(values[rounds >= (1 - fraction) * rounds[-1] - 1e-9].mean())
    return 10**mean if log else mean


def _value_at(
    table: Mapping[str, np.ndarray], metric: str, at: str, lower_is_better: bool, log: bool = False
) -> float | None:
    """The metric at the end of the run, its best, its mean over the last fraction or the whole run
    (:func:`_window_mean`), or at the first evaluation at or past a budget."""
    column = table[metric]
    if reads_rounds(at):
        return _rounds_to_progress(table["round"], column, float(at.removeprefix("progress:")), lower_is_better)
    if at == "auc" or at.startswith("last:"):
        rows = np.flatnonzero(~np.isnan(column))
        value = _window_mean(table["round"][rows], column[rows], at, log) if rows.size else np.nan
    elif at == "final":
        value = column[-1] if column.size else np.nan
    elif at == "best":
        finite = column[np.isfinite(column)]
        value = (finite.min() if lower_is_better else finite.max()) if finite.size else np.nan
    else:
        axis, _, number = at.partition("=")
        spent = table["mib_up"] + table["mib_down"] if axis == "mib" else table[axis]
        hits = np.flatnonzero(spent >= float(number) - 1e-12)
        value = column[hits[0]] if hits.size else np.nan
    return float(value) if np.isfinite(value) else None


def reads_rounds(at: str) -> bool:
    """Whether a place reads a speed in rounds (``progress:F``) rather than a level of the metric."""
    return at.startswith("progress:")


#: the part of the run whose mean is the level a curve has settled at, for ``progress:F``
SETTLED = 0.25


def _rounds_to_progress(rounds: np.ndarray, column: np.ndarray, fraction: float, lower_is_better: bool) -> float | None:
    """``progress:F``: the first evaluated round by which the curve has made the fraction F of its own improvement, from
    its first evaluation v₀ to the level it settles at (the mean over its last :data:`SETTLED` of the run):
    the first t with s·(v₀ − v_t) ≥ F·s·(v₀ − v_end), s = +1 where lower is better, −1 otherwise. A speed that does not
    depend on the level, so that runs on different data (whose best losses differ) can be compared; None when the
    curve does not improve, or a value is missing."""
    rows = np.flatnonzero(~np.isnan(column))
    if rows.size < 2 or not np.isfinite(column[rows]).all():
        return None
    rounds, values = rounds[rows], column[rows]
    sign = 1.0 if lower_is_better else -1.0
    settled = float(values[rounds >= (1 - SETTLED) * rounds[-1] - 1e-9].mean())
    total = sign * (values[0] - settled)
    if not total > 0:
        return None
    hits = np.flatnonzero(sign * (values[0] - values) >= fraction * total - 1e-12 * abs(total))
    return float(rounds[hits[0]])


def is_log(metric: str, scale: str | None = None) -> bool:
    """Whether a metric is compared by its log10 (errors that go to zero, unless ``scale`` says otherwise)."""
    return scale == "log" if scale is not None else metric in LOG_METRICS


def score(files: Sequence[Path], metric: str, at: str) -> Stat | None:
    """``metric`` read ``at`` a point of each run, over the runs (log10 for :data:`LOG_METRICS`); None
    when a run has no value there (diverged, or shorter than the budget): a tuning point with a failed seed never
    wins."""
    lower = metrics.METRICS[metric].defaults["better"] == "min"
    log = is_log(metric) and not reads_rounds(at)
    values = [_value_at(read_metrics(f), metric, at, lower, log) for f in files]
    return Stat.of(values, log) if values and all(v is not None for v in values) else None


def _stat_of(files: Sequence[Path], claim: Claim, at: str, fraction: float = 1.0, label: str = "") -> Stat | None:
    """The statistic of variant ``label``'s metric over the seeds that have a value (None when none has), on the
    runs cut at ``fraction``."""
    name = claim.metric_of(label)
    lower = (
        metrics.METRICS[name].defaults["better"] == "min"
    )  # the metric's own direction: progress:F reads rounds of it
    values = [_value_at(_truncated(read_metrics(f), fraction), name, at, lower, claim.log) for f in files]
    present = [v for v in values if v is not None]
    return Stat.of(present, claim.log) if present else None


def _mean_curve(files: Sequence[Path], metric: str, log: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """The mean over the runs of a metric at the rounds every run evaluated (of log10 with ``log``), or None."""
    tables = [read_metrics(f) for f in files]
    rows = [(t["round"][~np.isnan(t[metric])], t[metric][~np.isnan(t[metric])]) for t in tables]
    if not rows:
        return None
    common = rows[0][0]
    for rounds, _ in rows[1:]:
        common = np.intersect1d(common, rounds)
    if not common.size:
        return None
    values = [np.log10(np.maximum(v, TINY)) if log else v for _, v in rows]
    return common, np.mean([v[np.searchsorted(r, common)] for (r, _), v in zip(rows, values)], axis=0)


def _at_rounds(curve: tuple[np.ndarray, np.ndarray], rounds: np.ndarray) -> np.ndarray:
    return curve[1][np.searchsorted(curve[0], rounds)]


def compare(better: Stat, worse: Stat, k: float, lower_is_better: bool, ratio: float = 1.0) -> str:
    """``separated``, ``ordered`` (right order, within k standard errors) or ``reversed``.

    The gap is m_worse − ratio·m_better (lower is better; the mirror image otherwise), its standard
    error √(s_worse² + ratio²·s_better²); a single seed on either side is never ``separated``. With
    ``ratio`` ≠ 1 the claim is "at least ratio times", so a gap of exactly zero (to rounding) is in
    order, and separated when the seeds do not spread (SCAFFOLD's exactly doubled bytes per round).
    """
    gap = (1.0 if lower_is_better else -1.0) * (worse.mean - ratio * better.mean)
    at_least = ratio != 1.0
    rounding = 1e-9 * abs(ratio * better.mean) if at_least else 0.0
    if not (gap > 0 or (at_least and gap >= -rounding)):
        return "reversed"
    if better.se is None or worse.se is None:
        return "ordered"
    se = math.hypot(worse.se, ratio * better.se)
    return "separated" if gap > k * se or (at_least and se == 0) else "ordered"


def _interval(value: float, tolerance: float, relative: bool, bound: str) -> tuple[float, float]:
    """[value − tol, value + tol] (tol relative to |value| when ``relative``), open on one side for at_most /
    at_least."""
    tol = tolerance * abs(value) if relative else tolerance
    return (-math.inf if bound == "at_most" else value - tol, math.inf if bound == "at_least" else value + tol)


def _valid_target(v: str) -> str:
    try:
        Target.parse(v)
    except ConfigError as exc:
        raise ValueError(exc.message) from None
    return v


def _single(*stats: Stat) -> bool:
    return any(s.n < 2 for s in stats)


SINGLE = "single seed, no standard error: judged on the values alone"


def _at_text(at: str) -> str:
    if reads_rounds(at):
        return (
            f"rounds to {float(at.removeprefix('progress:')):.0%} of its own improvement (to its last {SETTLED:.0%}),"
        )
    if at.startswith("last:"):
        return f"mean over the last {float(at.removeprefix('last:')):.0%} of the run,"
    if at == "auc":
        return "area under the curve (mean over the run),"
    return at if at in ("final", "best") else f"at {at.replace('=', ' ')}"


class OrderingClaim(Claim):
    kind: Literal["ordering"] = "ordering"
    order: list[str | list[str]] = Field(min_length=2, description="variants best first; a list is a tier of equals")
    at: At = Field(
        "final",
        description="final, best, last:F (mean over the last fraction F of the run), auc, round=N, epochs=X or mib=X",
    )

    @field_validator("order")
    @classmethod
    def _tiers(cls, v: list[str | list[str]]) -> list[str | list[str]]:
        if any(isinstance(t, list) and not t for t in v):
            raise ValueError("a tier is a non-empty list of variant labels")
        return v

    def tiers(self) -> list[list[str]]:
        return [t if isinstance(t, list) else [t] for t in self.order]

    def variants(self) -> list[str]:
        return [v for tier in self.tiers() for v in tier]

    def describe(self) -> str:
        sign = " < " if self.lower_is_better else " > "
        read = "".join(f" ({label}: {name})" for label, name in self.reading.items())
        return f"{_at_text(self.at)} {self.metric}{read}: " + sign.join(
            t[0] if len(t) == 1 else "{" + ", ".join(t) + "}" for t in self.tiers()
        )

    def evaluate(self, runs: Mapping[str, Sequence[Path]]) -> Verdict:
        """The verdict on the whole runs, with the verdicts as if the runs had stopped at each of :data:`FRACTIONS`,
        and the rounds where the arms' mean curves change order (:meth:`flips`)."""
        verdict = self.evaluate_at(runs, 1.0)
        fractions = tuple((f, verdict.verdict if f == 1.0 else self.evaluate_at(runs, f).verdict) for f in FRACTIONS)
        return Verdict(verdict.measured, verdict.verdict, verdict.why, fractions=fractions, flips=self.flips(runs))

    def flips(self, runs: Mapping[str, Sequence[Path]]) -> str:
        """Where the order of each claimed pair changes along the run: the evaluated rounds at which the mean curves
        over the seeds (of log10 for errors that go to zero) cross, after the start where every arm is alike. Empty
        when no pair crosses; a reading that depends on the horizon shows here where it would flip."""
        if reads_rounds(self.at):
            return ""
        curves = {label: _mean_curve(runs.get(label, []), self.metric_of(label), self.log) for label in self.variants()}
        sign = 1.0 if self.lower_is_better else -1.0
        parts = []
        for up, down in zip(self.tiers(), self.tiers()[1:]):
            for a, b in ((a, b) for a in up for b in down):
                if curves[a] is None or curves[b] is None:
                    continue
                rounds = np.intersect1d(curves[a][0], curves[b][0])
                rounds = rounds[rounds > rounds.min()] if rounds.size else rounds
                gap = sign * (
                    _at_rounds(curves[b], rounds) - _at_rounds(curves[a], rounds)
                )  # > 0: in the claimed order
                order = np.sign(gap[gap != 0])
                where = rounds[gap != 0][1:][np.diff(order) != 0] if order.size > 1 else np.array([])
                if where.size:
                    shown = ", ".join(f"{r:g}" for r in where[:4]) + (
                        f" and {where.size - 4} more" if where.size > 4 else ""
                    )
                    final = "in the claimed order" if order[-1] > 0 else "reversed"
                    parts.append(f"{a} vs {b}: the order changes at round {shown} ({final} at the end)")
        return "; ".join(parts)

    def evaluate_at(self, runs: Mapping[str, Sequence[Path]], fraction: float) -> Verdict:
        """The verdict on the runs cut at ``fraction`` of their rounds."""
        stats, missing = {}, []
        for label in self.variants():
            stat = _stat_of(runs.get(label, []), self, self.at, fraction, label)
            if stat is None:
                missing.append(label)
            else:
                stats[label] = stat
        measured = "; ".join(f"{label}: {s.text()}" for label, s in stats.items())
        if missing:
            return Verdict(
                measured,
                "not measured",
                f"no value {_at_text(self.at)} for {', '.join(missing)} (not run, or the run is shorter than the "
                "budget)",
            )
        tiers = self.tiers()
        results = [
            (a, b, compare(stats[a], stats[b], self.k, self.lower_is_better))
            for up, down in zip(tiers, tiers[1:])
            for a in up
            for b in down
        ]
        wrong = [f"{b} is not worse than {a}" for a, b, r in results if r == "reversed"]
        close = [f"{a} vs {b}" for a, b, r in results if r == "ordered"]
        single = _single(*stats.values())
        if wrong:
            return Verdict(measured, "does not hold", "; ".join(wrong))
        if single:
            return Verdict(measured, "holds", f"{SINGLE}; the means are in the claimed order")
        if close:
            return Verdict(
                measured, "partly", f"in the claimed order, but within {self.k:g} standard errors: {', '.join(close)}"
            )
        return Verdict(measured, "holds", f"every step of the order separated by more than {self.k:g} standard errors")


class ValueClaim(Claim):
    kind: Literal["value"] = "value"
    variant: str
    at: At = Field("final", description="final, best, last:F, auc, round=N, epochs=X or mib=X")
    value: float
    tolerance: float = Field(0.0, ge=0, description="absolute, or relative to |value| with relative = true")
    relative: bool = False
    bound: Literal["within", "at_most", "at_least"] = Field(
        "within", description="value ± tolerance, or ≤ / ≥ value (+/− tolerance)"
    )

    def variants(self) -> list[str]:
        return [self.variant]

    def interval(self) -> tuple[float, float]:
        return _interval(self.value, self.tolerance, self.relative, self.bound)

    def describe(self) -> str:
        lo, hi = self.interval()
        where = (
            f"≤ {hi:.4g}"
            if self.bound == "at_most"
            else f"≥ {lo:.4g}"
            if self.bound == "at_least"
            else f"in [{lo:.4g}, {hi:.4g}]"
        )
        return f"{self.variant}: {_at_text(self.at)} {self.metric} {where}"

    def evaluate(self, runs: Mapping[str, Sequence[Path]]) -> Verdict:
        stat = _stat_of(runs.get(self.variant, []), self, self.at, label=self.variant)
        if stat is None:
            return Verdict("—", "not measured", f"no value {_at_text(self.at)} for {self.variant}")
        lo, hi = self.interval()
        measured = f"{self.variant}: {stat.text()}"
        t_lo, t_hi = (
            (math.log10(lo) if lo > 0 else -math.inf, math.log10(hi) if hi > 0 else -math.inf) if stat.log else (lo, hi)
        )
        shown = 10**stat.mean if stat.log else stat.mean
        return _inside(measured, stat, self.k, (t_lo, t_hi), shown, (lo, hi))


def _inside(
    measured: str,
    stat: Stat,
    k: float,
    bounds: tuple[float, float],
    shown: float,
    shown_bounds: tuple[float, float],
    missed: str = "",
) -> Verdict:
    """The verdict on a mean that should lie in ``bounds`` (on the statistic's scale; ``shown`` and ``shown_bounds``
    are the same as printed): holds when mean ± k standard errors is inside, partly when only the mean is (or when
    ``missed`` says some seeds gave no value), does not hold otherwise."""
    (t_lo, t_hi), (lo, hi) = bounds, shown_bounds
    if not t_lo <= stat.mean <= t_hi:
        return Verdict(measured, "does not hold", f"mean {shown:.4g} outside [{lo:.4g}, {hi:.4g}]{missed}")
    if missed:
        return Verdict(measured, "partly", f"mean inside [{lo:.4g}, {hi:.4g}]{missed}")
    if stat.se is None:
        return Verdict(measured, "holds", f"{SINGLE}; inside [{lo:.4g}, {hi:.4g}]")
    if t_lo <= stat.mean - k * stat.se and stat.mean + k * stat.se <= t_hi:
        return Verdict(measured, "holds", f"mean ± {k:g} standard errors inside [{lo:.4g}, {hi:.4g}]")
    return Verdict(measured, "partly", f"mean inside [{lo:.4g}, {hi:.4g}], but not {k:g} standard errors from its edge")


class ReachesFirstClaim(Claim):
    kind: Literal["reaches_first"] = "reaches_first"
    metric: str = ""
    first: str
    second: str
    target: str = Field(description="METRIC=VALUE, e.g. test_accuracy=0.95")
    by: Literal[TARGET_AXES] = Field(
        "round", description="the cost: round, mib (per worker, up + down), wallclock_seconds or compute_seconds"
    )
    ratio: float = Field(
        1.0, gt=0, description="the second needs at least ratio times the first's cost (with ratio = 1: strictly more)"
    )

    @field_validator("target")
    @classmethod
    def _target(cls, v: str) -> str:
        return _valid_target(v)

    def model_post_init(self, _: Any) -> None:
        self.metric = Target.parse(self.target).metric

    def variants(self) -> list[str]:
        return [self.first, self.second]

    def describe(self) -> str:
        times = f" {self.ratio:g}× " if self.ratio != 1 else " "
        return f"{self.first} reaches {self.target} with{times}less {self.by} than {self.second}"

    def evaluate(self, runs: Mapping[str, Sequence[Path]]) -> Verdict:
        target = Target.parse(self.target)
        costs = {}
        for label in (self.first, self.second):
            files = runs.get(label, [])
            costs[label] = [h[self.by] if h is not None else math.inf for h in time_to_target(files, target)]
        a, b = costs[self.first], costs[self.second]
        if not a or not b:
            return Verdict("—", "not measured", f"no complete run of {self.first if not a else self.second}")

        def text(label: str, values: list[float]) -> str:
            reached = [v for v in values if math.isfinite(v)]
            return (
                f"{label}: "
                + (Stat(tuple(reached)).text() if reached else "—")
                + f", reached in {len(reached)} of {len(values)}"
            )

        measured = f"{self.by} to {self.target}: {text(self.first, a)}; {text(self.second, b)}"
        reached_a, reached_b = [v for v in a if math.isfinite(v)], [v for v in b if math.isfinite(v)]
        if not reached_a and not reached_b:
            return Verdict(
                measured,
                "not measured",
                f"neither {self.first} nor {self.second} reached {self.target} in any seed: the runs do not order "
                "their costs",
            )
        if not reached_a:
            return Verdict(measured, "does not hold", f"{self.first} never reached {self.target}; {self.second} did")
        if not reached_b:
            if len(reached_a) < len(a):
                return Verdict(
                    measured,
                    "partly",
                    f"{self.second} never reached it; {self.first} only in {len(reached_a)} of {len(a)} seeds",
                )
            return Verdict(measured, "holds", (f"{SINGLE}; " if len(a) < 2 else "") + f"{self.second} never reached it")
        result = compare(Stat(tuple(reached_a)), Stat(tuple(reached_b)), self.k, True, self.ratio)
        factor = f"{self.ratio:g}× " if self.ratio != 1 else ""
        if result == "reversed":
            return Verdict(
                measured, "does not hold", f"{self.second} needs no more than {factor}the {self.by} of {self.first}"
            )
        if len(reached_a) < len(a) or len(reached_b) < len(b):
            return Verdict(measured, "partly", "in the claimed order where both reached it, but not every seed did")
        if _single(Stat(tuple(reached_a)), Stat(tuple(reached_b))):
            return Verdict(
                measured,
                "holds",
                f"{SINGLE}; {self.first} needs less than {factor}that of {self.second}".replace("than that", "than"),
            )
        if result == "ordered":
            return Verdict(measured, "partly", f"in the claimed order, but within {self.k:g} standard errors")
        return Verdict(measured, "holds", f"separated by more than {self.k:g} standard errors")


class ReachesClaim(Claim):
    kind: Literal["reaches"] = "reaches"
    metric: str = ""
    variant: str
    target: str = Field(description="METRIC=VALUE, e.g. test_accuracy=0.95")
    by: Literal[TARGET_AXES] = Field(
        "round", description="the cost: round, mib (per worker, up + down), wallclock_seconds or compute_seconds"
    )
    value: float = Field(ge=0, description="the paper's cost to the target")
    tolerance: float = Field(0.0, ge=0, description="absolute, or relative to value with relative = true")
    relative: bool = False
    bound: Literal["within", "at_most", "at_least"] = Field(
        "within", description="value ± tolerance, or ≤ / ≥ value (+/− tolerance)"
    )

    @field_validator("target")
    @classmethod
    def _target(cls, v: str) -> str:
        return _valid_target(v)

    def interval(self) -> tuple[float, float]:
        return _interval(self.value, self.tolerance, self.relative, self.bound)

    def model_post_init(self, _: Any) -> None:
        self.metric = Target.parse(self.target).metric

    def variants(self) -> list[str]:
        return [self.variant]

    def describe(self) -> str:
        lo, hi = self.interval()
        where = (
            f"≤ {hi:.4g}"
            if self.bound == "at_most"
            else f"≥ {lo:.4g}"
            if self.bound == "at_least"
            else f"in [{lo:.4g}, {hi:.4g}]"
        )
        return f"{self.variant}: {self.by} to {self.target} {where}"

    def evaluate(self, runs: Mapping[str, Sequence[Path]]) -> Verdict:
        """The cost to the target against the paper's. A run that never reached the target says nothing about its
        cost, except under ``bound = "at_most"`` when it ran past the bound: then its cost exceeds the paper's."""
        files = runs.get(self.variant, [])
        if not files:
            return Verdict("—", NOT_MEASURED, f"no complete run of {self.variant}")
        lo, hi = self.interval()
        costs, past = [], []
        for path, hit in zip(files, time_to_target(files, Target.parse(self.target))):
            if hit is not None and math.isfinite(hit[self.by]):
                costs.append(hit[self.by])
            elif self.bound == "at_most" and spent(path, self.by) > hi:
                past.append(spent(path, self.by))
        reached = Stat(tuple(costs)).text() if costs else "—"
        measured = f"{self.variant}: {self.by} to {self.target}: {reached}, reached in {len(costs)} of {len(files)}"
        if past:
            measured += f"; {len(past)} ran to {self.by} {min(past):g} or more without reaching it"
            if not costs:
                return Verdict(
                    measured,
                    "does not hold",
                    f"{self.variant} ran past {hi:g} {self.by} without reaching "
                    f"{self.target} in {len(past)} of {len(files)} seeds (the paper: {self.value:g})",
                )
        if not costs:
            return Verdict(
                measured,
                NOT_MEASURED,
                f"{self.variant} never reached {self.target} in any seed, and no run "
                f"went past {hi:g} {self.by}: no cost to compare with the paper's {self.value:g}",
            )
        stat = Stat(tuple(costs))
        missed = f"; only {len(costs)} of {len(files)} seeds reached it" if len(costs) < len(files) else ""
        if past:
            missed += f" ({len(past)} ran past {hi:g} {self.by} without it)"
        return _inside(measured, stat, self.k, (lo, hi), stat.mean, (lo, hi), missed)


def spent(path: Path, by: str) -> float:
    """What a run had spent on a cost axis at its last evaluation (rounds, MiB per worker up + down, seconds)."""
    table = read_metrics(path)
    if not table["round"].size:
        return 0.0
    column = table["mib_up"] + table["mib_down"] if by == "mib" else table[by]
    return float(column[-1])


CLAIMS.add(
    "ordering", OrderingClaim, "variants ordered on a metric: final, best, or at a budget of rounds, epochs or MiB"
)
CLAIMS.add(
    "value",
    ValueClaim,
    "a variant's metric within a tolerance of a value (the paper's number or a closed form), or beyond a bound",
)
CLAIMS.add(
    "reaches_first", ReachesFirstClaim, "one variant reaches a target with less rounds, MiB or seconds than another"
)
CLAIMS.add(
    "reaches",
    ReachesClaim,
    "a variant reaches a target with a cost (rounds, MiB, seconds) near the paper's, or beyond a bound",
)


def parse_claims(raw: Sequence[Any], labels: Sequence[str]) -> list[Claim]:
    """The validated claims of an experiment with these variant labels; errors name ``claims[i].field``."""
    out = []
    for i, item in enumerate(raw):
        where = f"claims[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(where, f"expected a table with kind = {' | '.join(CLAIMS)}, got {item!r}")
        kind = item.get("kind")
        if kind not in CLAIMS:
            hint = difflib.get_close_matches(str(kind), CLAIMS.names(), n=1)
            raise ConfigError(
                f"{where}.kind",
                f"unknown claim kind {kind!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: "
                f"{', '.join(CLAIMS)}",
            )
        claim = validate(CLAIMS[kind].factory, item, f"{where}.")
        for name in claim.all_variants():
            if name not in labels:
                hint = difflib.get_close_matches(name, labels, n=1)
                own = next(
                    (f for f in ("order", "variant", "first", "second") if name in str(getattr(claim, f, ""))), None
                )
                field = own or "alternative." + next(
                    f
                    for f in ("order", "variant", "first", "second")
                    if name in str((claim.alternative or {}).get(f, ""))
                )
                raise ConfigError(
                    f"{where}.{field}",
                    f"unknown variant {name!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: "
                    f"{', '.join(map(repr, labels))}",
                )
        twin = next((j for j, other in enumerate(out) if other.model_dump() == claim.model_dump()), None)
        if twin is not None:
            raise ConfigError(where, f"the same claim as claims[{twin}]: a claim is judged and counted once")
        out.append(claim)
    return out
