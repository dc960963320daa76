"""PyTorch's operator threads for a block of code, and how many a run's problem should use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from contextlib import contextmanager

import torch


@contextmanager
def operator_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads (``torch.set_num_threads``), restoring the setting after it.

    One thread suits work made of small operations, and code that runs its own threads: a small dense
    eigendecomposition took 4 ms on one thread and 5 ms to 8 s on two while another process kept the
    cores busy (each parallel call waits for the scheduler to run all its threads).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_threads(problem: Any, device: str | torch.device) -> tuple[int, str]:
    """(operator threads, reason) for a run of ``problem`` on ``device``, within this process' current count.

    Problems with closed-form batched gradients (quadratic, logistic and softmax regression, the MLP) get one
    thread on the CPU: their operators take microseconds to a few milliseconds, so a second thread saves little
    and, while another process keeps the cores busy, costs much more — a one-seed run of the RR-CLI phishing
    preset took 147 s with two threads and 18.8 s with one on a busy two-core machine. Parallelism for them
    comes from running runs side by side (``--workers``). ``torch.nn.Module`` problems keep the current count:
    the threaded executor runs one client per thread, and a convolution's operators are large enough to split.
    On CUDA the count only affects host code and is kept.
    """
    from fedshuffle.problems.modules import ModuleProblem

    current = torch.get_num_threads()
    if torch.device(device).type != "cpu":
        return current, f"{torch.device(device).type}: operator threads unchanged"
    if isinstance(problem, ModuleProblem):
        return current, f"{problem.name} (a module): {current} threads, the threaded executor's clients or one client's operators"
    return 1, f"{problem.name} has small closed-form operators: one thread; --workers runs several runs at once on more cores"
