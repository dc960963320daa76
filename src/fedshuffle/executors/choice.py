"""Executors by name, and ``auto``: the fastest correct executor for a problem on a device.

Every executor gives the same numbers (the equivalence tests), so ``auto`` chooses on speed alone,
by what ``benchmarks/`` measured:

* problems with batched closed-form gradients (quadratic, logistic, softmax regression, the MLP) →
  ``vectorized``: one masked loop over the whole cohort pays the per-step dispatch once for all
  clients (``benchmarks/convex.py``: 8× over sequential at cohort 100);
* ``torch.nn.Module`` problems on the CPU, and recurrent or dropout modules anywhere → ``sequential``:
  each client's steps run on the module's own parameters in place, as a hand-written PyTorch loop
  (``benchmarks/cross_device_cnn.py``, ``benchmarks/networks.py``: a vmap over clients is slower
  on CPU, and LSTMs have no batching rule);
* modules without dropout or recurrent layers on CUDA → ``vectorized`` (one vmap over the chunk).
"""

from __future__ import annotations

import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.executors.local import Executor, LocalExecutor, SequentialExecutor, VectorizedExecutor
from fedshuffle.problems import Problem

EXECUTORS = ("auto", "sequential", "vectorized", "ray")


def choose(problem: Problem, device: str | torch.device = "cpu") -> tuple[str, str]:
    """(executor name, one-line reason) that ``auto`` picks for ``problem`` on ``device``."""
    from fedshuffle.problems.modules import ModuleProblem

    device = torch.device(device)
    if not isinstance(problem, ModuleProblem):
        return "vectorized", f"{problem.name} has batched closed-form gradients: the cohort as one masked loop"
    if problem.recurrent:
        return "sequential", f"{problem.name} has recurrent layers (no batching rule): clients one after another, parameters updated in place"
    if problem.stochastic:
        return "sequential", f"{problem.name} has dropout: clients one after another, parameters updated in place"
    if device.type == "cuda":
        return "vectorized", f"{problem.name} on CUDA: the cohort as one vmap per step"
    return "sequential", f"{problem.name} on {device.type}: clients one after another, parameters updated in place (a hand-written PyTorch loop)"


def make_executor(
    name: str, problem: Problem | None = None, device: str | torch.device = "cpu", chunk_size: int | None = None, memory_budget: int = 1 << 30,
    ray_workers: int = 2, ray_address: str | None = None,
) -> Executor:
    """The executor ``name`` (one of :data:`EXECUTORS`); ``auto`` needs the ``problem`` and records its choice
    in the executor's ``chosen`` attribute ("auto: <name> — <reason>")."""
    if name not in EXECUTORS:
        raise ConfigError("run.executor", f"unknown executor {name!r}; accepted: {', '.join(EXECUTORS)}")
    chosen = None
    if name == "auto":
        if problem is None:
            raise ConfigError("run.executor", "'auto' chooses by the problem; give the problem")
        name, reason = choose(problem, device)
        chosen = f"auto: {name} — {reason}"
    if name == "ray":
        from fedshuffle.executors.ray import RayExecutor

        return RayExecutor(ray_workers, ray_address, chunk_size, memory_budget)
    executor: LocalExecutor = VectorizedExecutor(chunk_size, memory_budget) if name == "vectorized" else SequentialExecutor()
    executor.chosen = chosen
    return executor
