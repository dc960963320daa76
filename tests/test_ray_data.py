"""The Ray executor ships each task only its share's clients: the dataset is put once in blocks of clients,
a task gets the blocks of its own clients with its plans renumbered into them, and the numbers are the
sequential executor's; the benchmark of what this saves has a seconds-long smoke case."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedshuffle import LogisticRegression, Simulation, UniformWithoutReplacement, build_algorithm
from fedshuffle.data import FederatedDataset, LazyFederatedDataset, objective_weights
from fedshuffle.executors.local import SequentialExecutor
from fedshuffle.executors.ray import ClientBlocks, RayExecutor
from fedshuffle.local.plan import ClientPlan

ROOT = Path(__file__).resolve().parents[1]
SIZES = [3, 9, 1, 5, 7, 2, 4, 6]


def scattered(seed: int = 0) -> FederatedDataset:
    """Clients whose rows are scattered over the sample tensor (a random partition), with one row nobody owns."""
    rng = np.random.default_rng(seed)
    total = sum(SIZES) + 1
    x = torch.tensor(rng.normal(size=(total, 4)))
    y = torch.tensor(rng.integers(0, 2, total) * 2.0 - 1.0)
    order = rng.permutation(total)[: sum(SIZES)]
    return FederatedDataset(x, y, np.split(order, np.cumsum(SIZES)[:-1]), objective_weights(np.array(SIZES), "size"))


class InPlace:
    """Ray's ``put`` without Ray: the object itself is its reference."""

    @staticmethod
    def put(value):
        return value


def plan(client: int, rows: np.ndarray) -> ClientPlan:
    return ClientPlan(client, rows, 0.1, len(rows), 1.0)


def test_blocks_hold_consecutive_clients_within_the_byte_budget_and_a_share_gets_only_its_clients_blocks():
    data = scattered()
    row_bytes = 4 * 8 + 8
    blocks = ClientBlocks.put(InPlace, data, block_bytes=10 * row_bytes)
    # consecutive clients, a new block when the next client would overflow 10 rows: [3], [9, 1], [5], [7, 2], [4, 6]
    assert blocks.block_of_client.tolist() == [0, 1, 1, 2, 3, 3, 4, 4]
    assert blocks.rows.tolist() == [3, 10, 5, 9, 10]
    for b, (features, labels) in enumerate(blocks.refs):
        own = np.concatenate([data.client_indices[i] for i in np.flatnonzero(blocks.block_of_client == b)])
        assert np.array_equal(features, data.features[own].numpy()) and np.array_equal(labels, data.labels[own].numpy())
    rng = np.random.default_rng(1)
    share = [3, 6, 3]  # client 3 twice (sampled with replacement)
    plans = [plan(c, np.where(rng.random((4, 2)) < 0.2, -1, rng.choice(data.client_indices[c], (4, 2)))) for c in share]
    chosen, renumbered = blocks.share(plans)
    assert chosen.tolist() == [2, 4]  # the blocks of clients 3 and 6 only
    features = np.concatenate([blocks.refs[b][0] for b in chosen])
    for original, local in zip(plans, renumbered):
        assert np.array_equal(local.batches < 0, original.batches < 0)  # padding kept
        real = original.batches >= 0
        assert np.array_equal(features[local.batches[real]], data.features[original.batches[real]].numpy())
        assert (local.client, local.lr, local.steps) == (original.client, original.lr, original.steps)


def test_ray_with_one_client_per_block_gives_the_sequential_trajectory():
    """Blocks of one client (a 1-byte budget), rows scattered over the tensor: the trajectory is the sequential
    executor's (to rounding: the shares are vectorized), on a dataset in memory and on one generated on demand."""
    pytest.importorskip("ray")
    data = scattered()
    x, y = data.features.numpy(), data.labels.numpy()
    lazy = LazyFederatedDataset(
        data.sizes, data.weights, lambda i: (x[data.client_indices[i]], y[data.client_indices[i]]), (4,)
    )

    def trajectory(executor, data):
        alg = build_algorithm("scaffold", {"local": {"lr": 0.1, "epochs": 1, "batch_size": 2}})
        sim = Simulation(
            LogisticRegression(4, 1e-2), data, alg, UniformWithoutReplacement(len(SIZES), 5), seed=3, executor=executor
        )
        out = []
        for _ in range(3):
            sim.step()
            out.append(sim.params.clone())
        return torch.stack(out)

    with RayExecutor(workers=2, block_bytes=1) as executor:
        got = trajectory(executor, data)
        stored = executor._data[1]
        assert isinstance(stored, ClientBlocks) and len(stored.refs) == len(SIZES)
        got_lazy = trajectory(executor, lazy)
    reference = trajectory(SequentialExecutor(), data)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-13)
    torch.testing.assert_close(got_lazy, reference, rtol=0, atol=1e-13)
    assert float((reference[-1] - reference[0]).abs().max()) > 1e-3  # the runs moved


def test_the_ray_data_benchmark_smoke_case_runs_and_writes_its_json(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.ray_data", "--smoke", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, log.decode()[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"vectorized", "ray"}
    for case in cases.values():
        assert case["clients"] == 10 and case["rounds"] == 2 and 0 < case["median_s"] < 60
