"""Reading results folders back: runs grouped by variant and grid point, tables and figures.

Any folder holding run folders (``summary.json`` + ``metrics.csv``) works: one run, an experiment,
a sweep, or several of them side by side. Runs are grouped by experiment folder, variant label and
grid point, so two experiments sharing a label are never merged; seeds of a group are summarized as
mean ± std (a seed twice in a group is refused), and diverged or failed seeds are counted, not dropped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedshuffle.core.errors import ConfigError
from fedshuffle import metrics
from fedshuffle.core.io import read_text
from fedshuffle.experiments.folders import MANIFEST, find_files, read_json, read_object, seal_problem
from fedshuffle.experiments.results import check_metrics, read_metrics, summarize
from fedshuffle.experiments.plots import plot_comparison

#: the metrics summaries and tables report (every declared model score and method diagnostic)
SUMMARY_METRICS = metrics.of_kind("model", "method")


@dataclass(frozen=True)
class StoredRun:
    path: Path
    label: str
    point: dict[str, Any]
    seed: int
    status: str
    final: dict[str, Any]
    message: str = ""
    experiment: Path | None = None  # the experiment folder the run belongs to (see :func:`experiment_folder`)


def point_text(point: Mapping[str, Mapping[str, Any]]) -> str:
    return ", ".join(
        f"{section}.{key}={value}" for section, settings in point.items() for key, value in settings.items()
    )


def experiment_folder(run_dir: Path, label: str, point: Mapping[str, Any]) -> Path:
    """The folder of the experiment or sweep a run belongs to: the nearest one above it with a manifest,
    else the folder ``[<point>/][<variant>/]seed-<s>/`` sits in."""
    run_dir = run_dir.resolve()
    for parent in run_dir.parents:
        if (parent / MANIFEST).is_file():
            return parent
    depth = 1 + bool(label) + bool(point) if run_dir.name.startswith("seed-") else 1
    return run_dir.parents[min(depth, len(run_dir.parents)) - 1]


def collect_runs(
    paths: Iterable[str | Path], *, allow_unsealed: bool = False, warn: Callable[[str], None] | None = None
) -> list[StoredRun]:
    """Every run folder below ``paths`` (a folder with ``summary.json`` next to ``metrics.csv``), each once.

    A run whose seal (see :func:`~fedshuffle.experiments.folders.sealed`) is missing or no longer matches its
    ``metrics.csv`` is refused, or with ``allow_unsealed`` taken with a warning passed to ``warn``."""
    runs, seen = [], set()
    paths = list(paths)
    for root in map(Path, paths):
        if not root.exists():
            raise ConfigError("path", f"{root} does not exist")
        for summary in find_files(root, "summary.json"):
            if not (summary.parent / "metrics.csv").exists():
                continue  # an experiment's overall summary, not a run
            if summary.parent.resolve() in seen:
                continue  # the same run reached through two of the paths
            seen.add(summary.parent.resolve())
            data = read_json(summary, "run summary")
            if (
                not isinstance(data, dict)
                or not isinstance(data.get("point", {}), dict)
                or not isinstance(data.get("final", {}), dict)
                or not isinstance(data.get("seed", -1), int)
            ):
                raise ConfigError(
                    str(summary), "not a run summary (expected an object with status, final, label, point, seed)"
                )
            unsealed = seal_problem(summary.parent, data)  # sealed by the runner, and still as written?
            if unsealed is not None:
                where, problem = unsealed
                if not allow_unsealed:
                    raise ConfigError(
                        str(where),
                        f"{problem}; continue the run with --resume to write it again, or show it anyway with "
                        "--allow-unsealed",
                    )
                if warn:
                    warn(f"{where}: {problem}; shown as it is (--allow-unsealed)")
            label = data.get("label", summary.parent.parent.name)
            point = data.get("point", {})
            runs.append(
                StoredRun(
                    summary.parent,
                    str(label),
                    point,
                    data.get("seed", -1),
                    str(data.get("status", "unknown")),
                    data.get("final", {}),
                    str(data.get("message", "")),
                    experiment_folder(summary.parent, str(label), point),
                )
            )
    if not runs:
        raise ConfigError(
            "path", f"no runs (folders with summary.json and metrics.csv) under {', '.join(map(str, paths))}"
        )
    return runs


def _display(folders: Sequence[Path]) -> dict[Path, str]:
    """Short names for experiment folders: paths below their common parent."""
    common = Path(os.path.commonpath([str(f) for f in folders]))
    return {f: (f.relative_to(common).as_posix() if f != common else f.name) or str(f) for f in folders}


def group_runs(runs: Sequence[StoredRun]) -> dict[str, list[StoredRun]]:
    """Runs by (experiment folder, variant, grid point); never two experiments or two points in one group.

    Names are the label, with the point when the runs span several points and the experiment folder
    when they span several. A group with a seed twice (two copies of one run) is refused.
    """
    several_points = len({json.dumps(r.point, sort_keys=True) for r in runs}) > 1
    experiments = sorted({r.experiment for r in runs if r.experiment is not None})
    shown = _display(experiments) if len(experiments) > 1 else {}
    keyed: dict[tuple, list[StoredRun]] = {}
    for r in runs:
        keyed.setdefault((str(r.experiment), r.label, json.dumps(r.point, sort_keys=True)), []).append(r)
    groups: dict[str, list[StoredRun]] = {}
    for members in keyed.values():
        first = members[0]
        name = first.label or "run"
        if several_points:
            name += f" [{point_text(first.point) or 'base'}]"
        if first.experiment in shown:
            name += f" ({shown[first.experiment]})"
        by_seed: dict[Any, StoredRun] = {}
        for r in members:
            if r.seed in by_seed:
                raise ConfigError(
                    "path",
                    f"{by_seed[r.seed].path} and {r.path} are both seed {r.seed} of {name!r}: one run counted twice "
                    "would shrink the band; "
                    "pass the folders separately or remove the copy",
                )
            by_seed[r.seed] = r
        groups[name] = members
    return groups


def best_point_runs(runs: Sequence[StoredRun], metric: str) -> list[StoredRun]:
    """Per experiment folder and variant, the runs of the grid point with the best mean final ``metric``
    over seeds (lowest; highest for metrics where higher is better), as ``sweep --pick`` chooses it.

    A point with a diverged or failed seed, or without the metric, ranks after every other one.
    """
    sign = -1.0 if metrics.METRICS[metric].defaults["better"] == "max" else 1.0
    by_variant: dict[tuple, dict[str, list[StoredRun]]] = {}
    for r in runs:
        by_variant.setdefault((str(r.experiment), r.label), {}).setdefault(
            json.dumps(r.point, sort_keys=True), []
        ).append(r)
    chosen: list[StoredRun] = []
    for points in by_variant.values():

        def score(members: list[StoredRun]) -> float:
            values = [_number(r.final.get(metric)) for r in members]
            ok = all(r.status == "complete" for r in members) and all(v is not None for v in values)
            return sign * float(np.mean(values)) if ok else math.inf

        chosen += min(points.values(), key=score)
    return chosen


def summarize_runs(runs: Sequence[StoredRun], base: Path) -> dict[str, Any]:
    """Status of every seed, and mean ± std of the final metrics over the complete ones."""
    complete = [r for r in runs if r.status == "complete"]
    return {
        "status": [r.status for r in runs],
        "seeds": [r.seed for r in runs],
        "final": {
            m: summarize(r.final.get(m) for r in complete)
            for m in SUMMARY_METRICS
            if any(r.final.get(m) is not None for r in complete)
        },
        "runs": [str(r.path.relative_to(base)) if r.path.is_relative_to(base) else str(r.path) for r in runs],
    }


def _best_value(run: StoredRun, metric: str) -> float | None:
    values = read_metrics(run.path / "metrics.csv")[metric]
    values = values[np.isfinite(values)]
    if not values.size:
        return None
    return float(values.max() if metrics.METRICS[metric].defaults["better"] == "max" else values.min())


def _number(value: Any) -> float | None:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


def summary_table(
    groups: Mapping[str, Sequence[StoredRun]], names: Sequence[str], stat: str = "final"
) -> tuple[list[str], list[list[str]]]:
    """Columns and one row per group: ``mean ± std`` over complete seeds of the final (or best) value of each metric
    (the value alone for one seed), and the seeds counted."""
    check_metrics(names, "--metric")
    if stat not in ("final", "best"):
        raise ConfigError("--stat", f"unknown {stat!r}; accepted: final, best")
    rows = []
    for name, runs in groups.items():
        complete = [r for r in runs if r.status == "complete"]
        cells = []
        for m in names:
            values = [_number(r.final.get(m)) if stat == "final" else _best_value(r, m) for r in complete]
            values = [v for v in values if v is not None]
            cells.append(
                (
                    "—"
                    if not values
                    else f"{np.mean(values):.4g}"
                    if len(values) == 1
                    else f"{np.mean(values):.4g} ± {np.std(values):.2g}"
                )
            )
        problems = [r.status for r in runs if r.status != "complete"]
        seeds = f"{len(complete)}" + (f" ({len(problems)} {', '.join(sorted(set(problems)))})" if problems else "")
        rows.append([name, *cells, seeds])
    return ["variant", *(f"{stat} {m}" for m in names), "seeds"], rows


def plot_runs(
    groups: Mapping[str, Sequence[StoredRun]],
    out_stem: Path,
    *,
    metric: str | Sequence[str],
    x: str,
    band: str,
    log_y: bool,
    title: str = "",
    require_data: bool = False,
    recorded_only: bool = False,
) -> list[Path]:
    return plot_comparison(
        {name: [r.path / "metrics.csv" for r in runs] for name, runs in groups.items()},
        out_stem,
        metric=metric,
        x=x,
        log_y=log_y,
        band=band,
        title=title,
        require_data=require_data,
        recorded_only=recorded_only,
    )


def plot_title(runs: Sequence[StoredRun]) -> str:
    """The title ``fedshuffle run`` gives its figure, for runs of one experiment: the experiment's title, else its
    name (from the experiment's ``summary.json``, or a sweep's manifest); empty for runs of several experiments."""
    experiments = {r.experiment for r in runs}
    if len(experiments) != 1 or None in experiments:
        return ""
    folder = Path(next(iter(experiments)))
    described = read_object(folder / "summary.json").get("experiment")
    if isinstance(described, dict) and (described.get("title") or described.get("name")):
        return str(described.get("title") or described.get("name"))
    name = read_object(folder / MANIFEST).get("experiment")
    return name if isinstance(name, str) else ""


def plot_defaults(run: StoredRun) -> dict[str, Any]:
    """The plot settings recorded in a run's config (the defaults where it has none that can be used)."""
    defaults = {"metric": "loss", "x": "round", "band": "std", "log_y": True}
    try:
        spec = json.loads(read_text(run.path / "config.json"))["spec"]["plot"]
    except (OSError, KeyError, TypeError, ValueError, RecursionError):
        return defaults
    if not isinstance(spec, dict):
        return defaults
    metric = spec.get("metric")
    if not metric or not all(
        m in metrics.METRICS
        for m in ([metric] if isinstance(metric, str) else metric if isinstance(metric, list) else [None])
    ):
        spec = {**spec, "metric": defaults["metric"]}
    return {**defaults, **spec}
