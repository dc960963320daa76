"""The rounds of a fedshuffle run on Flower, driven by the loop of ``fedshuffle run``.

A Flower round is the loop's step (:class:`FlowerRounds`): :meth:`~.strategy.FedShuffleStrategy.configure_train`,
the messages' exchange and :meth:`~.strategy.FedShuffleStrategy.aggregate_train`; the
:class:`~fedshuffle.experiments.loop.RoundLoop` owns the evaluations, the divergence stop, the checkpoints and the
results folder (:func:`results_folder`), as for ``fedshuffle run``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

# first: a clear message where Flower is not installed
from fedshuffle.integrations.flower.messages import tensors_record  # isort: skip
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedshuffle.experiments.loop import Callback, Driver, RoundLoop
from fedshuffle.experiments.runner import RunFolder
from fedshuffle.experiments.schema import slug
from fedshuffle.integrations.flower.common import FederatedRun

if TYPE_CHECKING:
    from fedshuffle.integrations.flower.strategy import FedShuffleStrategy


@dataclass
class Outcome:
    """Flower's :class:`Result` of a run, and how the run ended (the loop's status or message)."""

    result: Result
    status: str


def run_rounds(
    s: FedShuffleStrategy,
    grid: Grid,
    train_config: ConfigRecord,
    evaluate: Callable[[int, ArrayRecord], MetricRecord | None],
    num_rounds: int | None,
) -> Outcome:
    """The run's rounds through the loop (into ``s.folder`` where there is one), up to ``num_rounds``."""
    spec = s.run.spec.run
    rounds = FlowerRounds(s, grid, train_config, evaluate)
    executor = {
        "name": "flower",
        "digest": s.run.digest,
        "nodes": {str(k): v for k, v in sorted(s.nodes.items())},
        "evaluation": "both" if s.both else "federated" if s.federated else "central",
    }
    driver = Driver(s.half, rounds.step, rounds.score, executor, s.step_sizes)
    if s.folder is None:
        status, message = RoundLoop(
            driver, rounds=spec.rounds, eval_every=spec.eval_every, bandwidth_mib_s=spec.bandwidth_mib_s
        ).run([rounds], num_rounds)
        return Outcome(rounds.result, message or status)
    outcome = s.folder.run(
        lambda: driver, resume=s.resume, experiment=s.run.experiment, callbacks=[rounds], until=num_rounds
    )
    if not rounds.result.arrays:  # finished before, and not run again: its final model
        final = torch.from_numpy(np.load(s.folder.run_dir / "final_params.npy")).to(s.half.dtype)
        rounds.result.arrays = tensors_record({"model": final})
    return Outcome(rounds.result, outcome.message or outcome.status)


def results_folder(run: FederatedRun, out: str | Path, resume: bool) -> RunFolder:
    """``out/<variant>/seed-<s>``, written by the loop of ``fedshuffle run``; checked before any message."""
    run_dir = Path(out) / (slug(run.label) if run.label else "") / f"seed-{run.seed}"
    folder = RunFolder(
        run_dir, run.spec, label=run.label, out_option="run-config.out", resume_option="run-config resume=true"
    )
    folder.check(resume=resume, extend=False)
    return folder


class FlowerRounds(Callback):
    """The loop's step and scores on Flower: a round is :meth:`~FedShuffleStrategy.configure_train`, the messages'
    exchange and :meth:`~FedShuffleStrategy.aggregate_train`; Flower's :class:`Result` follows the run."""

    def __init__(
        self,
        strategy: FedShuffleStrategy,
        grid: Grid,
        train_config: ConfigRecord,
        evaluate: Callable[[int, ArrayRecord], MetricRecord | None],
    ) -> None:
        self.strategy, self.grid, self.train_config, self.evaluate = strategy, grid, train_config, evaluate
        self.result = Result()

    def on_start(self, loop: RoundLoop) -> None:
        s = self.strategy
        self.result.arrays = s.initial_arrays()  # a resumed run's model
        if loop.sim.counters.rounds:
            s._log(f"resumed {s.run.label or s.run.spec.method.name!r} at round {loop.sim.counters.rounds}")

    def step(self) -> None:
        s, r = self.strategy, self.strategy.half.counters.rounds + 1
        messages = list(s.configure_train(r, self.result.arrays, self.train_config, self.grid))
        arrays, reported = s.aggregate_train(r, s.exchange(self.grid, messages, s.round_timeout))
        self.result.arrays, self.result.train_metrics_clientapp[r] = arrays, reported
        secured = (
            f", SecAgg+ sum of {int(reported['secagg_nodes'])} node(s), {int(reported['secagg_bytes_up'])} B up"
            if "secagg_nodes" in reported
            else ""
        )
        s._log(
            f"round {r}/{s.run.spec.run.rounds}: {int(reported['members'])} member(s), {int(reported['dropped'])} "
            f"dropped, {reported['seconds']:.2f} s{secured}"
        )

    def score(self) -> dict[str, float]:
        r = self.strategy.half.counters.rounds
        evaluated = self.result.evaluate_metrics_serverapp[r] = self.evaluate(r, self.result.arrays)
        return dict(evaluated or {})
