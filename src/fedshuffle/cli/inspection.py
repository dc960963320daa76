"""``inspect``: which objective a configuration minimizes, and its step sizes."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from fedshuffle.core.errors import ConfigError
from fedshuffle.cli.common import app, console, fail, load_config, note, PluginsOption
from fedshuffle.cli.output import print_table


STEP_CONVENTIONS = {
    "none": "η_i = η_l for every client",
    "local_work": "η_i = η_l/τ_i (Algorithm 1: η_l/|D_i| per epoch at batch size 1)",
    "max_local_work": "η_i = η_l·τ_max/τ_i: the client with the most local steps uses η_l (Appendix F's comparison)",
}


#: the arguments of inspect_objective and settings as the options that set them here
_OPTIONS = {"sizes": "--sizes", "rounds": "--samples", "weights": "--weights"}


@app.command()
def inspect(
    method: Annotated[
        str, typer.Option(help="method name, e.g. fedavg, fedshuffle, fednova (fedshuffle show methods lists them)")
    ] = "fedavg",
    sizes: Annotated[str, typer.Option(help="client dataset sizes, e.g. 1,2,3")] = "1,2,3",
    sampler: Annotated[
        str, typer.Option(help="full, uniform, with_replacement, importance, independent, cyclic")
    ] = "full",
    cohort: Annotated[
        Optional[float], typer.Option(help="cohort size b (expected size for independent sampling)")
    ] = None,
    epochs: Annotated[str, typer.Option(help="local epochs E, or a range a-b drawn per client per round")] = "1",
    lr: Annotated[float, typer.Option(help="local step size η_l")] = 0.01,
    weights: Annotated[str, typer.Option(help="objective weights: size, uniform, or comma-separated values")] = "size",
    set_: Annotated[
        Optional[list[str]],
        typer.Option("--set", help="any setting of the round's parts, e.g. --set local.batch_size=2"),
    ] = None,
    monte_carlo: Annotated[
        bool, typer.Option("--monte-carlo", help="force Monte Carlo even when exact enumeration is possible")
    ] = False,
    samples: Annotated[
        Optional[int], typer.Option(help="Monte Carlo rounds (default 20000; 1000 per variant with --config)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    config: Annotated[
        Optional[str],
        typer.Option(
            "--config",
            help="a preset or TOML file: the objective weights ŵ and step sizes of each of its variants, on its own "
            "clients",
        ),
    ] = None,
    clients: Annotated[int, typer.Option(help="with --config: clients listed per table (--json lists all)")] = 20,
    algorithm: Annotated[
        Optional[str], typer.Option("--algorithm", hidden=True, help="the old name of --method")
    ] = None,
    plugins_: PluginsOption = None,
) -> None:
    """Which objective does this configuration minimize? Prints w, p, E[ω·1{i∈S}] and ŵ (eq. 31).

    With --config (and --set as for run): for each variant of the config, on its own clients, sampler and
    weights, the effective objective weights ŵ it minimizes, its step sizes (the theoretical values where
    the config asks for 'theory') and the problem's smoothness constants.
    """
    if algorithm is not None:  # the old name of --method, kept for one release
        note("--algorithm is now --method (the old name goes in the next release)")
        method = algorithm
    if config is not None:
        _inspect_config(config, set_, monte_carlo, 1000 if samples is None else samples, clients, as_json)
        return
    samples = 20000 if samples is None else samples
    alg, smp, size_list, w, report = _objective_of(
        method, sizes, sampler, cohort, epochs, lr, weights, set_, monte_carlo, samples
    )
    convention = alg.local.step_normalization if isinstance(alg.local.step_normalization, str) else "explicit c_i"
    if as_json:
        out = report.to_dict()
        out["step_size_convention"] = STEP_CONVENTIONS.get(convention, convention)
        out["sampler"] = smp.describe()
        print(json.dumps(out))
        return
    _print_objective(alg, smp, size_list, w, report, convention)


def _objective_of(
    method: str,
    sizes: str,
    sampler: str,
    cohort: float | None,
    epochs: str,
    lr: float,
    weights: str,
    set_: list[str] | None,
    monte_carlo: bool,
    samples: int,
) -> tuple:
    """``inspect``'s options as a built algorithm and sampler on clients of ``sizes`` (no samples), and the objective
    they minimize (:func:`~fedshuffle.analysis.objective.inspect_objective`): (algorithm, sampler, sizes, weights w,
    report). A bad option fails naming it."""
    import numpy as np
    import torch

    from fedshuffle.analysis.objective import inspect_objective
    from fedshuffle.experiments.sweep import parse_integers
    from fedshuffle.experiments.build import build_algorithm_from, build_sampler
    from fedshuffle.experiments.schema import RunSpec, parse_overrides, validate
    from fedshuffle.data import FederatedDataset, contiguous_partition, objective_weights

    from fedshuffle.core import limits

    try:
        size_list = parse_integers(sizes, "--sizes", minimum=1, ranges=False)
        limits.check_dataset(
            sum(size_list), 1, "--sizes", f"{len(size_list)} clients of {sum(size_list)} samples in all"
        )
        weight_spec = weights if weights in ("size", "uniform") else [float(v) for v in weights.split(",")]
        w = objective_weights(np.array(size_list), weight_spec)
        epoch_spec: int | list[int] = [int(v) for v in epochs.split("-")] if "-" in epochs else int(epochs)
        raw = parse_overrides(set_ or [])
        raw = {
            **raw,
            "method": {**raw.get("method", {}), "name": method},
            "local": {"lr": lr, "epochs": epoch_spec, **raw.get("local", {})},
        }
        raw["sampler"] = {"name": sampler, "cohort": cohort, **raw.get("sampler", {})}
        spec = validate(RunSpec, raw)
        alg = build_algorithm_from(spec)
        data = FederatedDataset(
            torch.zeros(sum(size_list), 1), torch.zeros(sum(size_list)), contiguous_partition(size_list), w
        )
        smp = build_sampler(spec.sampler, data)
        report = inspect_objective(
            alg, smp, np.array(size_list), w, exact=False if monte_carlo else None, rounds=samples
        )
    except ConfigError as exc:
        fail(ConfigError(_OPTIONS.get(exc.field, exc.field), exc.message) if exc.field in _OPTIONS else exc)
    except ValueError as exc:
        fail(ConfigError("--epochs/--weights", str(exc)))
    return alg, smp, size_list, w, report


def _print_objective(alg, smp, size_list: list[int], w, report, convention: str) -> None:
    """The table of ``inspect``: per client its size, w_i, p_i, E[ω_i·1{i∈S}], ŵ_i, τ_i and η_i; then the step size
    convention and whether ŵ = w."""
    rows = []
    for i in range(len(size_list)):
        se = f" ±{report.aggregation_stderr[i]:.1e}" if not report.exact else ""
        se2 = f" ±{report.effective_stderr[i]:.1e}" if not report.exact else ""
        ratio = report.effective_weights[i] / w[i] if w[i] > 0 else float("nan")
        rows.append(
            (
                str(i),
                str(size_list[i]),
                f"{w[i]:.6g}",
                f"{report.inclusion_probabilities[i]:.6g}",
                f"{report.expected_aggregation_weights[i]:.6g}{se}",
                f"{report.effective_weights[i]:.6g}{se2}",
                f"{ratio:.4f}",
                str(report.local_steps[i]),
                f"{report.step_sizes[i]:.4g}",
            )
        )
    columns = ("client", "|D_i|", "w_i", "p_i", "E[ω_i·1{i∈S}]", "ŵ_i (eq. 31)", "ŵ_i/w_i", "τ_i", "η_i")
    print_table(
        f"{alg.name} — {smp.describe()} — "
        f"{'exact enumeration' if report.exact else f'Monte Carlo, {report.samples} rounds'}",
        columns,
        rows,
        right=columns,
    )
    console.print(f"step sizes: {STEP_CONVENTIONS.get(convention, convention)}")
    if report.biased:
        console.print(
            "[yellow]warning:[/yellow] the effective objective differs from f = Σ w_i f_i (max |ŵ_i − w_i| = "
            f"{report.max_deviation:.3g}); this configuration minimizes Σ ŵ_i f_i instead."
        )
    else:
        console.print("[green]consistent:[/green] ŵ = w, this configuration minimizes f = Σ w_i f_i.")


def config_report(config: str, overrides: dict, *, monte_carlo: bool = False, samples: int = 1000) -> dict[str, dict]:
    """Per variant of a preset or TOML file: its step sizes (every setting whose role is a step size,
    ``RunSpec.step_sizes``, resolved where the config asks for 'theory'; and the local, server and meta-epoch steps the
    built algorithm takes),
    the smoothness constants of convex problems, and the objective it minimizes (:func:`inspect_objective`
    on its own clients, sampler and weights), or why that cannot be inspected (methods with client state)."""
    from fedshuffle.analysis.objective import inspect_objective
    from fedshuffle.analysis.theory import smoothness
    from fedshuffle.experiments.build import (
        build_algorithm_from,
        build_problem_and_data,
        build_sampler,
        resolve_step_sizes,
    )
    from fedshuffle.experiments.runner import check_against_data

    rows, built = {}, {}
    for label, spec in load_config(config).runs(overrides):
        key = json.dumps(
            [spec.data.model_dump(), spec.problem.model_dump(), spec.run.seed, spec.run.dtype], default=str
        )
        if key not in built:  # variants that differ only in the method share their data
            built[key] = build_problem_and_data(spec)
        problem, data = built[key]
        check_against_data(spec, data.num_clients)
        sampler = build_sampler(spec.sampler, data)
        spec, info = resolve_step_sizes(spec, problem, data, sampler)
        alg = build_algorithm_from(spec)
        server = alg.server_for(sampler)
        row = {
            "method": alg.name,
            "sampler": sampler.describe(),
            "local_lr": alg.local.lr,
            "server_lr": alg.server.lr,
            "global_lr": getattr(server, "global_lr", None),
            "step_sizes": {setting: spec.value(setting) for setting in spec.step_sizes()},
            "local_steps": alg.local.max_planned_steps(data.sizes),
            "from_theory": sorted(info.get("used", {})),
        }
        try:  # the constants of a problem that has known ones
            row["constants"] = info.get("constants") or smoothness(problem, data).to_dict()
        except ConfigError:
            row["constants"] = None
        try:
            row["objective"] = inspect_objective(
                alg,
                sampler,
                data.sizes,
                data.weights,
                exact=False if monte_carlo else None,
                rounds=samples,
                seed=spec.run.seed,
            ).to_dict()
        except ConfigError as exc:
            row["objective"] = None
            row["not_inspected"] = exc.message
        rows[label or "run"] = row
    return rows


def _print_step_sizes(config: str, rows: dict[str, dict]) -> None:
    """One row per variant: its method, the value of each step size (the settings with that role, one column each,
    resolved where 'theory'), its local steps, which came from theory, and the objective it minimizes."""
    steps = list(dict.fromkeys(setting for r in rows.values() for setting in r["step_sizes"]))
    summary = []
    for label, r in rows.items():
        obj = r["objective"]
        minimizes = (
            "—"
            if obj is None
            else f"Σ ŵ_i f_i (ŵ ≠ w by up to {obj['max_deviation']:.3g})"
            if obj["biased"]
            else "f = Σ w_i f_i"
        )
        summary.append(
            (
                label,
                r["method"],
                *(_number(r["step_sizes"].get(setting)) for setting in steps),
                str(r["local_steps"]),
                ", ".join(r["from_theory"]) or "—",
                minimizes,
            )
        )
    print_table(
        f"{config}: step sizes and the objective each variant minimizes",
        ("variant", "method", *steps, "local steps", "from theory", "minimizes"),
        summary,
        right=(*steps, "local steps"),
    )


def _number(value: object) -> str:
    return f"{value:.6g}" if isinstance(value, (int, float)) else "—"


def _inspect_config(
    config: str, set_: list[str] | None, monte_carlo: bool, samples: int, clients: int, as_json: bool
) -> None:
    from fedshuffle.experiments.schema import parse_overrides

    try:
        if samples < 1 or clients < 1:
            raise ConfigError("--samples" if samples < 1 else "--clients", "must be >= 1")
        rows = config_report(config, parse_overrides(set_ or []), monte_carlo=monte_carlo, samples=samples)
    except ConfigError as exc:
        fail(exc)
    if as_json:
        print(json.dumps(rows))
        return
    first = next(iter(rows.values()))["constants"]
    if first:
        console.print("constants: " + ", ".join(f"{k} = {v:.6g}" for k, v in first.items()))
    _print_step_sizes(config, rows)
    # ŵ per client, one table per population (variants with the same clients and weights share one)
    groups: dict[str, list[str]] = {}
    for label, r in rows.items():
        if r["objective"] is not None:
            groups.setdefault(json.dumps([r["objective"]["sizes"], r["objective"]["weights"]]), []).append(label)
    for key, labels in groups.items():
        sizes, weights = json.loads(key)
        shown = range(min(clients, len(sizes)))
        columns = ("client", "|D_i|", "w_i", *(f"ŵ_i {label}" for label in labels))
        table = [
            (
                str(i),
                str(sizes[i]),
                f"{weights[i]:.4g}",
                *(f"{rows[label]['objective']['effective_weights'][i]:.4g}" for label in labels),
            )
            for i in shown
        ]
        more = (
            f" (the first {len(shown)} of {len(sizes)} clients; --clients N or --json for more)"
            if len(shown) < len(sizes)
            else ""
        )
        modes = {rows[label]["objective"]["mode"] for label in labels}
        how = (
            "exact"
            if modes == {"exact"}
            else "Monte Carlo over "
            f"{next(rows[label]['objective']['samples'] for label in labels if 'samples' in rows[label]['objective'])} "
            "rounds where not exact (--samples)"
        )
        print_table(
            f"effective objective weights ŵ (eq. 31, {how}){more}", columns, table, right=set(columns) - {"client"}
        )
    for label, r in rows.items():
        if r["objective"] is None:
            console.print(f"{label}: objective not inspected ({r['not_inspected']})")
        elif r["objective"]["biased"]:
            console.print(
                f"[yellow]{label}[/yellow] minimizes Σ ŵ_i f_i, not f = Σ w_i f_i (max |ŵ_i − w_i| = "
                f"{r['objective']['max_deviation']:.3g})"
            )
