"""Executors run a cohort's planned local work; every executor gives the same numbers."""

from fedshuffle.executors.local import Executor, SequentialExecutor, VectorizedExecutor


def __getattr__(name: str):
    if name == "RayExecutor":  # imports Ray's machinery only when asked for
        from fedshuffle.executors.ray import RayExecutor

        return RayExecutor
    raise AttributeError(name)


__all__ = ["Executor", "RayExecutor", "SequentialExecutor", "VectorizedExecutor"]
