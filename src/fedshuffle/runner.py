"""Running experiments: seeded runs with metrics, checkpoints, divergence handling and results on disk.

Layout of a results folder::

    OUT/
      summary.json              final metrics per variant (mean ± std over seeds)
      plot.png, plot.pdf        the comparison figure
      <variant>/seed-<s>/
        config.json             resolved run spec, seed, versions
        metrics.csv             one row per evaluation
        summary.json            status (complete | diverged), final metrics
        final_params.npy        final global model, flat float64
        checkpoint.pt           latest checkpoint (resume with --resume)
"""

from __future__ import annotations

import io
import json
import math
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .algorithms import Simulation
from .config import Experiment, RunSpec, build_algorithm_from, build_executor, build_problem_and_data, build_sampler, resolve_step_sizes, slug
from .data import FederatedDataset
from .problems import Problem
from .theory import solution
from .results import plot_comparison, summarize, write_atomic, write_json, write_metrics

DTYPES = {"float64": torch.float64, "float32": torch.float32}


class Evaluator:
    """Metrics of the global model: f(x), f − f*, ‖x − x*‖², ‖∇f(x)‖², accuracies, test loss."""

    def __init__(self, problem: Problem, data: FederatedDataset) -> None:
        self.problem, self.data = problem, data
        self.sample_weights = data.sample_weights()
        solved = solution(problem, data.to(torch.float64, "cpu"))
        self.x_star = solved[0].to(data.features.device, data.features.dtype) if solved else None
        self.f_star = solved[1] if solved else None

    def __call__(self, params: torch.Tensor) -> dict[str, float | None]:
        f, X, Y, s = self.problem, self.data.features, self.data.labels, self.sample_weights
        loss = float(f.weighted_loss(params, X, Y, s))
        out: dict[str, float | None] = {"loss": loss, "grad_norm_sq": float(f.weighted_gradient(params, X, Y, s).pow(2).sum())}
        out["f_gap"] = loss - self.f_star if self.f_star is not None else None
        out["dist_sq"] = float((params - self.x_star).pow(2).sum()) if self.x_star is not None else None
        out["train_accuracy"] = f.accuracy(params, X, Y)
        if self.data.test_features is not None:
            out["test_loss"] = float(f.losses(params, self.data.test_features, self.data.test_labels).mean())
            out["test_accuracy"] = f.accuracy(params, self.data.test_features, self.data.test_labels)
        return out


@dataclass
class RunOutcome:
    run_dir: Path
    status: str
    final: dict[str, Any]
    message: str = ""


def environment() -> dict[str, str]:
    try:
        version = metadata.version("fedshuffle")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"fedshuffle": version, "python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__, "platform": platform.platform()}


def run_single(spec: RunSpec, run_dir: Path, seed: int, *, resume: bool = False, on_round: Callable[[int], None] | None = None) -> RunOutcome:
    """Run one seeded spec into ``run_dir``; with ``resume``, continue from its checkpoint."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if resume and summary_path.exists():
        done = json.loads(summary_path.read_text())
        if done.get("status") in ("complete", "diverged"):
            if on_round:
                on_round(spec.run.rounds)
            return RunOutcome(run_dir, done["status"], done.get("final", {}), done.get("message", ""))
    spec = spec.model_copy(update={"run": spec.run.model_copy(update={"seed": seed})})
    problem, data = build_problem_and_data(spec)
    sampler = build_sampler(spec.sampler, data)
    algorithm_spec, step_sizes = resolve_step_sizes(spec.algorithm, problem, data, sampler)
    algorithm = build_algorithm_from(algorithm_spec, spec.run.rounds)
    sim = Simulation(problem, data, algorithm, sampler, seed=seed, dtype=DTYPES[spec.run.dtype], executor=build_executor(spec.run), device=spec.run.device)
    evaluator = Evaluator(problem, sim.data)
    write_json(run_dir / "config.json", {"spec": spec.model_dump(), "seed": seed, "step_sizes": step_sizes, "environment": environment()})

    rows: list[dict[str, Any]] = []
    checkpoint = run_dir / "checkpoint.pt"
    if resume and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        sim.load_state_dict(saved["simulation"])
        rows = saved["rows"]
    total_samples = data.num_samples

    def record() -> dict[str, Any]:
        c = sim.counters
        row = {"round": c.rounds, "sample_gradients": c.sample_gradients, "epochs": c.sample_gradients / total_samples, "bytes_up": c.bytes_up, "bytes_down": c.bytes_down}
        row.update(evaluator(sim.params))
        rows.append(row)
        return row

    def save_checkpoint() -> None:
        buf = io.BytesIO()
        torch.save({"simulation": sim.state_dict(), "rows": rows}, buf)
        write_atomic(checkpoint, buf.getvalue())
        write_metrics(run_dir / "metrics.csv", rows)

    if not rows:
        record()
    status, message = "complete", ""
    every, ckpt_every = spec.run.eval_every, spec.run.checkpoint_every
    if on_round and sim.counters.rounds:
        on_round(sim.counters.rounds)
    while sim.counters.rounds < spec.run.rounds:
        sim.step()
        r = sim.counters.rounds
        finite = bool(torch.isfinite(sim.params).all())
        if not finite or r % every == 0 or r == spec.run.rounds:
            row = record()
            if not finite or not math.isfinite(row["loss"]):
                status, message = "diverged", f"diverged at round {r}: {'model' if not finite else 'loss'} is not finite"
                break
            if ckpt_every == 0 or r % ckpt_every == 0:
                save_checkpoint()
            else:
                write_metrics(run_dir / "metrics.csv", rows)
        elif ckpt_every and r % ckpt_every == 0:
            save_checkpoint()
        if on_round:
            on_round(1)
    write_metrics(run_dir / "metrics.csv", rows)
    npy = io.BytesIO()
    np.save(npy, sim.params.detach().double().cpu().numpy())
    write_atomic(run_dir / "final_params.npy", npy.getvalue())
    final = {k: v for k, v in rows[-1].items()}
    write_json(summary_path, {"status": status, "message": message, "final": final, "rounds": sim.counters.rounds, "seed": seed})
    return RunOutcome(run_dir, status, final, message)


def run_experiment(
    experiment: Experiment, out_dir: Path, *, overrides: Mapping[str, Any] | None = None, resume: bool = False, show_progress: bool = True
) -> dict[str, Any]:
    """All variants × seeds of an experiment into ``out_dir``, then the plot and an overall summary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    runs = experiment.runs(overrides)
    jobs = [(label, spec, seed) for label, spec in runs for seed in experiment.seeds(spec)]
    out_dir = Path(out_dir)
    console = Console(stderr=True)
    outcomes: dict[str, list[RunOutcome]] = {}
    total_rounds = sum(spec.run.rounds for _, spec, _ in jobs)
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, disable=not show_progress, transient=False,
    ) as progress:
        task = progress.add_task(experiment.experiment.name, total=total_rounds)
        for label, spec, seed in jobs:
            progress.update(task, description=f"{experiment.experiment.name}: {label or 'run'} (seed {seed})")
            run_dir = out_dir / (slug(label) if label else "") / f"seed-{seed}"
            outcome = run_single(spec, run_dir, seed, resume=resume, on_round=lambda k: progress.advance(task, k))
            if outcome.status != "complete":
                progress.advance(task, spec.run.rounds - outcome.final.get("round", 0))
                console.print(f"[yellow]{label or 'run'} seed {seed}: {outcome.message}; results kept in {run_dir}")
            outcomes.setdefault(label, []).append(outcome)
    plot_spec = runs[0][1].plot
    plots = plot_comparison(
        {label: [o.run_dir / "metrics.csv" for o in outs] for label, outs in outcomes.items()}, out_dir / "plot",
        metric=plot_spec.metric, x=plot_spec.x, log_y=plot_spec.log_y, band=plot_spec.band,
        title=experiment.experiment.title or experiment.experiment.name,
    )
    summary = {
        "experiment": experiment.experiment.model_dump(),
        "variants": {
            label or "run": {
                "status": [o.status for o in outs],
                "final": {m: summarize(o.final.get(m) for o in outs) for m in ("loss", "f_gap", "dist_sq", "grad_norm_sq", "train_accuracy", "test_accuracy") if any(o.final.get(m) is not None for o in outs)},
                "runs": [str(o.run_dir.relative_to(out_dir)) for o in outs],
            }
            for label, outs in outcomes.items()
        },
        "plots": [p.name for p in plots],
    }
    write_json(out_dir / "summary.json", summary)
    return summary
