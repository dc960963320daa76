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

from typing import Annotated

import torch
from pydantic import Field

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Example, Registry
from fedshuffle.executors.local import Executor, LocalExecutor, SequentialExecutor, ThreadedExecutor, VectorizedExecutor
from fedshuffle.problems import Problem
from fedshuffle.problems.modules import ModuleProblem

#: executors by the name ``[run] executor`` takes; an entry's keyword parameters other than ``problem`` and ``device``
#: are its settings, given in ``[run]`` (``chunk_size``, ``threads``, ...). An entry declared with
#: ``batches_replicas=True`` runs in this process with more than one member per loop or thread pool, so a sweep runs
#: its replicas as one simulation (:mod:`fedshuffle.replicas`).
EXECUTORS = Registry("run.executor", runtime=("problem", "device"), noun="executor")

ChunkSize = Annotated[
    int | None,
    Field(ge=1, description="clients per batched chunk (default: as many as fit in memory_budget_mb)"),
]
MemoryBudget = Annotated[int, Field(ge=1, description="memory one batched chunk may use, in MiB")]
Threads = Annotated[
    int | None,
    Field(ge=1, description="clients run in parallel, one CPU thread each (default: PyTorch's thread count)"),
]


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
    name: str, problem: Problem | None = None, device: str | torch.device = "cpu", **settings: object
) -> Executor:
    """The executor ``name`` (an entry of :data:`EXECUTORS`) with its ``settings`` (``chunk_size=4``, ``threads=2``;
    None: the default, as in ``[run]``; a setting it does not take is refused naming it); ``auto`` needs the
    ``problem`` and records its choice in the executor's ``chosen`` attribute ("auto: <name> — <reason>"). Off the CPU
    the compiled loop is switched off, and ``chosen`` says so (:data:`COMPILED_OFF`); the random streams that plan a
    round stay compiled: they run on the CPU whatever the device."""
    try:
        given = {k: v for k, v in settings.items() if v is not None}
        return EXECUTORS[name].build(given, problem=problem, device=torch.device(device))
    except ConfigError as exc:  # a setting's error, as the [run] section names it
        if exc.field.startswith("run."):
            raise
        raise ConfigError(f"run.{exc.field}", exc.message) from None


def _on_device(executor: LocalExecutor, device: torch.device) -> LocalExecutor:
    """``executor`` with its compiled loop off on a device other than the CPU (:data:`COMPILED_OFF` in ``chosen``)."""
    if executor.compiled and device.type != "cpu":
        executor.compiled = False
        executor.chosen = COMPILED_OFF.format(device=device.type)
    return executor


def sequential_executor(device: torch.device) -> SequentialExecutor:
    return _on_device(SequentialExecutor(), device)


def vectorized_executor(
    device: torch.device, chunk_size: ChunkSize = None, memory_budget_mb: MemoryBudget = 1024
) -> VectorizedExecutor:
    return _on_device(VectorizedExecutor(chunk_size, memory_budget_mb << 20), device)


def threaded_executor(threads: Threads = None) -> ThreadedExecutor:
    return ThreadedExecutor(threads)


def ray_executor(
    chunk_size: ChunkSize = None,
    memory_budget_mb: MemoryBudget = 1024,
    ray_workers: Annotated[int, Field(ge=1, description="shares the cohort is split into (one Ray task each)")] = 2,
    ray_address: Annotated[
        str | None, Field(description="a running cluster ('auto' or HEAD:6379); default starts a local Ray")
    ] = None,
    ray_retries: Annotated[
        int, Field(ge=0, description="times a task whose worker or node dies is run again (0: such a loss fails)")
    ] = 3,
) -> Executor:
    from fedshuffle.executors.ray import RayExecutor

    return RayExecutor(ray_workers, ray_address, chunk_size, memory_budget_mb << 20, max_retries=ray_retries)


def auto_executor(
    problem: Problem | None,
    device: torch.device,
    chunk_size: ChunkSize = None,
    memory_budget_mb: MemoryBudget = 1024,
    threads: Threads = None,
) -> Executor:
    if problem is None:
        raise ConfigError("run.executor", "'auto' chooses by the problem; give the problem")
    name, reason = choose(problem, device, threads)
    taken = {"chunk_size": chunk_size, "memory_budget_mb": memory_budget_mb, "threads": threads}
    entry = EXECUTORS[name]
    executor = entry.build({k: v for k, v in taken.items() if k in entry.setting_names()}, device=device)
    executor.chosen = f"auto: {name} — {reason}" + (f"; {executor.chosen}" if executor.chosen else "")
    return executor


EXECUTORS.add(
    "auto",
    auto_executor,
    "the fastest executor for the problem and device: vectorized, threaded or sequential (choice.choose)",
    batches_replicas=True,
    example=Example(),
)
EXECUTORS.add(
    "sequential",
    sequential_executor,
    "the reference: one client after another, parameters updated in place",
    example=Example(),
)
EXECUTORS.add(
    "vectorized",
    vectorized_executor,
    "the cohort as masked batched loops, in chunks that fit a memory budget",
    batches_replicas=True,
    example=Example(),
)
EXECUTORS.add(
    "threaded",
    threaded_executor,
    "clients in threads of this process, each one as the sequential reference",
    batches_replicas=True,
    example=Example(),
)
EXECUTORS.add(
    "ray", ray_executor, "the cohort split into shares run by the vectorized executor in Ray tasks", example=Example()
)


def batches_replicas(name: str) -> bool:
    """Whether executor ``name`` declares that a sweep runs replicas on it as one simulation."""
    return name in EXECUTORS and bool(EXECUTORS[name].defaults.get("batches_replicas"))


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
