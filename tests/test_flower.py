"""Every fedshuffle method as a Flower app (fedshuffle.integrations.flower), against the simulation.

* In-process grid: configure_train sends exactly the simulation's cohort, plans and broadcast, and
  aggregate_train returns the simulation's next model, for every registered method (and every kind of
  sampler); unanswered members are dropped as unfinished work; lost client state stops the run; bad
  settings are refused before any message.
* Flower's simulation engine and a real SuperLink with SuperNodes on 127.0.0.1: tests/test_flower_superlink.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from flower_harness import FLOWER_ENV, FakeGrid

for _key in ("FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK"):  # before Flower reads them
    os.environ.setdefault(_key, FLOWER_ENV[_key])
pytest.importorskip(
    "flwr", reason="the Flower integration needs flwr (pip install 'fedshuffle[flower]', Python >= 3.11)"
)

from flwr.app import ConfigRecord, Context, RecordDict  # noqa: E402

from fedshuffle.core.checkpoint import load_checkpoint  # noqa: E402
from fedshuffle.core.errors import ConfigError  # noqa: E402
from fedshuffle.experiments.folders import intact  # noqa: E402
from fedshuffle.experiments.results import read_metrics  # noqa: E402
from fedshuffle.experiments.runner import build_simulation, run_single  # noqa: E402
from fedshuffle.experiments.schema import Experiment, load_experiment, validate  # noqa: E402
from fedshuffle.experiments.session import run_experiment  # noqa: E402
from fedshuffle.integrations.flower.app import client_app, server_app  # noqa: E402
from fedshuffle.integrations.flower.client import FileStore, StateLost, accepted_rows, hosted_clients  # noqa: E402

from fedshuffle.integrations.flower.common import AppSettings, federated_runs, format_clients, parse_clients
from fedshuffle.integrations.flower.messages import TRAIN, record_tensors, records_plans  # noqa: E402
from fedshuffle.integrations.flower.nodedata import write_node_folders  # noqa: E402

from fedshuffle.integrations.flower.strategy import ClientStateLost, FederationError, FedShuffleStrategy, keep_members
from fedshuffle.methods import METHODS  # noqa: E402

HERE = Path(__file__).parent
ROUNDS = 3
#: seconds the deployment test may take, SuperLink start to results (a heavily shared machine may need more)
DEPLOYMENT_SECONDS = float(os.environ.get("FEDSHUFFLE_FLOWER_DEADLINE", "180"))

#: samplers per method, so that every kind is exercised: repeats (with replacement), random and empty cohorts,
#: meta-epochs
SAMPLERS = {
    "rr_cli": {"name": "cyclic", "cohort": 2},
    "fedcdr": {"name": "cyclic", "cohort": 2, "order": "shuffle_once"},
    "scaffold": {"name": "with_replacement", "cohort": 3},
    "fedshuffle": {"name": "importance", "cohort": 2},
    "fedavg": {"name": "independent", "cohort": 2},
    "nastya": {"name": "full"},
}


def experiment(variants: list[dict], clients: int = 4, rounds: int = ROUNDS, seed: int = 5, **sections) -> Experiment:
    """A small logistic problem (unequal client sizes) with the given variants."""
    raw = {
        "experiment": {"name": "flower-test", "seeds": [seed]},
        "problem": {"name": "logistic", "l2": 0.05},
        "data": {
            "source": "synthetic",
            "samples": 12 * clients,
            "features": 3,
            "clients": clients,
            "partition": "dirichlet",
            "alpha": 0.8,
        },
        "local": {"lr": 0.2, "batch_size": 3},
        "sampler": {"name": "uniform", "cohort": 2},
        "run": {"rounds": rounds, "eval_every": 1},
        "variants": variants,
    }
    for section, values in sections.items():  # another part (a sampler's name) starts from its own defaults
        raw[section] = values if "name" in values else {**raw.get(section, {}), **values}
    return validate(Experiment, raw)


def variant(name: str, **more) -> dict:
    out = {"label": name, "method": {"name": name}, "sampler": SAMPLERS.get(name, {"name": "uniform", "cohort": 2})}
    if name == "fedcdr":
        out["local"] = {"epochs": 1, "batch_size": 3}
    return {**out, **more}


def single_run(exp: Experiment):
    (run,) = federated_runs(exp, AppSettings())
    return run


def simulated(run, rounds: int) -> torch.Tensor:
    """The model ``fedshuffle run`` reaches after ``rounds`` rounds."""
    sim, _ = build_simulation(run.spec, run.seed)
    for _ in range(rounds):
        sim.step()
    return sim.params


def model(arrays) -> torch.Tensor:
    return record_tensors(arrays)["model"]


def assert_equal_to_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def train_messages(grid: FakeGrid, since: int) -> list:
    return [m for m in grid.sent[since:] if m.metadata.message_type == TRAIN]


# -- the strategy against the simulation, message by message ------------------------------------------


@pytest.mark.parametrize("name", METHODS.names())
def test_configure_train_sends_the_simulations_plans_and_aggregate_train_returns_its_next_model(name):
    exp = experiment([variant(name)])
    run = single_run(exp)
    grid = FakeGrid(client_app(exp), 4)
    strategy = FedShuffleStrategy(run)
    sim, _ = build_simulation(run.spec, run.seed)
    arrays = strategy.initial_arrays()
    assert torch.equal(model(arrays), sim.params)
    accepted = {}
    for r in range(1, ROUNDS + 1):
        rnd, points = sim.open_round()
        trainer = sim.trainer(rnd)
        broadcast = sim.broadcast(rnd, points, [trainer.gradients(p, rnd.cohort) for p in points])
        since = len(grid.sent)
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        assert train_messages(grid, since) == []  # configured, not sent yet
        assert sorted(int(m.content["instructions"]["client"]) for m in messages) == sorted(set(rnd.cohort.tolist()))
        for message in messages:
            ins = message.content["instructions"]
            client = int(ins["client"])
            assert message.metadata.dst_node_id == grid.node_of(client) and message.metadata.message_type == TRAIN
            assert (
                int(ins["round"]) == rnd.index
                and float(ins["lr-scale"]) == rnd.lr_scale
                and int(ins["last-round"]) == accepted.get(client, -1)
            )
            own_rows = sim.data.client_indices[client]
            sent_plans = records_plans(client, ins, message.content["plans"], run.seed, int(ins["round"]))
            wanted = [p for p in rnd.plans if p.client == client]
            assert len(sent_plans) == len(wanted) == int(np.sum(rnd.cohort == client))
            for got, want in zip(sent_plans, wanted):
                assert np.array_equal(
                    np.where(got.batches >= 0, own_rows[np.clip(got.batches, 0, None)], -1), want.batches
                )  # the node's numbering of the same rows
                assert (got.lr, got.planned_steps, got.a_l1, got.steps, got.key) == (
                    want.lr,
                    want.planned_steps,
                    want.a_l1,
                    want.steps,
                    want.key,
                )
            sent = record_tensors(message.content["broadcast"])
            assert sorted(sent) == sorted(broadcast)
            for key in broadcast:
                assert_equal_to_rounding(sent[key], broadcast[key])
        result = None
        if len(rnd.cohort):
            result = sim.method.client_update(broadcast, rnd.plans, sim._read_rows(rnd.cohort), trainer)
            sim._write_rows(rnd.cohort, result.rows)
        record = sim.close_round(rnd, points, broadcast, result)
        arrays, metrics = strategy.aggregate_train(r, grid.send_and_receive(messages))
        assert_equal_to_rounding(model(arrays), sim.params)
        assert metrics["dropped"] == 0 and metrics["members"] == len(rnd.cohort)
        assert (metrics["sample_gradients"], metrics["bytes_up"], metrics["bytes_down"]) == (
            record.sample_gradients,
            record.bytes_up,
            record.bytes_down,
        )
        accepted.update({int(c): rnd.index for c in rnd.cohort})
    measured = strategy.half.counters.worker_compute_seconds  # the rounds' time at the server: measured, not simulated
    assert replace(strategy.half.counters, worker_compute_seconds=0.0) == sim.counters and measured > 0


def test_an_empty_cohort_sends_no_training_message_and_takes_the_simulations_step():
    exp = experiment(
        [{"label": "fs", "method": {"name": "fedshuffle"}, "sampler": {"name": "independent", "cohort": 0.4}}], rounds=1
    )
    seed = next(s for s in range(200) if len(build_simulation(single_run(exp).spec, s)[0].sampler.sample(0, s)) == 0)
    run = federated_runs(exp, AppSettings(seed=seed))[0]
    grid = FakeGrid(client_app(exp, {"seed": seed}), 4)
    strategy = FedShuffleStrategy(run)
    assert list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid)) == []
    arrays, metrics = strategy.aggregate_train(1, [])
    assert metrics["members"] == 0 and metrics["bytes_up"] == 0
    assert_equal_to_rounding(model(arrays), simulated(run, 1))


def test_a_member_that_does_not_answer_is_dropped_as_unfinished_work_and_its_state_is_not_advanced():
    """SCAFFOLD, full participation: client 1's reply of round 2 is lost. The round aggregates the other
    members (the method's rule on the members that finished), and in round 3 client 1's node discards the
    update the server never accepted: the model is the simulation's with client 1 left out of round 2."""
    exp = experiment([{"label": "scaffold", "method": {"name": "scaffold"}, "sampler": {"name": "full"}}])
    run = single_run(exp)
    grid = FakeGrid(client_app(exp), 4)
    strategy = FedShuffleStrategy(run)
    sim, _ = build_simulation(run.spec, run.seed)
    arrays = strategy.initial_arrays()
    for r in range(1, ROUNDS + 1):
        rnd, points = sim.open_round()
        keep = rnd.cohort != 1 if r == 2 else np.ones(len(rnd.cohort), dtype=bool)
        kept = keep_members(rnd, keep)
        broadcast = sim.broadcast(kept, points, [])
        result = sim.method.client_update(broadcast, kept.plans, sim._read_rows(kept.cohort), sim.trainer(kept))
        sim._write_rows(kept.cohort, result.rows)
        sim.close_round(kept, points, broadcast, result)
        grid.silent = {grid.node_of(1)} if r == 2 else set()
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        arrays, metrics = strategy.aggregate_train(r, grid.send_and_receive(messages))
        assert metrics["dropped"] == (1 if r == 2 else 0)
        assert_equal_to_rounding(model(arrays), sim.params)
    assert float((sim.params - simulated(run, ROUNDS)).abs().max()) > 1e-6  # dropping a member changed the run
    assert strategy.half.dropped == 1 and strategy.half.last_round.tolist() == [2, 2, 2, 2]


def test_lost_client_state_stops_the_run_naming_the_client_never_resetting_it():
    exp = experiment([{"label": "scaffold", "method": {"name": "scaffold"}, "sampler": {"name": "full"}}])
    grid = FakeGrid(client_app(exp), 4)
    strategy = FedShuffleStrategy(single_run(exp))
    arrays, _ = strategy.aggregate_train(
        1, grid.send_and_receive(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid))
    )
    grid.forget(2)  # the SuperNode of client 2 restarted and lost its context
    messages = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    with pytest.raises(ClientStateLost, match=r"client 2 .*round 0"):
        strategy.aggregate_train(2, grid.send_and_receive(messages))


def dropped_in_simulation(run, rounds: int, leaves: dict[int, set[int]]):
    """The simulation with, in round r, the members ``leaves[r]`` left out (unfinished work; their state not
    advanced)."""
    sim, _ = build_simulation(run.spec, run.seed)
    for r in range(1, rounds + 1):
        rnd, points = sim.open_round()
        kept = keep_members(rnd, ~np.isin(rnd.cohort, sorted(leaves.get(r, set()))))
        broadcast = sim.broadcast(kept, points, [])
        result = sim.method.client_update(broadcast, kept.plans, sim._read_rows(kept.cohort), sim.trainer(kept))
        sim._write_rows(kept.cohort, result.rows)
        sim.close_round(kept, points, broadcast, result)
    return sim


def test_a_restarted_node_is_asked_again_and_serves_its_clients_with_the_state_it_kept(tmp_path):
    """SCAFFOLD, clients 0-2 on node 1000 and 3-5 on node 1001 (state-dir), full participation. Node 1001 goes offline
    before round 3: its clients get no message and are dropped as unfinished work; before round 4 it comes back as
    node 1002 (a restarted SuperNode, fresh context): the server asks it for its clients, it serves them from round 4
    with the control variates its files kept, and the run is the simulation's with clients 3-5 left out of round 3."""
    exp = experiment(
        [{"label": "scaffold", "method": {"name": "scaffold"}, "sampler": {"name": "full"}}], clients=6, rounds=5
    )
    run = single_run(exp)
    grid = FakeGrid(
        client_app(exp), 2, hosts=["0-2", "3-5"], node_config=lambda k: {"state-dir": str(tmp_path / f"node-{k}")}
    )
    logged: list[str] = []
    strategy = FedShuffleStrategy(run, log=logged.append)
    strategy.handshake(grid)
    arrays, dropped = strategy.initial_arrays(), []
    for r in range(1, 6):
        if r == 3:
            config = grid.leave(1001)
        if r == 4:
            assert grid.join(config) == 1002
        since = len(grid.sent)
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        arrays, metrics = strategy.aggregate_train(r, grid.send_and_receive(messages))
        dropped.append(int(metrics["dropped"]))
        served = {int(m.content["instructions"]["client"]): m.metadata.dst_node_id for m in train_messages(grid, since)}
        assert served == {
            0: 1000,
            1: 1000,
            2: 1000,
            **({} if r == 3 else {c: 1001 if r < 3 else 1002 for c in (3, 4, 5)}),
        }
    assert dropped == [0, 0, 3, 0, 0]
    assert_equal_to_rounding(model(arrays), dropped_in_simulation(run, 5, {3: {3, 4, 5}}).params)
    assert float((model(arrays) - simulated(run, 5)).abs().max()) > 1e-6  # leaving one round out changed the run
    assert strategy.nodes == {0: 1000, 1: 1000, 2: 1000, 3: 1002, 4: 1002, 5: 1002}
    assert any("client(s) 3-5 on offline node(s) 1001" in line for line in logged)
    assert any("node 1002 joined: it serves client(s) 3-5 from now on (node(s) 1001 before)" in line for line in logged)


def test_a_joining_node_with_other_rows_is_not_used_and_one_with_the_same_rows_takes_over(tmp_path):
    """A server without the data (node-data): the rows' digests the first nodes reported are what a re-joining node
    must hold. Node 1001 leaves; a node whose client 4 has other rows joins and is not used (clients 3-5 stay
    dropped); a node with node 1001's folder joins and serves them. Federated evaluation scores every client again."""
    exp = experiment(
        [{"label": "fedavg", "method": {"name": "fedavg"}, "sampler": {"name": "full"}}], clients=6, rounds=4
    )
    run = single_run(exp)
    folders = write_node_folders(exp, 2, tmp_path / "nodes")
    other = tmp_path / "other"
    shutil.copytree(folders[1][0], other)
    with np.load(other / "client-4.npz") as saved:
        np.savez(other / "client-4.npz", x=saved["x"] + 1.0, y=saved["y"])
    grid = FakeGrid(client_app(exp), 2, node_config=lambda k: {"data-path": str(folders[k][0])}, hosts=[None, None])
    logged: list[str] = []
    strategy = FedShuffleStrategy(run, node_data=True, log=logged.append)
    strategy.handshake(grid)
    strategy._grid = grid
    arrays, dropped = strategy.initial_arrays(), []
    for r in range(1, 5):
        if r == 2:
            config = grid.leave(1001)
            grid.join({"data-path": str(other)})
        if r == 3:
            grid.join(config)
        arrays, metrics = strategy.aggregate_train(
            r, grid.send_and_receive(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        )
        dropped.append(int(metrics["dropped"]))
    assert dropped == [0, 3, 0, 0] and strategy.half.dropped == 3  # per round; metrics.csv's dropped: so far
    assert any(
        "node 1002 joined and is not used: node 1002 holds other samples for client 4 than its node at the start"
        in line
        for line in logged
    )
    assert strategy.nodes == {0: 1000, 1: 1000, 2: 1000, 3: 1003, 4: 1003, 5: 1003}
    assert_equal_to_rounding(model(arrays), dropped_in_simulation(run, 4, {2: {3, 4, 5}}).params)
    sim, _ = build_simulation(run.spec, run.seed)
    central = metrics_of(sim, model(arrays))
    federated = strategy.federated_scores(model(arrays))
    for key in ("loss", "grad_norm_sq", "train_accuracy"):
        assert federated[key] == pytest.approx(central[key], rel=1e-12, abs=1e-15), key


def metrics_of(sim, params: torch.Tensor) -> dict:
    from fedshuffle import metrics

    return metrics.ModelScores(sim.problem, sim.data)(params)


def test_a_long_lived_clientapp_process_builds_each_nodes_runtime_once_per_run():
    """All messages of a run reach one process (as with the worker): each node's runtime is built at its first message
    and reused; a new Flower run (another run id) builds afresh, and the cache keeps only the most recent runtimes."""
    from fedshuffle.integrations.flower import app as flower_app
    from fedshuffle.integrations.flower.client import RuntimeCache

    exp = experiment([variant("scaffold")], clients=6, rounds=3, seed=11)
    cache = flower_app._RUNTIMES
    before = cache.builds
    grid = FakeGrid(client_app(exp), 2, hosts=["0-2", "3-5"])
    FedShuffleStrategy(single_run(exp)).start(grid)
    assert len(grid.sent) > 6 and cache.builds - before == 2  # handshake, rounds, every message: two builds
    for context in grid.contexts.values():
        context.run_id = 2
    FedShuffleStrategy(single_run(exp)).start(grid)
    assert cache.builds - before == 4
    small = RuntimeCache(capacity=2)
    for key in ("a", "b", "a", "c", "a"):
        small.get(key, lambda: object())
    assert small.builds == 3 and list(small.runtimes) == ["c", "a"]


def test_the_worker_answers_a_failing_clientapp_with_an_error_reply_and_goes_on(monkeypatch):
    """The long-lived worker's task, with the Runtime API's calls replaced: a ClientApp exception becomes an error reply
    (Flower's code for it) and a failed task status, not the end of the process; the next task is answered."""
    from flwr.app import Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.common.constant import ErrorCode, SubStatus

    from fedshuffle.integrations.flower import worker

    pushed, outputs = [], []
    app = ClientApp()

    @app.query()
    def answer(message, context):
        if context.node_config.get("fail"):
            raise ValueError("no such client")
        return Message(RecordDict(), reply_to=message)

    class Bundle:
        hash_str, content = "h", b""

    class Run:
        fab_id, fab_version = "fedshuffle/app", "1.0.0"

    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # what pull_task_input sets

    def task(client):
        message = Message(RecordDict(), dst_node_id=1, message_type="query")
        message.metadata.__dict__["_message_id"] = "m1"
        return (
            message,
            Context(run_id=1, node_id=1, node_config=dict(config), state=RecordDict(), run_config={}),
            Run(),
            Bundle(),
        )

    config = {"fail": True}
    monkeypatch.setattr(worker, "pull_task_input", task)
    monkeypatch.setattr(worker, "push_message", lambda client, reply, context: pushed.append(reply))
    monkeypatch.setattr(
        worker, "push_task_output", lambda client, context, sub_status, details: outputs.append((sub_status, details))
    )
    monkeypatch.setattr(worker.ClientApps, "get", lambda self, *bundle: app)

    class Client:
        def SendTaskHeartbeat(self, request):
            return None

    apps = worker.ClientApps()
    assert worker.run_task(Client(), apps) is False
    assert (
        pushed[-1].has_error()
        and pushed[-1].error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        and "no such client" in pushed[-1].error.reason
    )
    assert outputs[-1][0] == SubStatus.FAILED and "no such client" in outputs[-1][1]
    config["fail"] = False
    assert worker.run_task(Client(), apps) is True
    assert not pushed[-1].has_error() and outputs[-1] == (SubStatus.COMPLETED, "")


def test_federated_evaluation_on_a_server_with_the_data_equals_the_central_one_and_waits_for_a_restarted_node():
    """run-config evaluation = "federated" where the server has the data: each node scores its clients and the sum
    equals the server's central scores. A node that left is re-joined for the evaluation (its successor scores its
    clients); with no successor, the run stops naming the clients that could not be scored."""
    exp = experiment(
        [{"label": "fedavg", "method": {"name": "fedavg"}, "sampler": {"name": "full"}}],
        clients=6,
        problem={"name": "softmax", "l2": 0.05},
        data={"classes": 3},
    )
    run = single_run(exp)
    grid = FakeGrid(client_app(exp), 2, hosts=["0-2", "3-5"])
    strategy = FedShuffleStrategy(run, evaluation="federated", connect_timeout=0.2, round_timeout=0.2)
    strategy.handshake(grid)
    strategy._grid = grid
    params = strategy.half.params + 0.3
    central = strategy.evaluator(params)
    for key in ("loss", "grad_norm_sq", "train_accuracy"):
        assert strategy.federated_scores(params)[key] == pytest.approx(central[key], rel=1e-12, abs=1e-15), key
    grid.join(grid.leave(1001))
    assert strategy.federated_scores(params)["loss"] == pytest.approx(central["loss"], rel=1e-12)
    assert strategy.nodes[4] == 1002
    grid.leave(1002)
    with pytest.raises(
        FederationError, match=r"client\(s\) 3-5 could not be scored in the federated evaluation \(node 1002: offline\)"
    ):
        strategy.federated_scores(params)
    with pytest.raises(ConfigError, match="run-config.evaluation"):
        FedShuffleStrategy(run, evaluation="central", node_data=True)
    with pytest.raises(
        ConfigError, match="run-config.evaluation: unknown evaluation 'nodes'; accepted: auto, central, federated, both"
    ):
        AppSettings.from_run_config({"evaluation": "nodes"})


@pytest.mark.parametrize(
    "name, sampler",
    [("fedshuffle", {"name": "importance", "cohort": 3}), ("scaffold", {"name": "with_replacement", "cohort": 4})],
)
def test_six_clients_on_two_nodes_run_the_simulations_cohorts_and_reach_its_model(name, sampler):
    """Node 1000 hosts clients 0-2, node 1001 clients 3-5: the server samples clients (not nodes) with the simulation's
    streams, each sampled client's message goes to its node, and the run ends at the simulation's model
    (SCAFFOLD: each node keeps the control variates of its three clients; with replacement, a client may be sampled
    twice)."""
    exp = experiment([{"label": name, "method": {"name": name}, "sampler": sampler}], clients=6, rounds=4)
    run = single_run(exp)
    grid = FakeGrid(client_app(exp), 2, hosts=["0-2", "3-5"])
    result = FedShuffleStrategy(run).start(grid)
    sim, _ = build_simulation(run.spec, run.seed)
    repeated = False
    for r in range(1, 5):
        rnd = sim.round_info()
        sent = [m for m in train_messages(grid, 0) if m.metadata.group_id == str(r)]
        assert sorted(int(m.content["instructions"]["client"]) for m in sent) == sorted(set(rnd.cohort.tolist()))
        assert all(m.metadata.dst_node_id == 1000 + int(m.content["instructions"]["client"]) // 3 for m in sent)
        repeated |= len(set(rnd.cohort.tolist())) < len(rnd.cohort)
        sim.step()
    assert {m.metadata.dst_node_id for m in train_messages(grid, 0)} == {1000, 1001}
    assert_equal_to_rounding(model(result.arrays), sim.params)
    assert (
        float(
            (
                sim.params
                - simulated(
                    single_run(
                        experiment(
                            [{"label": name, "method": {"name": name}, "sampler": sampler}], clients=6, rounds=4, seed=6
                        )
                    ),
                    4,
                )
            )
            .abs()
            .max()
        )
        > 1e-6
    )
    if name == "scaffold":
        assert repeated  # the case of one client's plans twice in one message is exercised
        assert (
            sum(key.startswith("fedshuffle.") for key in grid.contexts[1000].state.keys()) >= 2
        )  # state of several clients on one node


@pytest.mark.parametrize(
    "name, sampler",
    [("fedavg", {"name": "uniform", "cohort": 3}), ("scaffold", {"name": "with_replacement", "cohort": 4})],
)
def test_nodes_bringing_their_own_data_reach_the_simulations_model(tmp_path, monkeypatch, name, sampler):
    """Each node reads only its own folder (written by write_node_folders; no node sees another's files) and never
    builds the federation's data; the run equals the simulation built from all the data."""
    exp = experiment(
        [{"label": name, "method": {"name": name}, "sampler": sampler}],
        clients=6,
        rounds=4,
        problem={"name": "softmax", "l2": 0.05},
        data={"classes": 3},
    )
    run = single_run(exp)
    folders = write_node_folders(exp, 2, tmp_path / "nodes")
    assert [clients for _, clients in folders] == [(0, 1, 2), (3, 4, 5)]
    assert sorted(p.name for p in folders[1][0].iterdir()) == ["client-3.npz", "client-4.npz", "client-5.npz"]
    server = FedShuffleStrategy(run)  # the server has the data: it checks each client's rows' digest
    monkeypatch.setattr(
        "fedshuffle.integrations.flower.client.build_simulation",
        lambda *a, **k: pytest.fail("a node built the federation's data"),
    )
    grid = FakeGrid(client_app(exp), 2, node_config=lambda k: {"data-path": str(folders[k][0])}, hosts=[None, None])
    result = server.start(grid)
    assert (
        server.nodes == {c: grid.node_of(c) for c in range(6)} == {0: 1000, 1: 1000, 2: 1000, 3: 1001, 4: 1001, 5: 1001}
    )
    assert_equal_to_rounding(model(result.arrays), simulated(run, 4))


@pytest.mark.parametrize(
    "name, sampler",
    [("fedshuffle", {"name": "importance", "cohort": 3}), ("scaffold", {"name": "with_replacement", "cohort": 4})],
)
def test_a_server_without_the_data_plans_on_the_nodes_sizes_and_evaluates_federatedly(
    tmp_path, monkeypatch, name, sampler
):
    """run-config node-data = true: neither the server nor a node builds the federation's data. The server learns
    |D_i| and the kind of samples from the handshake; each node scores its own clients and the server adds
    Σ_i w_i f_i(x): the model and f(x), ‖∇f(x)‖², accuracy equal ``fedshuffle run`` on the pooled data to rounding."""
    exp = experiment(
        [{"label": name, "method": {"name": name}, "sampler": sampler}],
        clients=6,
        rounds=4,
        problem={"name": "softmax", "l2": 0.05},
        data={"classes": 3},
    )
    run = single_run(exp)
    folders = write_node_folders(exp, 2, tmp_path / "nodes")
    run_single(run.spec, tmp_path / "simulated", run.seed, label=name)
    for module in ("strategy", "client"):
        monkeypatch.setattr(
            f"fedshuffle.integrations.flower.{module}.build_simulation",
            lambda *a, **k: pytest.fail("the federation's data was built"),
        )
    grid = FakeGrid(client_app(exp), 2, node_config=lambda k: {"data-path": str(folders[k][0])}, hosts=[None, None])
    server_app(exp)(grid, server_context({"out": str(tmp_path / "flower"), "node-data": True}))
    flower, simulated_dir = tmp_path / "flower" / name / f"seed-{run.seed}", tmp_path / "simulated"
    np.testing.assert_allclose(
        np.load(flower / "final_params.npy"), np.load(simulated_dir / "final_params.npy"), rtol=0, atol=1e-12
    )
    ours, theirs = read_metrics(flower / "metrics.csv"), read_metrics(simulated_dir / "metrics.csv")
    for column in ("round", "loss", "grad_norm_sq", "train_accuracy", "sample_gradients", "bytes_up"):
        np.testing.assert_allclose(ours[column], theirs[column], rtol=1e-10, atol=1e-14, err_msg=column)
    assert np.all(np.isnan(ours["f_gap"])) and np.all(np.isfinite(theirs["f_gap"]))  # f* needs the data at the server
    assert json.loads((flower / "config.json").read_text())["executor"]["evaluation"] == "federated"
    assert {m.metadata.message_type for m in grid.sent} == {"query.fedshuffle", "query.evaluate", "train"}


def test_a_server_without_the_data_refuses_a_node_without_its_own_data_and_theory_step_sizes(tmp_path):
    exp = experiment([variant("fedavg")], clients=4)
    folders = write_node_folders(exp, 2, tmp_path / "nodes")
    grid = FakeGrid(
        client_app(exp),
        2,
        node_config=lambda k: {"data-path": str(folders[0][0])} if k == 0 else {},
        hosts=[None, "2-3"],
    )
    with pytest.raises(
        FederationError, match="node 1001 brings no data of its own .* node-data = true every node must"
    ):
        server_app(exp)(grid, server_context({"node-data": True}))
    assert train_messages(grid, 0) == []
    theory = experiment([variant("fedavg")], clients=4, local={"lr": "theory"})
    with pytest.raises(
        ConfigError,
        match="local.lr: 'theory' step sizes need the whole federation's data, and the server builds no data",
    ):
        FedShuffleStrategy(single_run(theory), node_data=True)


def test_a_node_holding_other_rows_or_missing_a_file_is_refused_before_training(tmp_path):
    exp = experiment([variant("fedavg")], clients=4)
    folders = write_node_folders(exp, 2, tmp_path / "nodes")
    other = folders[1][0] / "client-3.npz"
    with np.load(other) as saved:
        x, y = saved["x"].copy(), saved["y"]
    x[0, 0] += 1.0
    np.savez(other, x=x, y=y)
    grid = FakeGrid(client_app(exp), 2, node_config=lambda k: {"data-path": str(folders[k][0])}, hosts=[None, None])
    with pytest.raises(FederationError, match="node 1001 holds other samples for client 3 than the server's data"):
        FedShuffleStrategy(single_run(exp)).start(grid)
    assert train_messages(grid, 0) == []
    grid = FakeGrid(client_app(exp), 2, node_config=lambda k: {"data-path": str(folders[k][0])}, hosts=["0-1", "1-2"])
    with pytest.raises(
        FederationError,
        match=r"node 1001 failed the handshake: .*client-1\.npz not found: the node hosts client 1 but its folder "
        r"has no file for it",
    ):
        FedShuffleStrategy(single_run(exp)).start(grid)


def test_flower_split_command_writes_each_nodes_clients_as_fedshuffle_run_splits_them(tmp_path):
    from typer.testing import CliRunner

    from fedshuffle.cli import app as cli

    config = tmp_path / "exp.toml"
    config.write_text(
        '[experiment]\nname = "split"\nseeds = [2]\n[problem]\nname = "logistic"\n'
        '[data]\nsource = "synthetic"\nsamples = 30\nfeatures = 3\nclients = 5\npartition = "dirichlet"\n[local]\nlr '
        "= 0.1\n"
    )
    result = CliRunner().invoke(cli, ["flower-split", str(config), "--nodes", "2", "--out", str(tmp_path / "nodes")])
    assert result.exit_code == 0, result.output
    assert "clients 0-2" in result.output and "clients 3-4" in result.output and "data-path=" in result.output
    sim, _ = build_simulation(single_run(load_experiment(config)).spec, 2)
    for k, clients in enumerate([(0, 1, 2), (3, 4)]):
        assert sorted(p.name for p in (tmp_path / "nodes" / f"node-{k}").iterdir()) == [
            f"client-{c}.npz" for c in clients
        ]
        for c in clients:
            with np.load(tmp_path / "nodes" / f"node-{k}" / f"client-{c}.npz") as saved:
                rows = sim.data.client_indices[c]
                assert np.array_equal(
                    saved["x"], sim.data.features[rows].numpy()
                )  # the simulation's rows, in its order
                assert np.array_equal(
                    np.where(saved["y"] > 0, 1.0, -1.0), sim.data.labels[rows].numpy()
                )  # labels as the source gives them (0/1; the problem's ±1)
    bad = CliRunner().invoke(cli, ["flower-split", str(config), "--nodes", "9", "--out", str(tmp_path / "more")])
    assert (
        bad.exit_code != 0
        and "--nodes: must be 1..5 (the number of clients), got 9" in bad.output
        and "Traceback" not in bad.output
    )


def test_node_config_clients_ranges_and_lists():
    assert (
        parse_clients("0-2,5") == (0, 1, 2, 5)
        and parse_clients("7,3") == (3, 7)
        and parse_clients(4) == (4,)
        and parse_clients([7, 0]) == (0, 7)
    )
    assert format_clients([5, 0, 1, 2]) == "0-2,5"
    for bad, why in (
        ("2-1", "expected client ids"),
        ("a", "expected client ids"),
        ("1,1", "names a client twice"),
        ("", "names no client"),
        ("-1", "expected client ids"),
    ):
        with pytest.raises(ConfigError, match=f"node-config.clients: {why}"):
            parse_clients(bad)
    ctx = Context(
        run_id=1, node_id=1, node_config={"clients": "0-1", "partition-id": 0}, state=RecordDict(), run_config={}
    )
    with pytest.raises(ConfigError, match="either clients or partition-id"):
        hosted_clients(ctx)


def test_file_backed_client_state_survives_a_node_restart(tmp_path):
    """With node-config state-dir the rows outlive the node's context: the run goes on and matches the simulation."""
    exp = experiment([{"label": "feddyn", "method": {"name": "feddyn"}, "sampler": {"name": "full"}}])
    run = single_run(exp)
    grid = FakeGrid(client_app(exp), 4, node_config=lambda k: {"state-dir": str(tmp_path / f"node-{k}")})
    strategy = FedShuffleStrategy(run)
    arrays = strategy.initial_arrays()
    for r in range(1, ROUNDS + 1):
        arrays, _ = strategy.aggregate_train(
            r, grid.send_and_receive(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        )
        grid.forget(r % 4)
    assert_equal_to_rounding(model(arrays), simulated(run, ROUNDS))
    assert sorted(p.name for p in (tmp_path / "node-0").iterdir()) == [f"{run.digest}-0"]


def test_a_run_resumes_from_the_servers_checkpoint_with_the_nodes_state_dirs(tmp_path):
    """The ServerApp pauses after round 2 (num_rounds=2: a checkpoint, no summary); resumed in a new run with new
    node contexts, it refuses to go on when the nodes did not keep their state, and ends at the model of an
    uninterrupted run, with its rows, when they kept it in files."""
    exp = experiment(
        [{"label": "scaffold", "method": {"name": "scaffold"}, "sampler": {"name": "uniform", "cohort": 3}}]
    )
    run = single_run(exp)
    folder = tmp_path / "out" / "scaffold" / f"seed-{run.seed}"
    dirs = {"node_config": lambda k: {"state-dir": str(tmp_path / f"node-{k}")}}
    FedShuffleStrategy(run, out=tmp_path / "out").start(FakeGrid(client_app(exp), 4, **dirs), num_rounds=2)
    assert (
        not (folder / "summary.json").exists()
        and load_checkpoint(folder / "checkpoint.pt")["simulation"]["counters"]["rounds"] == 2
    )
    with pytest.raises(ClientStateLost):
        FedShuffleStrategy(run, out=tmp_path / "out", resume=True).start(FakeGrid(client_app(exp), 4))
    resumed = FedShuffleStrategy(run, out=tmp_path / "out", resume=True)
    resumed.start(FakeGrid(client_app(exp), 4, **dirs))
    assert_equal_to_rounding(resumed.half.params, simulated(run, ROUNDS))
    assert read_metrics(folder / "metrics.csv")["round"].tolist() == [0, 1, 2, 3]
    assert json.loads((folder / "summary.json").read_text())["status"] == "complete"
    grid = FakeGrid(client_app(exp), 4, **dirs)
    again = FedShuffleStrategy(run, out=tmp_path / "out", resume=True).start(grid)  # finished: not run again
    assert_equal_to_rounding(model(again.arrays), resumed.half.params)
    assert train_messages(grid, 0) == []


def test_the_server_refuses_to_resume_from_another_runs_checkpoint(tmp_path):
    exp = experiment([{"label": "fedavg", "method": {"name": "fedavg"}, "sampler": {"name": "uniform", "cohort": 2}}])
    FedShuffleStrategy(single_run(exp), out=tmp_path / "out").start(FakeGrid(client_app(exp), 4), num_rounds=2)
    run = single_run(exp)
    (other,) = federated_runs(exp, AppSettings(seed=run.seed + 1))
    (tmp_path / "out" / "fedavg" / f"seed-{other.seed}").mkdir()
    shutil.copy(
        tmp_path / "out" / "fedavg" / f"seed-{run.seed}" / "checkpoint.pt",
        tmp_path / "out" / "fedavg" / f"seed-{other.seed}" / "checkpoint.pt",
    )
    grid = FakeGrid(client_app(exp, {"seed": other.seed}), 4)
    with pytest.raises(ConfigError, match="another run"):
        FedShuffleStrategy(other, out=tmp_path / "out", resume=True).start(grid)
    assert not [m for m in grid.sent if m.metadata.message_type == TRAIN]
    with pytest.raises(ConfigError, match="already holds a run; continue it with run-config resume=true"):
        FedShuffleStrategy(run, out=tmp_path / "out")
    with pytest.raises(ConfigError, match=r"4 rounds asked for; the run has 3 \(run.rounds\)"):
        FedShuffleStrategy(run).start(grid, num_rounds=ROUNDS + 1)


def test_the_node_commits_what_the_server_accepted_and_discards_the_rest(tmp_path):
    store = FileStore(tmp_path, "k")
    rows = {"control": np.arange(3.0)}
    assert accepted_rows(store, -1) is None
    store.save("pending", 0, rows)
    assert np.array_equal(accepted_rows(store, 0)["control"], rows["control"])  # accepted: committed
    store.save("pending", 1, {"control": rows["control"] + 1})
    assert np.array_equal(accepted_rows(store, 0)["control"], rows["control"])  # round 1 was dropped: discarded
    assert store.load("pending") is None and store.load("committed")[0] == 0
    with pytest.raises(StateLost, match="round 3.*committed rows of round 0"):
        accepted_rows(store, 3)


# -- the results folder: one loop for the simulation and Flower ------------------------------------------


def folder_files(folder: Path) -> set[str]:
    """The files of a run folder, the simulation's client state aside (on Flower the nodes keep it)."""
    return {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).parts[0] != "client_state"
    }


def assert_same_run_folder(flower: Path, simulated_dir: Path) -> None:
    """The Flower run's folder holds the files of ``fedshuffle run``'s, sealed alike, with the same rows, columns and
    numbers to rounding; ``dropped`` is 0 where the simulation (which never drops a member) leaves it empty, and the
    clients' own models (FedCDR's, FedDyn's local_* metrics) are scored only where the server holds them: in a
    simulation."""
    assert folder_files(flower) == folder_files(simulated_dir)
    assert intact(flower) is not None and intact(simulated_dir) is not None  # summary.json seals the files on both
    for name in ("metrics.csv", "timing.csv"):
        assert (flower / name).read_text().splitlines()[0] == (simulated_dir / name).read_text().splitlines()[0]
    ours, theirs = read_metrics(flower / "metrics.csv"), read_metrics(simulated_dir / "metrics.csv")
    assert np.all(ours["dropped"] == 0) and np.all(np.isnan(theirs["dropped"]))
    local = {column for column in ours if column.startswith("local_")}
    assert all(np.all(np.isnan(ours[column])) for column in local)
    for column in set(ours) - local - {"dropped", "compute_seconds", "wallclock_seconds"}:
        np.testing.assert_allclose(ours[column], theirs[column], rtol=1e-9, atol=1e-12, equal_nan=True, err_msg=column)
    assert (
        read_metrics(flower / "timing.csv")["round"].tolist()
        == read_metrics(simulated_dir / "timing.csv")["round"].tolist()
    )
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (flower, simulated_dir)]
    assert summaries[0].keys() == summaries[1].keys()
    for key in ("status", "message", "rounds", "label", "point", "seed"):
        assert summaries[0][key] == summaries[1][key], key
    configs = [json.loads((folder / "config.json").read_text()) for folder in (flower, simulated_dir)]
    assert configs[0].keys() == configs[1].keys() and configs[0]["executor"]["name"] == "flower"
    for key in ("spec", "config_hash", "data_hashes", "step_sizes", "label", "seed"):
        assert configs[0][key] == configs[1][key], key
    assert_equal_to_rounding(
        torch.from_numpy(np.load(flower / "final_params.npy")),
        torch.from_numpy(np.load(simulated_dir / "final_params.npy")),
    )


@pytest.mark.parametrize("lr, status", [(0.2, "complete"), (1000.0, "diverged")])
def test_a_flower_run_writes_the_folder_of_fedshuffle_run_through_the_same_loop(tmp_path, lr, status):
    """The ServerApp (in-process nodes) and ``fedshuffle run`` of one experiment: the same run folders, evaluated every
    2 rounds and at the last. With a step size that blows up, both stop with the same message at the same round
    and keep what they wrote (rows, checkpoint, final model, sealed summary)."""
    exp = experiment(
        [variant("fedshuffle"), variant("scaffold")],
        rounds=30 if status == "diverged" else 5,
        local={"lr": lr},
        run={"eval_every": 2},
    )
    server_app(exp)(FakeGrid(client_app(exp), 4), server_context({"out": str(tmp_path / "flower")}))
    run_experiment(exp, tmp_path / "simulated", show_progress=False)
    for run in federated_runs(exp, AppSettings()):
        where = Path(run.label) / f"seed-{run.seed}"
        assert_same_run_folder(tmp_path / "flower" / where, tmp_path / "simulated" / where)
        summary = json.loads((tmp_path / "flower" / where / "summary.json").read_text())
        assert summary["status"] == status and (
            status == "complete" or summary["message"].startswith("diverged at round ")
        )
        assert summary["rounds"] == (read_metrics(tmp_path / "flower" / where / "metrics.csv")["round"][-1])


def test_evaluation_both_records_the_nodes_federated_scores_beside_the_central_ones(tmp_path):
    """run-config evaluation = "both": the run folder holds the central scores of ``fedshuffle run`` and, beside them,
    federated_loss, federated_grad_norm_sq and federated_train_accuracy equal to them to rounding; config.json says
    "both"."""
    exp = experiment(
        [variant("fedavg")], clients=6, rounds=3, problem={"name": "softmax", "l2": 0.05}, data={"classes": 3}
    )
    server_app(exp)(
        FakeGrid(client_app(exp), 2, hosts=["0-2", "3-5"]),
        server_context({"out": str(tmp_path / "flower"), "evaluation": "both"}),
    )
    run_experiment(exp, tmp_path / "simulated", show_progress=False)
    where = Path("fedavg") / "seed-5"
    flower = read_metrics(tmp_path / "flower" / where / "metrics.csv")
    simulated = read_metrics(tmp_path / "simulated" / where / "metrics.csv")
    assert len(flower["loss"]) == 4 and np.array_equal(flower["loss"], simulated["loss"])
    for name in ("loss", "grad_norm_sq", "train_accuracy"):
        np.testing.assert_allclose(flower[f"federated_{name}"], flower[name], rtol=1e-12, atol=1e-15, err_msg=name)
        assert np.isnan(np.asarray(simulated[f"federated_{name}"], dtype=float)).all(), (
            name
        )  # empty where no node scores
    assert json.loads((tmp_path / "flower" / where / "config.json").read_text())["executor"]["evaluation"] == "both"
    with pytest.raises(ConfigError, match="run-config.evaluation: 'both' needs the data at the server"):
        AppSettings.from_run_config({"evaluation": "both", "node-data": True})


# -- refusals ---------------------------------------------------------------------------------------------


def server_context(run_config: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)


@pytest.mark.parametrize(
    "variants, run_config, field",
    [
        ([{"label": "cdr", "method": {"name": "fedcdr"}}], {}, "sampler.name"),  # FedCDR needs meta-epochs
        ([variant("fedavg")], {"rounds": 3}, "run-config.rounds"),
        ([variant("fedavg")], {"round-timeout": -1.0}, "run-config.round-timeout"),
        ([variant("fedavg")], {"variant": "nope"}, "run-config.variant"),
        ([variant("fedavg")], {"set": "local.lr=-1"}, "--set local.lr"),
    ],
)
def test_a_bad_setting_is_refused_before_any_message_naming_it(variants, run_config, field):
    exp = experiment(variants)
    grid = FakeGrid(client_app(exp), 4)
    with pytest.raises(ConfigError) as err:
        server_app(exp)(grid, server_context(run_config))
    assert err.value.field == field and grid.sent == []


def test_missing_nodes_and_nodes_running_other_settings_are_refused_before_training():
    exp = experiment([variant("fedavg")])
    too_few = FakeGrid(client_app(exp), 3, hosts=["0", "1", "2"])
    with pytest.raises(FederationError, match=r"no node hosts client\(s\) 3 \(3 node\(s\) connected within 0\.3 s\)"):
        server_app(exp)(too_few, server_context({"connect-timeout": 0.3}))
    assert {m.metadata.message_type for m in too_few.sent} == {"query.fedshuffle"}
    other = experiment([variant("fedavg")], local={"lr": 0.3})
    mismatched = FakeGrid(client_app(other), 4)
    with pytest.raises(FederationError, match="would run other settings"):
        server_app(exp)(mismatched, server_context({}))
    assert {m.metadata.message_type for m in mismatched.sent} == {"query.fedshuffle"}


# -- the app writer ---------------------------------------------------------------------------------------


def test_flower_app_command_writes_an_app_flower_accepts_and_that_runs_the_experiment(tmp_path):
    from typer.testing import CliRunner

    from fedshuffle.cli import app as cli
    from flwr.common.config import validate_config

    config = tmp_path / "exp.toml"
    config.write_text(
        '[experiment]\nname = "tiny"\nseeds = [3]\n[problem]\nname = "logistic"\nl2 = 0.1\n'
        '[data]\nsource = "synthetic"\nsamples = 20\nfeatures = 3\nclients = 2\npartition = "iid"\n'
        '[local]\nlr = 0.1\nbatch_size = 4\n[sampler]\nname = "full"\n[run]\nrounds = 5\n'
        '[[variants]]\nlabel = "FedShuffle"\nmethod = { name = "fedshuffle" }\n[[variants]]\nlabel = '
        '"SCAFFOLD"\nmethod = { name = "scaffold" }\n'
    )
    result = CliRunner().invoke(cli, ["flower-app", str(config), str(tmp_path / "app"), "--set", "run.rounds=2"])
    assert result.exit_code == 0, result.output
    app_dir = tmp_path / "app"
    import tomllib

    pyproject = tomllib.loads((app_dir / "pyproject.toml").read_text())
    valid, errors, _ = validate_config(pyproject, check_module=True, project_dir=app_dir)
    assert valid, errors
    assert pyproject["tool"]["flwr"]["app"]["config"]["set"] == "run.rounds=2"
    assert pyproject["tool"]["flwr"]["app"]["config"]["invalid-reply"] == "drop"  # listed, so `flwr run -c` may set it
    assert AppSettings.from_run_config(pyproject["tool"]["flwr"]["app"]["config"]) == AppSettings(
        overrides="run.rounds=2"
    )  # every key, read back
    spec = importlib.util.spec_from_file_location("fedshuffle_app_under_test", app_dir / "fedshuffle_app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run_config = {**pyproject["tool"]["flwr"]["app"]["config"], "out": str(tmp_path / "out")}
    module.server(FakeGrid(module.client, 2, run_config), server_context(run_config))
    for label, run in zip(
        ("fedshuffle", "scaffold"),
        federated_runs(
            validate(Experiment, json.loads((app_dir / "experiment.json").read_text())),
            AppSettings(overrides="run.rounds=2"),
        ),
    ):
        folder = tmp_path / "out" / label / "seed-3"
        assert json.loads((folder / "summary.json").read_text())["rounds"] == 2
        assert_equal_to_rounding(torch.from_numpy(np.load(folder / "final_params.npy")), simulated(run, 2))
        assert (folder / "metrics.csv").read_text().count("\n") == 3 and (folder / "checkpoint.pt").exists()
    bad = CliRunner().invoke(cli, ["flower-app", str(config), str(tmp_path / "app2"), "--set", "local.batch_size=0"])
    assert (
        bad.exit_code == 2
        and "local.batch_size" in bad.output
        and "Traceback" not in bad.output
        and not (tmp_path / "app2").exists()
    )
