"""Executors run a cohort's planned local work; every executor gives the same numbers."""

from fedshuffle.executors.choice import EXECUTORS, batches_replicas, choose, make_executor
from fedshuffle.executors.local import Executor, SequentialExecutor, ThreadedExecutor, VectorizedExecutor


def __getattr__(name: str):
    if name == "RayExecutor":  # imports Ray's machinery only when asked for
        from fedshuffle.executors.ray import RayExecutor

        return RayExecutor
    raise AttributeError(name)


__all__ = [
    "EXECUTORS",
    "Executor",
    "batches_replicas",
    "choose",
    "make_executor",
    "RayExecutor",
    "SequentialExecutor",
    "ThreadedExecutor",
    "VectorizedExecutor",
]
