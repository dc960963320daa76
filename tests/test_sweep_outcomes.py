"""The sweep's one outcome handler, for runs in this process and in worker processes: every outcome in its job's
place, the progress bar at each job's rounds, a run that did not complete reported, and the first folder that cannot
be written stopping the jobs not yet started."""

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from fedshuffle.core.errors import ResultsError
from fedshuffle.experiments import sweep
from fedshuffle.experiments.schema import Experiment, validate
from fedshuffle.experiments.sweep import UNWRITABLE, Job, Outcome, jobs_for, run_jobs


def _jobs(tmp_path: Path, seeds: int) -> list[Job]:
    experiment = validate(
        Experiment,
        {"data": {"client_sizes": [2, 3]}, "local": {"lr": 0.1}, "run": {"rounds": 3}, "method": {"name": "fedavg"}},
    )
    return jobs_for(experiment, tmp_path, [{}], seeds=list(range(seeds)))


class _Queued(Future):
    """A group not started yet: cancelled, it is done for ``wait`` as the pool makes it when it comes to it."""

    def cancel(self) -> bool:
        cancelled = super().cancel()
        self.set_running_or_notify_cancel()
        return cancelled


class _Bar:
    def __init__(self) -> None:
        self.completed = 0

    def advance(self, task: object, k: int) -> None:
        self.completed += k


class _Console:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, text: str, **_: object) -> None:
        self.lines.append(text)


def test_in_process_the_first_unwritable_folder_stops_the_groups_not_started(tmp_path, monkeypatch):
    jobs = _jobs(tmp_path, 3)
    ran = []

    def execute_group(group, resume, extend, experiment, on_rounds):
        ran.append(group[0].seed)
        on_rounds[0](1)
        status = UNWRITABLE if group[0].seed == 1 else "diverged"
        return [Outcome(job, status, {}, f"seed {job.seed}") for job in group]

    monkeypatch.setattr(sweep, "_execute_group", execute_group)
    monkeypatch.setenv("FEDSHUFFLE_REPLICAS", "0")  # one group per seed
    with pytest.raises(ResultsError, match="seed 1"):
        run_jobs(jobs, show_progress=False)
    assert ran == [0, 1]


def test_pooled_outcomes_take_their_jobs_places_and_the_first_unwritable_cancels_what_has_not_started(tmp_path):
    jobs = _jobs(tmp_path, 4)
    bar, console = _Bar(), _Console()
    board = sweep._Outcomes(jobs, bar, None, console)
    done, unwritable, waiting = Future(), Future(), _Queued()
    done.set_result([Outcome(jobs[2], "diverged", {}, "nan"), Outcome(jobs[0], "complete")])
    unwritable.set_result([Outcome(jobs[1], UNWRITABLE, {}, "cannot write")])

    class Ticks:
        items = [(2, 1)]

        def get_nowait(self):
            if not self.items:
                raise sweep.queue_mod.Empty
            return self.items.pop()

    never_cancelled = threading.Timer(5.0, lambda: waiting.cancelled() or waiting.set_result([]))
    never_cancelled.start()  # a group left waiting ends the collection after 5 s (the test fails), not hanging
    sweep._collect(board, {done: [2, 0], unwritable: [1], waiting: [3]}, Ticks())
    never_cancelled.cancel()
    assert waiting.cancelled() and board.done_rounds == [3, 3, 3, 0] and bar.completed == 9
    assert [o.job.seed for o in board.results()] == [0, 1, 2]
    assert len(console.lines) == 1 and "seed 2" in console.lines[0] and "diverged: nan" in console.lines[0]
    with pytest.raises(ResultsError, match="cannot write"):
        board.raise_unwritable()
