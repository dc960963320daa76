"""Every fedshuffle method on Flower's simulation engine and on a real SuperLink with SuperNodes on 127.0.0.1,
against ``fedshuffle run`` (the in-process tests are tests/test_flower.py; these start processes and take minutes,
so they run beside them).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np
import pytest
import torch

from flower_harness import FLOWER_ENV, local_federation, outside_loopback, run_app, run_child, server_log

for _key in ("FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK"):  # before Flower reads them
    os.environ.setdefault(_key, FLOWER_ENV[_key])
pytest.importorskip(
    "flwr", reason="the Flower integration needs flwr (pip install 'fedshuffle[flower]', Python >= 3.11)"
)

from fedshuffle.core.checkpoint import load_checkpoint  # noqa: E402
from fedshuffle.experiments.results import read_metrics  # noqa: E402
from fedshuffle.experiments.runner import build_simulation  # noqa: E402
from fedshuffle.experiments.session import run_experiment  # noqa: E402
from fedshuffle.integrations.flower.bundle import write_app  # noqa: E402
from fedshuffle.integrations.flower.common import AppSettings, federated_runs, parse_clients
from fedshuffle.integrations.flower.nodedata import write_node_folders  # noqa: E402
from fedshuffle.methods import METHODS  # noqa: E402

from test_flower import (  # noqa: E402  (the in-process tests' helpers)
    DEPLOYMENT_SECONDS,
    HERE,
    ROUNDS,
    assert_equal_to_rounding,
    assert_same_run_folder,
    dropped_in_simulation,
    experiment,
    simulated,
    variant,
)


# -- Flower's simulation engine and a real SuperLink --------------------------------------------------------


def assert_only_loopback(sockets) -> None:
    assert sockets, "no listening socket was seen: the check did not run"
    assert outside_loopback(sockets) == [], outside_loopback(sockets)


def run_on_two_nodes(tmp_path, exp, settings: AppSettings, deadline: float, node_configs: list[str] | None = None):
    """``exp`` as the app ``fedshuffle flower-app`` writes (``settings``), run by ``flwr run`` on a local SuperLink
    and two SuperNodes (long-lived ClientApps where ``node_configs`` give their data) until every run's summary is
    written; it must finish completed. Returns the runs, their results folder and the sockets the processes held."""
    config = tmp_path / "exp.json"
    config.write_text(exp.model_dump_json())
    app_dir = write_app(config, tmp_path / "app", settings)
    out = tmp_path / "out"
    runs = federated_runs(exp, AppSettings())
    summaries = [out / run.label / f"seed-{run.seed}" / "summary.json" for run in runs]
    persistent = node_configs is not None
    with local_federation(tmp_path / "federation", 2, deadline, node_configs, persistent) as (
        connection,
        env,
        watch,
        watches,
    ):
        status, _ = run_app(
            app_dir,
            connection,
            env,
            f'out="{out}" round-timeout=60.0',
            lambda: all(p.exists() for p in summaries),
            deadline,
            watch,
        )
        watch()
    assert status == "finished:completed", (tmp_path / "federation" / "superlink.log").read_text()[-3000:]
    return runs, out, set().union(*(w.seen for w in watches))


def test_every_method_on_flowers_simulation_engine_matches_fedshuffle_run(tmp_path):
    """One Flower simulation (Ray backend bound to 127.0.0.1) runs every registered method in turn on four nodes."""
    exp = experiment([variant(name) for name in METHODS.names()])
    source = tmp_path / "experiment.json"
    source.write_text(exp.model_dump_json())
    out = tmp_path / "out"
    status, log = run_child(
        [sys.executable, str(HERE / "flower_harness.py"), "simulate", str(source), str(out), "4"], 400
    )
    assert status == 0, log[-4000:]
    run_experiment(exp, tmp_path / "simulated", show_progress=False)
    for run in federated_runs(exp, AppSettings()):
        folder = out / run.label / f"seed-{run.seed}"
        assert read_metrics(folder / "timing.csv")["round"].tolist() == list(range(ROUNDS + 1))
        assert_same_run_folder(folder, tmp_path / "simulated" / run.label / f"seed-{run.seed}")
    assert_only_loopback([tuple(s) for s in json.loads((out / "listening.json").read_text())])


def test_a_superlink_and_two_supernodes_on_localhost_run_fedshuffle_and_scaffold_as_the_simulation(tmp_path):
    """flower-superlink and two flower-supernode processes (own process groups, always stopped), the app that
    ``fedshuffle flower-app`` writes, ``flwr run``: 2 rounds of FedShuffle, then 2 of SCAFFOLD with each node's
    control variate carried between rounds; both equal the simulation, and nothing listens beyond 127.0.0.0/8."""
    deadline = time.monotonic() + DEPLOYMENT_SECONDS
    exp = experiment(
        [
            {"label": "fedshuffle", "method": {"name": "fedshuffle"}},
            {"label": "scaffold", "method": {"name": "scaffold"}},
        ],
        clients=2,
        rounds=2,
        seed=7,
        sampler={"name": "full"},
    )
    runs, out, sockets = run_on_two_nodes(tmp_path, exp, AppSettings(), deadline)
    run_experiment(exp, tmp_path / "simulated", show_progress=False)
    for run in runs:
        assert_equal_to_rounding(
            torch.from_numpy(np.load(out / run.label / f"seed-{run.seed}" / "final_params.npy")), simulated(run, 2)
        )
        assert_same_run_folder(
            out / run.label / f"seed-{run.seed}", tmp_path / "simulated" / run.label / f"seed-{run.seed}"
        )
    sim, _ = build_simulation(
        runs[1].spec, runs[1].seed
    )  # SCAFFOLD with its clients' state lost after round 1 ends elsewhere
    sim.step()
    sim.store.created[:] = False
    sim.store.arrays["control"][:] = 0
    sim.step()
    assert float((sim.params - simulated(runs[1], 2)).abs().max()) > 1e-6
    assert_only_loopback(sockets)


def test_a_superlink_and_two_supernodes_with_their_own_data_run_as_the_simulation(tmp_path):
    """The deployment of the issue's "done means": a SuperLink and two SuperNode processes on 127.0.0.1, each hosting
    two clients read from its own folder only (``data-path``), a server that builds no data (``node-data = true``):
    FedShuffle and SCAFFOLD reach ``fedshuffle run``'s models, and the federated evaluation its central scores. Each
    node runs its messages in one long-lived ClientApp process (the worker; the test above uses Flower's process per
    message)."""
    deadline = time.monotonic() + DEPLOYMENT_SECONDS
    exp = experiment(
        [
            {"label": "fedshuffle", "method": {"name": "fedshuffle"}},
            {"label": "scaffold", "method": {"name": "scaffold"}},
        ],
        clients=4,
        rounds=2,
        seed=7,
        sampler={"name": "uniform", "cohort": 2},
        run={"eval_every": 1},
    )
    folders = write_node_folders(exp, 2, tmp_path / "nodes")
    node_configs = [f'data-path="{folder}"' for folder, _ in folders]
    runs, out, sockets = run_on_two_nodes(tmp_path, exp, AppSettings(node_data=True), deadline, node_configs)
    run_experiment(exp, tmp_path / "simulated", show_progress=False)
    for run in runs:
        ours, theirs = out / run.label / f"seed-{run.seed}", tmp_path / "simulated" / run.label / f"seed-{run.seed}"
        assert_equal_to_rounding(torch.from_numpy(np.load(ours / "final_params.npy")), simulated(run, 2))
        for column in ("loss", "grad_norm_sq", "train_accuracy"):
            np.testing.assert_allclose(
                read_metrics(ours / "metrics.csv")[column],
                read_metrics(theirs / "metrics.csv")[column],
                rtol=1e-10,
                err_msg=column,
            )
        assert json.loads((ours / "config.json").read_text())["executor"]["evaluation"] == "federated"
    assert_only_loopback(sockets)


def dropped_by_round(log: str) -> dict[int, set[int]]:
    """The members each round dropped, from the ServerApp's log ("round r: no answer from client(s) …", "round r:
    client(s) … on offline node(s) …")."""
    out: dict[int, set[int]] = {}
    for r, answered, offline in re.findall(
        r"round (\d+): (?:no answer from client\(s\) ([\d, ]+):|client\(s\) ([\d,\- ]+) on offline)", log
    ):
        out.setdefault(int(r), set()).update(parse_clients((answered or offline).replace(" ", "")))
    return out


def test_a_supernode_killed_and_restarted_mid_run_serves_its_clients_again(tmp_path):
    """A SuperLink and two SuperNodes on 127.0.0.1, each with one long-lived ClientApp process (``--isolation process``
    and
    ``python -m fedshuffle.integrations.flower.worker``), SCAFFOLD on clients 0-1 and 2-3 (full participation, each node
    keeping its clients' control variates in its state-dir). Once round 2 is scored node 1 is killed (SIGKILL, its
    processes with it) and started again: it gets a new node id, its clients' work in the round under way is dropped
    (``dropped`` in metrics.csv, the round timeout: the SuperLink still lists the dead node id), the server asks the new
    node for its clients and it serves them to the last round with the state its files kept. The model equals the
    simulation's with exactly the members the server logged as dropped left out of their rounds."""
    deadline = time.monotonic() + DEPLOYMENT_SECONDS
    rounds = 6
    exp = experiment(
        [{"label": "scaffold", "method": {"name": "scaffold"}}],
        clients=4,
        rounds=rounds,
        seed=7,
        sampler={"name": "full"},
    )
    config = tmp_path / "exp.json"
    config.write_text(exp.model_dump_json())
    app_dir = write_app(config, tmp_path / "app")
    (run,) = federated_runs(exp, AppSettings())
    folder = tmp_path / "out" / "scaffold" / f"seed-{run.seed}"
    node_configs = [
        f'clients="{clients}" state-dir="{tmp_path / f"state-{k}"}"' for k, clients in enumerate(("0-1", "2-3"))
    ]
    run_ids: list[int] = []
    events: dict[str, int] = {}

    def metrics_rows() -> list[dict[str, str]]:
        try:
            lines = (folder / "metrics.csv").read_text().splitlines()
        except OSError:
            return []
        return [
            dict(zip(lines[0].split(","), line.split(",")))
            for line in lines[1:]
            if line.count(",") == lines[0].count(",")
        ]

    with local_federation(tmp_path / "federation", 2, deadline, node_configs, persistent=True) as federation:
        connection, env, watch, watches = federation

        def kill_and_restart() -> None:
            watch()
            rows = metrics_rows()
            if "killed" not in events and len(rows) > 2:  # rounds 0, 1, 2 scored
                federation.kill(1)
                federation.start_node(1)
                events["killed"] = len(rows) - 1

        status, _ = run_app(
            app_dir,
            connection,
            env,
            f'out="{tmp_path / "out"}" round-timeout=15.0',
            lambda: (folder / "summary.json").exists(),
            deadline,
            kill_and_restart,
            run_ids,
        )
        log = server_log(run_ids[0], connection, env, deadline - time.monotonic())
        workers = [(tmp_path / "federation" / f"worker-{k}.log").read_text() for k in range(2)]
        supernodes = [(tmp_path / "federation" / f"supernode-{k}.log").read_text() for k in range(2)]
    assert status == "finished:completed", log[-3000:]
    assert events == {"killed": 2}, events
    dropped = dropped_by_round(log)
    assert any(r > 2 and {2, 3} & members for r, members in dropped.items()), log[
        -3000:
    ]  # node 1's clients missed work after the kill
    assert max(dropped) < rounds and int(read_metrics(folder / "metrics.csv")["dropped"][-1]) == sum(
        map(len, dropped.values())
    )
    joined = re.findall(r"node (\d+) joined: it serves client\(s\) 2-3 from now on", log)
    assert len(joined) == 1, log[-3000:]
    assert re.findall(r"SuperNode ID: (\d+)", supernodes[1])[-1] == joined[0]  # the restarted SuperNode's new id
    last_round = load_checkpoint(folder / "checkpoint.pt")["simulation"]["last_round"]
    assert list(np.asarray(last_round)) == [rounds - 1] * 4  # every client's update accepted in the last round
    assert_equal_to_rounding(
        torch.from_numpy(np.load(folder / "final_params.npy")), dropped_in_simulation(run, rounds, dropped).params
    )
    # one ClientApp process per node answered every message its SuperNode received (no process per message)
    for worker, supernode in zip(workers, supernodes):
        assert len(re.findall(r"fedshuffle worker: task \d+ answered", worker)) == supernode.count("Receiving:") > 0
    assert "Start `flwr-clientapp` process" not in "".join(workers + supernodes)
