"""The Ray executor: a cohort split across Ray workers, each share run by the vectorized executor."""

from __future__ import annotations

import numpy as np
import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.data import FederatedDataset
from fedshuffle.executors.local import VectorizedExecutor
from fedshuffle.local.loop import LocalWork
from fedshuffle.problems import Problem


class RayExecutor:
    """The cohort split into ``workers`` shares, each run by the vectorized executor in a Ray task.

    The dataset is put in Ray's object store once per dataset and shared by every task; each round
    ships only the local work (plans, starts, step chain). Because plans carry every random choice, the
    result is the vectorized (and sequential) result whatever the number of workers or nodes.
    ``address`` joins a running cluster (``ray start --head`` on one node, ``ray start
    --address=HEAD:6379`` on the others, then ``address = "auto"``); ``None`` starts a local Ray.
    Full local gradients (FedShuffleMVR's broadcast) are computed in the driver, vectorized.
    """

    name = "ray"

    def __init__(self, workers: int = 2, address: str | None = None, chunk_size: int | None = None, memory_budget: int = 1 << 30) -> None:
        if workers < 1:
            raise ConfigError("run.ray_workers", f"must be >= 1, got {workers}")
        try:
            import ray
        except ImportError:
            raise ConfigError("run.executor", "the Ray executor needs Ray: pip install 'fedshuffle[ray]'") from None
        self._ray = ray
        self.workers, self.address = workers, address
        self.local = VectorizedExecutor(chunk_size, memory_budget)
        self._data: tuple[int, object] | None = None
        self._task = None

    def _start(self):
        ray = self._ray
        if not ray.is_initialized():
            options = {"address": self.address} if self.address else {"num_cpus": self.workers}
            ray.init(**options, include_dashboard=False, log_to_driver=False, configure_logging=False)
        if self._task is None:
            self._task = ray.remote(_run_share)
        return self._task

    def _data_ref(self, data: FederatedDataset):
        if self._data is None or self._data[0] != id(data):
            self._data = (id(data), self._ray.put(data))
        return self._data[1]

    def run(self, problem, data, work):
        if not work.plans:
            return work.start.new_zeros((0, work.start.shape[-1]))
        task = self._start()
        data_ref = self._data_ref(data)
        shares = [s for s in np.array_split(np.arange(len(work)), min(self.workers, len(work))) if len(s)]
        futures = [task.remote(self.local, problem, data_ref, work.subset(share)) for share in shares]
        return torch.cat(self._ray.get(futures))

    def client_gradients(self, problem, data, params, clients):
        return self.local.client_gradients(problem, data, params, clients)


def _run_share(executor: VectorizedExecutor, problem: Problem, data: FederatedDataset, work: LocalWork) -> torch.Tensor:
    return executor.run(problem, data, work)
