"""The same FedAvg round in Flower's simulation engine and in pfl-research's simulated backend.

Both train the network of :class:`fedshuffle.problems.CNN` as a plain ``torch.nn.Module`` on the
users' data of :func:`benchmarks.cross_device_cnn.user_data`, one local epoch of batch 10 with
SGD(lr 0.1), and average the models weighted by examples (server lr 1). Seconds per round are
taken between the framework's own end-of-round hooks, after the warm-up rounds. Flower's engine runs on a Ray
started here first, on 127.0.0.1 only (:func:`loopback_ray`).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Iterator

import numpy as np
import torch

from benchmarks.cross_device_cnn import BATCH, CLASSES, COHORT, LR, PER_USER, SHAPE, USERS, user_data


def make_module() -> torch.nn.Module:
    """The benchmark's CNN (pfl-research's, without dropout) with the initial weights fedshuffle's runs start from."""
    from fedshuffle.problems import CNN

    problem = CNN(SHAPE, CLASSES, dropout=False)
    module = copy.deepcopy(problem.module)
    torch.nn.utils.vector_to_parameters(
        problem.init_params(torch.Generator().manual_seed(0), torch.float32), module.parameters()
    )
    return module


def local_epoch(module: torch.nn.Module, user: int, seed: int) -> None:
    x, y = (torch.from_numpy(a) for a in user_data(user))
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(PER_USER))
    for s in range(PER_USER // BATCH):
        rows = order[s * BATCH : (s + 1) * BATCH]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(x[rows]), y[rows]).backward()
        opt.step()


def _summary(stamps: list[float], warmup: int, cpu_stamps: list[float] | None = None) -> dict[str, float]:
    times = np.diff(stamps)[warmup:]
    out = {
        "median_s": statistics.median(times),
        "min_s": float(min(times)),
        "max_s": float(max(times)),
        "rounds": len(times),
        "warmup": warmup,
    }
    if cpu_stamps:
        out["cpu_median_s"] = statistics.median(np.diff(cpu_stamps)[warmup:])
    return out


def flower_round_seconds(warmup: int, repeats: int) -> dict[str, float]:
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)  # one core per client actor; the actors fill the machine
        module = make_module()
        module.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        local_epoch(module, int(context.node_config["partition-id"]), seed=int(context.node_id) % 2**31)
        reply = RecordDict(
            {"arrays": ArrayRecord(module.state_dict()), "metrics": MetricRecord({"num-examples": PER_USER})}
        )
        return Message(reply, reply_to=msg)

    stamps: list[float] = []

    class TimedFedAvg(FedAvg):
        def aggregate_train(self, server_round, replies):
            out = super().aggregate_train(server_round, replies)
            stamps.append(time.perf_counter())
            return out

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = TimedFedAvg(
            fraction_train=COHORT / USERS,
            min_train_nodes=COHORT,
            fraction_evaluate=0.0,
            min_evaluate_nodes=0,
            min_available_nodes=USERS,
        )
        stamps.append(time.perf_counter())
        strategy.start(grid=grid, initial_arrays=ArrayRecord(make_module().state_dict()), num_rounds=warmup + repeats)

    cores = torch.get_num_threads()
    with loopback_ray(cores):
        resources = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
        run_simulation(server_app, client_app, num_supernodes=USERS, backend_config=resources)
    return {**_summary(stamps, warmup), "actors": cores}


@contextlib.contextmanager
def loopback_ray(cpus: int) -> Iterator[None]:
    """A Ray of ``cpus`` CPUs listening on 127.0.0.1 only, for Flower's engine to use (left to itself, it would start
    one with Ray's defaults, listening on every interface): started first and stopped after, as
    :func:`fedshuffle.integrations.flower.simulate` does."""
    import ray

    from fedshuffle.executors.ray import start_local_ray, stop_local_ray

    temp_dir = start_local_ray(ray, cpus)
    try:
        yield
    finally:
        stop_local_ray(ray, temp_dir)


def pfl_round_seconds(warmup: int, repeats: int) -> dict[str, float]:
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = make_module()

        def forward(self, x):
            return self.net(x)

        def loss(self, inputs, targets, eval=False):
            self.eval() if eval else self.train()
            return torch.nn.functional.cross_entropy(self(inputs), targets)

        @torch.no_grad()
        def metrics(self, inputs, targets, eval=True):
            loss = torch.nn.functional.cross_entropy(self(inputs), targets, reduction="sum")
            return {"loss": Weighted(float(loss), len(targets))}

    def make_dataset(user):
        x, y = user_data(user)
        return Dataset(raw_data=[torch.from_numpy(x), torch.from_numpy(y)], user_id=user)

    users = list(range(USERS))
    train = FederatedDataset(make_dataset, get_user_sampler("random", users))
    val = FederatedDataset(make_dataset, get_user_sampler("random", users))
    stamps: list[float] = []
    cpu_stamps: list[float] = []

    class Timer(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.process_time())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.process_time())
            return False, Metrics()

    net = Net()
    model = PyTorchModel(
        model=net, local_optimizer_create=torch.optim.SGD, central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0)
    )
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=warmup + repeats,
            evaluation_frequency=10**6,
            train_cohort_size=COHORT,
            val_cohort_size=None,
        ),
        backend=SimulatedBackend(training_data=train, val_data=val),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=LR, local_num_epochs=1, local_batch_size=BATCH),
        model_eval_params=NNEvalHyperParams(local_batch_size=BATCH),
        callbacks=[Timer()],
        send_metrics_to_platform=False,
    )
    return _summary(stamps, warmup, cpu_stamps)
