"""The Python API: build an experiment, run it, and get every curve back as a DataFrame.

```python
import fedshuffle as fs

exp = fs.experiment("quickstart", overrides={"run.rounds": 20})   # a preset, a TOML file or a dict
results = exp.run(seeds=[0, 1], progress=False)                   # every variant × seed, on disk
results.curves                                                     # one row per (variant, seed, evaluation)
results.plot("f_gap")                                              # mean over seeds with a std band
```

An experiment runs exactly as ``fedshuffle run`` does (same folders, files and numbers);
:func:`load_results` reads any results folder — of the command line's runs and sweeps too — back
into the same tables. Bad arguments raise :class:`~fedshuffle.core.errors.ConfigError` naming the
argument (or the configuration setting) and what is accepted.
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings
from dataclasses import asdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedshuffle import metrics as _metrics
from fedshuffle import plugins as _plugins
from fedshuffle.analysis.objective import inspect_objective
from fedshuffle.core.errors import ConfigError, did_you_mean
from fedshuffle.experiments import schema
from fedshuffle.experiments.build import build_algorithm_from, build_problem_and_data, build_sampler, resolve_step_sizes
from fedshuffle.experiments.folders import find_files, read_object, seal_problem
from fedshuffle.experiments.plots import line_style
from fedshuffle.experiments.report import point_text
from fedshuffle.experiments.reproduce import reproduce as run_all
from fedshuffle.experiments.results import METRIC_COLUMNS, PLOT_LIMIT, TIMING_COLUMNS, read_metrics
from fedshuffle.experiments.runner import build_simulation, ensure_writable
from fedshuffle.experiments.schema import SECTIONS, RunSpec, load_experiment, preset_names, slug, validate
from fedshuffle.experiments.sweep import merge_overrides
from fedshuffle.experiments.session import (
    check_out,
    normalize_overrides,
    only_variants,
    pick_folder,
    requested_seeds,
    resume_folder,
    run_experiment,
)

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

    from fedshuffle.analysis.objective import ObjectiveReport
    from fedshuffle.simulation import Simulation

#: every metric column, in declaration order (:data:`fedshuffle.metrics.METRICS`): ``metrics.csv`` then ``timing.csv``
VALUE_COLUMNS = (*(c for c in METRIC_COLUMNS if c != "round"), *TIMING_COLUMNS[1:])


def _with_seeds(config: schema.Experiment, seeds: Any, overrides: Mapping[str, Mapping[str, Any]]) -> schema.Experiment:
    """``config`` with ``[experiment] seeds`` replaced by the seeds asked for
    (:func:`~fedshuffle.experiments.session.requested_seeds`)."""
    seed_list = requested_seeds(seeds, overrides, "seeds", "overrides run.seed")
    if seed_list is None:
        return config
    return config.model_copy(update={"experiment": config.experiment.model_copy(update={"seeds": seed_list})})


def _one_seed(seed: Any) -> int:
    """One seed (``seed=`` of :meth:`Experiment.simulation` and :meth:`Experiment.objective`)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError("seed", f"expected an integer >= 0, got {seed!r}")
    return int(seed)


def _config_of(config: Any) -> tuple[schema.Experiment, dict[str, dict[str, Any]]]:
    if isinstance(config, Experiment):
        return config.config, config.overrides
    if isinstance(config, schema.Experiment):
        return config.model_copy(deep=True), {}
    if isinstance(config, (str, os.PathLike)):
        return load_experiment(config), {}
    if isinstance(config, Mapping):
        return validate(schema.Experiment, dict(config)), {}
    raise ConfigError(
        "config",
        f"expected a preset name, a TOML file, a dict of sections or an Experiment, got {type(config).__name__}",
    )


def experiment(
    config: str | os.PathLike | Mapping[str, Any] | schema.Experiment | Experiment = "quickstart",
    *,
    overrides: Any = None,
    seeds: Sequence[int] | None = None,
    plugins: Sequence[str] | str | None = None,
) -> Experiment:
    """An experiment from a preset name, a TOML file, a dict of sections (as the TOML file would give)
    or another experiment, with ``overrides`` on every variant and, optionally, its ``seeds``.

    ``plugins`` consents to importing these modules where the config's ``[experiment] plugins`` names them
    (as ``--plugins`` does; :func:`fedshuffle.plugins.allow`): a config alone imports no code.

    ``overrides`` are what ``--set`` gives on the command line: ``{"run.rounds": 50}``,
    ``{"local": {"lr": 0.01}}`` or ``["run.rounds=50"]``. Every variant is validated here, so bad
    settings fail at once, naming the setting (``variants[1] (FedNova).local.lr: ...``, or ``overrides local.lr: ...``
    where an override gives it).
    """
    if plugins is not None:
        _plugins.allow(plugins, "the plugins argument")
    config, base = _config_of(config)
    overrides = merge_overrides(base, normalize_overrides(overrides, "overrides"))
    return Experiment(_with_seeds(config, seeds, overrides), overrides)


def list_presets() -> pd.DataFrame:
    """The bundled presets: name, title, paper, figure, variants, seeds and rounds, one row each."""
    import pandas as pd

    return pd.DataFrame(preset_table(), columns=["name", "title", "paper", "figure", "variants", "seeds", "rounds"])


def preset_table() -> list[dict[str, Any]]:
    """The bundled presets' ``[experiment]`` metadata, variants, seeds and rounds (without pandas)."""
    rows = []
    for name in preset_names():
        config = load_experiment(name)
        meta = config.experiment
        runs = config.runs()
        rounds = sorted({spec.run.rounds for _, spec in runs})
        rows.append(
            {
                "name": name,
                "title": meta.title,
                "paper": meta.paper,
                "figure": meta.figure,
                "variants": [label for label, _ in runs if label],
                "seeds": config.seeds(runs[0][1]),
                "rounds": rounds[0] if len(rounds) == 1 else rounds,
            }
        )
    return rows


def reproduce(
    *presets: str,
    out: str | os.PathLike = "results/reproduce",
    budget: str | None = None,
    progress: bool = False,
    plugins: Sequence[str] | str | None = None,
) -> list[dict[str, Any]]:
    """As ``fedshuffle reproduce``: run the presets (every one when none is given) where runs are missing,
    judge their papers' claims and write ``report.md`` and ``report.html`` into ``out``; one dict per
    claim (preset, paper, figure, claim, quote, measured, verdict, why). ``plugins`` as for :func:`experiment`."""
    if plugins is not None:
        _plugins.allow(plugins, "the plugins argument")
    return [
        asdict(r) for r in run_all(list(presets) or preset_names(), Path(out), budget=budget, show_progress=progress)
    ]


class Experiment:
    """Variants × seeds of one configuration, ready to run or to inspect.

    ``config`` is the validated file (:class:`fedshuffle.experiments.schema.Experiment`) and
    ``overrides`` the settings applied over every variant. Build one with :func:`experiment`.
    """

    def __init__(self, config: schema.Experiment, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        if not isinstance(config, schema.Experiment):
            raise ConfigError(
                "config",
                "expected a validated fedshuffle.experiments.schema.Experiment (use fedshuffle.experiment(...)), "
                f"got {type(config).__name__}",
            )
        self.config = config
        self.overrides = normalize_overrides(overrides, "overrides")
        self._specs = dict(config.runs(self.overrides, given_as="overrides"))  # validates every variant now

    @property
    def name(self) -> str:
        return self.config.experiment.name

    @property
    def variants(self) -> list[str]:
        """The variant labels (empty for an experiment without ``[[variants]]``)."""
        return [label for label in self._specs if label]

    @property
    def seeds(self) -> list[int]:
        """``[experiment] seeds``, or the ``run.seed`` of the first variant."""
        return self.config.seeds(next(iter(self._specs.values())))

    def __repr__(self) -> str:
        rounds = sorted({s.run.rounds for s in self._specs.values()})
        return (
            f"Experiment({self.name!r}: {len(self.variants) or 1} variant(s) × seeds {self.seeds}, "
            f"{'/'.join(map(str, rounds))} rounds)"
        )

    def with_overrides(self, overrides: Any) -> Experiment:
        """A copy with more overrides (later ones win)."""
        return Experiment(self.config, merge_overrides(self.overrides, normalize_overrides(overrides, "overrides")))

    def spec(self, variant: str | None = None) -> RunSpec:
        """The fully resolved settings of one variant (every default filled in): ``spec(...).model_dump()``
        is what ``fedshuffle show`` prints. ``variant`` may be left out when there is only one."""
        return self._specs[self._variant(variant)]

    def specs(self) -> dict[str, RunSpec]:
        """Variant label → resolved settings."""
        return dict(self._specs)

    def _variant(self, variant: str | None) -> str:
        labels = list(self._specs)
        if variant is None:
            if len(labels) == 1:
                return labels[0]
            raise ConfigError(
                "variant", f"this experiment has {len(labels)} variants; name one of: {', '.join(labels)}"
            )
        if variant not in self._specs:
            raise ConfigError(
                "variant",
                f"no variant {variant!r}; the variants are: {', '.join(labels) or '(none: leave variant out)'}",
            )
        return variant

    def simulation(self, variant: str | None = None, seed: int | None = None) -> Simulation:
        """The :class:`~fedshuffle.simulation.Simulation` of one variant and seed, built but not run:
        ``sim.step()`` runs one round, ``sim.params`` is the server model. Step sizes given as
        ``'theory'`` are resolved."""
        spec = self.spec(variant)
        seed_value = spec.run.seed if seed is None else _one_seed(seed)
        sim, _ = build_simulation(spec, seed_value)
        return sim

    def objective(
        self, variant: str | None = None, *, seed: int | None = None, exact: bool | None = None, rounds: int = 20_000
    ) -> ObjectiveReport:
        """Which objective does this variant minimize on its data?
        :func:`~fedshuffle.analysis.objective.inspect_objective`
        with the variant's algorithm, sampler, client sizes and objective weights w_i."""

        spec = self.spec(variant)
        if seed is not None:
            spec = spec.model_copy(update={"run": spec.run.model_copy(update={"seed": _one_seed(seed)})})
        problem, data = build_problem_and_data(spec)
        sampler = build_sampler(spec.sampler, data)
        spec, _ = resolve_step_sizes(spec, problem, data, sampler)
        return inspect_objective(
            build_algorithm_from(spec),
            sampler,
            data.sizes,
            data.weights,
            exact=exact,
            rounds=rounds,
            seed=spec.run.seed,
        )

    def run(
        self,
        out: str | os.PathLike | None = None,
        *,
        seeds: Sequence[int] | None = None,
        variants: Sequence[str] | None = None,
        progress: bool = True,
        workers: int = 1,
        resume: bool = False,
    ) -> Results:
        """Run every variant (or only ``variants``) × seed into ``out`` and read the results back.

        ``out`` defaults to ``results/<name>``. As ``fedshuffle run`` does, a folder (named or the default)
        that already holds anything is left alone: the runs go into the first free ``out-2``, ``out-3``, …
        and a note on stderr names it (:attr:`Results.path` is the folder written). ``resume=True`` continues the
        unfinished runs in ``out`` instead. ``progress``
        shows a progress bar (rich); ``workers`` runs that many runs in parallel processes. A run
        that diverges or fails does not raise: its status is in :attr:`Results.runs` and a warning
        names it.
        """
        config = only_variants(_with_seeds(self.config, seeds, {}), variants, "variants")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError("workers", f"expected an integer >= 1, got {workers!r}")
        folder = check_out(out, "out")
        if resume:
            if folder is None:
                raise ConfigError("resume", "give the folder to continue as out=...")
            target = resume_folder(folder, "out")
        else:
            target, moved = pick_folder(folder or Path("results") / slug(self.name), "resume=True")
            if moved:
                print(f"note: {moved}", file=sys.stderr)
        ensure_writable(target)
        run_experiment(
            config, target, overrides=self.overrides, resume=resume, show_progress=bool(progress), workers=workers
        )  # the seeds are config's
        return _read_back(target)

    def sweep(
        self,
        grid: Mapping[str, Sequence[Any]],
        out: str | os.PathLike | None = None,
        *,
        seeds: Sequence[int] | None = None,
        variants: Sequence[str] | None = None,
        pick: str | None = None,
        workers: int = 1,
        progress: bool = True,
    ) -> Results:
        """Every combination of ``grid`` (``"section.setting"`` → values) × variant × seed, as ``fedshuffle sweep``.

        ``out`` defaults to ``results/<name>-sweep``; a sweep started again keeps its finished runs and
        resumes the others. ``pick`` (a metric) chooses the best point per variant by its final mean over
        the seeds, in :attr:`Results.best` (with the settings at the edge of the grid, where the optimum may
        lie beyond). Runs of grid points and seeds that differ only in step sizes or seed share one
        simulation (:mod:`fedshuffle.replicas`).
        """
        from fedshuffle.experiments.results import check_metrics
        from fedshuffle.experiments.session import run_sweep

        points = _grid_points(grid)
        if pick is not None:
            check_metrics([pick], "pick")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError("workers", f"expected an integer >= 1, got {workers!r}")
        if variants is not None and (
            isinstance(variants, str)
            or not isinstance(variants, Sequence)
            or any(v not in self.variants for v in variants)
        ):
            raise ConfigError(
                "variants",
                f"expected a list of variant labels among: {', '.join(self.variants) or '(none)'}; got {variants!r}",
            )
        target = check_out(out, "out") or Path("results") / f"{slug(self.name)}-sweep"
        config = _with_seeds(self.config, seeds, {})
        record, _ = run_sweep(
            config,
            target,
            points,
            seeds=None,
            overrides=self.overrides,
            variants=variants,
            pick=pick,
            extend=False,
            workers=workers,
            show_progress=bool(progress),
            record={"grid": {k: list(v) for k, v in grid.items()}},
        )
        results = _read_back(target)
        results.best = record.get("best", {})
        return results


def _read_back(target: Path) -> Results:
    """The results in ``target``, with a warning naming the runs that did not complete."""
    results = load_results(target)
    problems = results.runs[results.runs["status"] != "complete"]
    if len(problems):
        names = ", ".join(f"{r.variant} seed {r.seed}: {r.status}" for r in problems.itertuples())
        warnings.warn(f"not every run completed ({names}); see Results.runs", RuntimeWarning, stacklevel=2)
    return results


def _grid_points(grid: Any) -> list[dict[str, dict[str, Any]]]:
    """``{"local.lr": [0.1, 0.01], "local.epochs": [1, 2]}`` → every combination as override sections."""
    if not isinstance(grid, Mapping) or not grid:
        raise ConfigError("grid", f'expected {{"section.setting": [values, ...], ...}}, got {grid!r}')
    axes = []
    for key, values in grid.items():
        section, _, setting = str(key).partition(".")
        if section not in SECTIONS or not setting or "." in setting:
            raise ConfigError("grid", f"{key!r} is not section.setting with section one of {', '.join(SECTIONS)}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ConfigError("grid", f"{key}: expected a non-empty list of values, got {values!r}")
        axes.append([(section, setting, v) for v in values])
    points = []
    for combo in itertools.product(*axes):
        point: dict[str, dict[str, Any]] = {}
        for section, setting, value in combo:
            point.setdefault(section, {})[setting] = value
        points.append(point)
    return points


def load_results(*paths: str | os.PathLike, allow_unsealed: bool = False) -> Results:
    """Every run below ``paths`` (results folders of ``fedshuffle run``/``sweep`` or of :meth:`Experiment.run`).

    Runs in progress are read as ``unfinished``. A finished run whose ``metrics.csv`` no longer matches the
    seal in its ``summary.json`` (or that has none) is refused, as ``plot`` and ``table`` refuse it, or with
    ``allow_unsealed`` read with a warning."""
    import pandas as pd

    if not paths:
        raise ConfigError("paths", "give at least one results folder")
    runs, curves = [], []
    for root in paths:
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError("paths", f"expected folder paths, got {type(root).__name__}")
        root = Path(root)
        if not root.is_dir():
            raise ConfigError("paths", f"{root} is not a folder")
        for table in find_files(root, "metrics.csv"):
            folder = table.parent
            config = read_object(folder / "config.json")
            if not config:
                continue  # not a run folder of fedshuffle's
            summary = read_object(folder / "summary.json")
            unsealed = seal_problem(folder, summary) if summary else None
            if unsealed is not None:
                problem = f"{unsealed[0]}: {unsealed[1]}"
                if not allow_unsealed:
                    raise ConfigError(
                        "paths",
                        f"{problem}; continue the run with resume to write it again, or pass allow_unsealed=True",
                    )
                warnings.warn(f"{problem}; read as it is (allow_unsealed=True)", stacklevel=2)
            point = config.get("point") or {}
            row = {
                "variant": config.get("label") or "run",
                "point": point_text(point),
                "seed": int(config.get("seed", -1)),
                "status": summary.get("status", "unfinished"),
                "message": summary.get("message", ""),
                "path": str(folder),
            }
            for section, settings in point.items():
                for key, value in settings.items():
                    row[f"{section}.{key}"] = value
            runs.append(row)
            columns = read_metrics(table)
            frame = pd.DataFrame({name: columns[name] for name in ("round", *VALUE_COLUMNS)})
            for key in ("variant", "point", "seed"):
                frame.insert(("variant", "point", "seed").index(key), key, row[key])
            curves.append(frame)
    if not runs:
        raise ConfigError(
            "paths", f"no runs (folders with config.json and metrics.csv) under {', '.join(map(str, paths))}"
        )
    curve_frame = pd.concat(curves, ignore_index=True)
    for name in ("round", *_metrics.METRICS.names()):
        if name in curve_frame and _metrics.METRICS[name].defaults["integer"] and curve_frame[name].notna().all():
            curve_frame[name] = curve_frame[name].astype("int64")
    run_frame = pd.DataFrame(runs)
    order = ["variant", "point", "seed"]
    runs_sorted = run_frame.sort_values(order, kind="stable", ignore_index=True)
    return Results(runs_sorted, curve_frame.sort_values([*order, "round"], kind="stable", ignore_index=True), paths)


class Results:
    """The runs of one or more results folders, as DataFrames.

    * :attr:`runs`: one row per run — ``variant``, ``point`` (a sweep's grid point as text, ``""``
      otherwise), ``seed``, ``status`` (complete, diverged, failed, unfinished), ``message``, ``path``,
      and one column per swept setting (``local.lr``, …).
    * :attr:`curves`: one row per evaluation of every run — ``variant``, ``point``, ``seed``,
      ``round`` and every declared metric (:data:`fedshuffle.metrics.METRICS`: costs, model scores,
      method diagnostics, the measured times of ``timing.csv``); NaN where a metric does not apply.
    * :attr:`path`: the results folder they were read from (:attr:`paths`: every folder, when several).
    """

    def __init__(self, runs: pd.DataFrame, curves: pd.DataFrame, paths: Sequence[str | os.PathLike] = ()) -> None:
        self.runs = runs
        self.curves = curves
        #: the folders the runs were read from, as given to :func:`load_results`
        self.paths = tuple(Path(p) for p in paths)
        #: a sweep's best point per variant when it was asked to pick one (:meth:`Experiment.sweep`)
        self.best: dict[str, dict[str, Any]] = {}

    def __repr__(self) -> str:
        return f"Results({len(self.runs)} runs: {', '.join(self.runs['variant'].unique())})"

    @property
    def path(self) -> Path:
        """The results folder these runs were read from: the folder :meth:`Experiment.run` wrote (``out``, or the
        ``out-2`` it chose), or the one folder given to :func:`load_results`."""
        if len(self.paths) != 1:
            raise ConfigError("path", f"these results were read from {len(self.paths)} folders; see Results.paths")
        return self.paths[0]

    @property
    def metrics(self) -> list[str]:
        """The metrics that have at least one value in these runs."""
        return [m for m in VALUE_COLUMNS if self.curves[m].notna().any()]

    def _check_metric(
        self, metric: Any, argument: str = "metric", kinds: tuple[str, ...] = ("model", "method", "cost")
    ) -> str:
        accepted = [m for m in ("round", *VALUE_COLUMNS) if _metrics.METRICS[m].defaults["kind"] in kinds]
        if metric not in accepted:
            raise ConfigError(
                argument, f"unknown metric {metric!r}{did_you_mean(metric, accepted)}; accepted: {', '.join(accepted)}"
            )
        if not self.curves[metric].notna().any():
            present = [m for m in accepted if self.curves[m].notna().any()]
            raise ConfigError(argument, f"no run has values of {metric!r}; these runs have: {', '.join(present)}")
        return metric

    def final(self) -> pd.DataFrame:
        """One row per run: its last evaluation, with ``status``."""
        last = self.curves.groupby(["variant", "point", "seed"], sort=False).tail(1)
        return self.runs[["variant", "point", "seed", "status"]].merge(
            last, on=["variant", "point", "seed"], how="left"
        )

    def summary(self, metrics: Sequence[str] | str | None = None) -> pd.DataFrame:
        """Mean and std (population, as ``fedshuffle table``) over the complete seeds of each final
        metric, one row per variant (and point); ``seeds`` counts the complete seeds of the group."""
        import pandas as pd

        names = self.metrics if metrics is None else [metrics] if isinstance(metrics, str) else list(metrics)
        names = [self._check_metric(m, "metrics") for m in names]
        final = self.final()
        complete = final[final["status"] == "complete"]
        groups = complete.groupby(["variant", "point"], sort=False)
        columns: dict[tuple[str, str], Any] = {}
        for name in names:
            columns[(name, "mean")] = groups[name].mean()
            columns[(name, "std")] = groups[name].std(ddof=0)
        columns[("seeds", "")] = groups.size()
        table = pd.DataFrame(columns)
        return table

    def plot(
        self,
        metric: str = "f_gap",
        x: str = "round",
        *,
        band: str | None = "std",
        log_y: bool | None = None,
        ax: Axes | None = None,
    ) -> Axes:
        """One line per variant (and grid point): the mean of ``metric`` over seeds against ``x``, with
        a std or min–max ``band`` (``None`` for none). ``log_y`` defaults to a log axis for metrics
        where lower is better. Returns the matplotlib axes (a new figure unless ``ax`` is given)."""
        import matplotlib.pyplot as plt

        metric = self._check_metric(metric, "metric", ("model", "method"))
        if x != "bytes":
            x = self._check_metric(x, "x", ("cost",))
        if band not in ("std", "minmax", None):
            raise ConfigError("band", f"expected 'std', 'minmax' or None, got {band!r}")
        if log_y is None:
            log_y = _metrics.METRICS[metric].defaults["better"] == "min"
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
        frame = self.curves.assign(bytes=self.curves["bytes_up"] + self.curves["bytes_down"])
        values = frame[metric].where(np.isfinite(frame[metric]) & (frame[metric].abs() < PLOT_LIMIT))
        frame = frame.assign(**{metric: values})
        groups = list(frame.groupby(["variant", "point"], sort=False))
        for k, ((variant, point), group) in enumerate(groups):
            per_round = group.groupby("round")
            mean = per_round[metric].mean()
            if mean.isna().all():
                continue
            xs = per_round[x].mean()
            label = f"{variant} [{point}]" if point else variant
            (line,) = ax.plot(xs.to_numpy(), mean.to_numpy(), label=label, **line_style(k))
            if band and group["seed"].nunique() > 1:
                low, high = (
                    (mean - per_round[metric].std(ddof=0), mean + per_round[metric].std(ddof=0))
                    if band == "std"
                    else (per_round[metric].min(), per_round[metric].max())
                )
                if log_y:
                    low = np.maximum(low, per_round[metric].min())
                ax.fill_between(
                    xs.to_numpy(), low.to_numpy(), high.to_numpy(), color=line.get_color(), alpha=0.2, linewidth=0
                )
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(_metrics.label(x) if x != "bytes" else "bytes communicated (up + down)")
        ax.set_ylabel(_metrics.label(metric))
        ax.grid(alpha=0.3)
        ax.legend(
            fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False
        )  # beside the axes, never over the curves
        return ax


__all__ = ["Experiment", "Results", "experiment", "list_presets", "load_results", "preset_table"]
