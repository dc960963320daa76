"""Executors by name, and ``auto``: the fastest correct executor for a problem on a device (and its operator threads,
:func:`run_threads`).

Every executor gives the same numbers (the equivalence tests), so ``auto`` chooses on speed alone,
by what ``benchmarks/`` measured:

* problems with batched closed-form gradients (quadratic, logistic, softmax regression, the MLP) →
  ``vectorized``: one masked loop over the whole cohort pays the per-step dispatch once for all
  clients (``benchmarks/convex.py``: 8× over sequential at cohort 100);
* ``torch.nn.Module`` problems on the CPU → ``threaded`` when PyTorch has more than one thread: clients
  in parallel, each as a hand-written PyTorch loop on one core (``benchmarks/cross_device_cnn.py``:
  faster than one client's operators split across the cores); ``sequential`` with one thread, and for
  modules with dropout (their masks come from the global generator);
* recurrent or dropout modules elsewhere → ``sequential`` (``benchmarks/networks.py``: a vmap over
  clients is slower on CPU, and LSTMs have no batching rule);
* modules without dropout or recurrent layers on CUDA → ``vectorized`` (one vmap over the chunk).
"""

from __future__ import annotations

import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.executors.local import Executor, LocalExecutor, SequentialExecutor, ThreadedExecutor, VectorizedExecutor
from fedshuffle.problems import Problem
from fedshuffle.problems.modules import ModuleProblem

EXECUTORS = ("auto", "sequential", "vectorized", "threaded", "ray")


def choose(problem: Problem, device: str | torch.device = "cpu", threads: int | None = None) -> tuple[str, str]:
    """(executor name, one-line reason) that ``auto`` picks for ``problem`` on ``device`` with ``threads`` CPU
    threads (default: PyTorch's, one per core)."""
    device = torch.device(device)
    threads = torch.get_num_threads() if threads is None else threads
    if not isinstance(problem, ModuleProblem):
        return "vectorized", f"{problem.name} has batched closed-form gradients: the cohort as one masked loop"
    if problem.stochastic:
        return "sequential", f"{problem.name} has dropout: clients one after another, parameters updated in place"
    if device.type == "cpu" and threads > 1:
        return (
            "threaded",
            f"{problem.name} on the CPU: {threads} clients at a time, one thread each, parameters updated in place",
        )
    if problem.recurrent:
        return (
            "sequential",
            f"{problem.name} has recurrent layers (no batching rule): clients one after another, parameters updated "
            "in place",
        )
    if device.type == "cuda":
        return "vectorized", f"{problem.name} on CUDA: the cohort as one vmap per step"
    return (
        "sequential",
        f"{problem.name} on {device.type}: clients one after another, parameters updated in place (a hand-written "
        "PyTorch loop)",
    )


def make_executor(
    name: str,
    problem: Problem | None = None,
    device: str | torch.device = "cpu",
    chunk_size: int | None = None,
    memory_budget: int = 1 << 30,
    ray_workers: int = 2,
    ray_address: str | None = None,
    threads: int | None = None,
    ray_retries: int = 3,
) -> Executor:
    """The executor ``name`` (one of :data:`EXECUTORS`); ``auto`` needs the ``problem`` and records its choice
    in the executor's ``chosen`` attribute ("auto: <name> — <reason>"). Off the CPU the compiled loop is switched off,
    and ``chosen`` says so (:data:`COMPILED_OFF`); the random streams that plan a round stay compiled: they run on the
    CPU whatever the device."""
    if name not in EXECUTORS:
        raise ConfigError("run.executor", f"unknown executor {name!r}; accepted: {', '.join(EXECUTORS)}")
    chosen = None
    if name == "auto":
        if problem is None:
            raise ConfigError("run.executor", "'auto' chooses by the problem; give the problem")
        name, reason = choose(problem, device, threads)
        chosen = f"auto: {name} — {reason}"
    if name == "ray":
        from fedshuffle.executors.ray import RayExecutor

        return RayExecutor(ray_workers, ray_address, chunk_size, memory_budget, max_retries=ray_retries)
    if name == "threaded":
        threaded = ThreadedExecutor(threads)
        threaded.chosen = chosen
        return threaded
    executor: LocalExecutor = (
        VectorizedExecutor(chunk_size, memory_budget) if name == "vectorized" else SequentialExecutor()
    )
    if executor.compiled and torch.device(device).type != "cpu":
        executor.compiled = False
        chosen = f"{chosen + '; ' if chosen else ''}{COMPILED_OFF.format(device=torch.device(device).type)}"
    executor.chosen = chosen
    return executor


#: what a run on another device than the CPU is told about the compiled loop (:mod:`fedshuffle.local.fused`)
COMPILED_OFF = "compiled loop off on {device}: numba compiles for the CPU; the local loop runs as PyTorch operators"


def run_threads(problem: Problem, device: str | torch.device) -> tuple[int, str]:
    """(operator threads, reason) for a run of ``problem`` on ``device``, within this process' current count.

    Problems with closed-form batched gradients (quadratic, logistic and softmax regression, the MLP) get one
    thread on the CPU: their operators take microseconds to a few milliseconds, so a second thread saves little
    and, while another process keeps the cores busy, costs much more — a one-seed run of the RR-CLI phishing
    preset took 147 s with two threads and 18.8 s with one on a busy two-core machine. Parallelism for them
    comes from running runs side by side (``--workers``). ``torch.nn.Module`` problems keep the current count:
    the threaded executor runs one client per thread, and a convolution's operators are large enough to split.
    On CUDA the count only affects host code and is kept.
    """
    current = torch.get_num_threads()
    if torch.device(device).type != "cpu":
        return current, f"{torch.device(device).type}: operator threads unchanged"
    if isinstance(problem, ModuleProblem):
        return (
            current,
            f"{problem.name} (a module): {current} threads, the threaded executor's clients or one client's operators",
        )
    return (
        1,
        f"{problem.name} has small closed-form operators: one thread; --workers runs several runs at once on more "
        "cores",
    )
