"""Starting a Flower run: the installed Flower must be in the supported range (one line otherwise), and the start
handshake leaves out a node the SuperLink lists but that is dead, as training does, while every client must still be
hosted by a node that answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
from flower_harness import FakeGrid

pytest.importorskip("flwr", reason="the Flower integration needs flwr (pip install 'fedshuffle[flower]')")

from flwr.app import Error, Message

from fedshuffle.experiments.schema import Experiment
from fedshuffle.integrations.flower.app import client_app
from fedshuffle.integrations.flower.common import AppSettings, federated_runs
from fedshuffle.integrations.flower.messages import (
    FLOWER_RANGE,
    FLOWER_SUPPORTED,
    UnsupportedFlower,
    check_flower_version,
)
from fedshuffle.integrations.flower.strategy import FederationError, FedShuffleStrategy

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["1.41.0", "1.41.7", "1.41.1rc2"])
def test_a_flower_in_the_supported_range_is_accepted(version):
    check_flower_version(version)


@pytest.mark.parametrize("version", ["1.42.0", "1.40.3", "2.0.0", "1.4", "unknown"])
def test_a_flower_outside_the_supported_range_is_one_line_naming_both(version):
    with pytest.raises(UnsupportedFlower) as info:
        check_flower_version(version)
    message = str(info.value)
    assert "\n" not in message and f"not the installed {version}" in message and FLOWER_RANGE in message
    assert isinstance(info.value, ImportError)


def test_the_range_is_the_packages_pin_and_the_docs_say_it_and_why():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["flower"]
    assert any(f"flwr[simulation]{FLOWER_RANGE};" in requirement for requirement in extras), extras
    assert FLOWER_SUPPORTED == ((1, 41), (1, 42)) and FLOWER_RANGE == ">=1.41,<1.42"
    page = (ROOT / "docs" / "flower.md").read_text()
    assert f"Flower `{FLOWER_RANGE}`" in page and "internal modules" in page
    assert re.search(r"SuperLink unavailable.*\n?.*check `flwr ls", page)


EXPERIMENT = {
    "experiment": {"name": "handshake", "seeds": [5]},
    "problem": {"name": "logistic", "l2": 0.05},
    "data": {"source": "synthetic", "samples": 48, "features": 3, "clients": 4, "partition": "iid"},
    "local": {"lr": 0.2, "batch_size": 3},
    "sampler": {"name": "full"},
    "run": {"rounds": 2, "eval_every": 1},
    "variants": [{"label": "fedavg", "method": {"name": "fedavg"}}],
}


class GridWithDeadNodes(FakeGrid):
    """A FakeGrid whose ``dead`` nodes are listed by the SuperLink but answer every message with Flower's "node
    unavailable" error reply (error code 5)."""

    def __init__(self, *args, dead: set[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dead = dead

    def push_messages(self, messages) -> list[str]:
        messages = list(messages)
        ids = super().push_messages([m for m in messages if m.metadata.dst_node_id not in self.dead])
        for message in [m for m in messages if m.metadata.dst_node_id in self.dead]:
            self._count += 1
            message.metadata.__dict__["_message_id"] = f"m{self._count}"
            self._replies[message.metadata.message_id] = Message(Error(5, "Node unavailable"), reply_to=message)
            ids.append(message.metadata.message_id)
        return ids


def strategy_and_grid(
    hosts: list[str], dead: set[int], **options
) -> tuple[FedShuffleStrategy, GridWithDeadNodes, list[str]]:
    exp = Experiment.model_validate(EXPERIMENT)
    (run,) = federated_runs(exp, AppSettings())
    logged: list[str] = []
    grid = GridWithDeadNodes(client_app(exp), len(hosts), hosts=hosts, dead=dead)
    return FedShuffleStrategy(run, log=logged.append, **options), grid, logged


def test_a_dead_but_listed_node_is_left_out_when_the_others_host_every_client():
    """Nodes 1000 and 1001 host clients 0-1 and 2-3; node 1002 (listed, dead) claims 2-3 too: the run starts."""
    strategy, grid, logged = strategy_and_grid(["0-1", "2-3", "2-3"], dead={1002}, connect_timeout=30)
    strategy.handshake(grid)
    assert strategy.nodes == {0: 1000, 1: 1000, 2: 1001, 3: 1001}
    assert strategy.online == {1000, 1001}
    assert logged == [
        ("node 1002 is listed but did not answer the handshake (node unavailable): left out unless it answers later")
    ]


def test_a_node_unavailable_at_first_is_asked_again_while_the_handshake_waits():
    strategy, grid, logged = strategy_and_grid(["0-1", "2-3"], dead={1001}, connect_timeout=30, poll_interval=0.05)
    push = grid.push_messages

    def revive(messages):  # node 1001 answers from its second ask on
        replies = push(messages)
        if any(m.metadata.dst_node_id == 1001 for m in messages):
            grid.dead = set()
        return replies

    grid.push_messages = revive
    strategy.handshake(grid)
    assert strategy.nodes == {0: 1000, 1: 1000, 2: 1001, 3: 1001}
    assert len(logged) == 1 and logged[0].startswith("node 1001 is listed but did not answer")


def test_clients_hosted_by_dead_nodes_alone_stop_the_run_naming_them():
    strategy, grid, _ = strategy_and_grid(["0-1", "2-3"], dead={1001}, connect_timeout=0.5, poll_interval=0.05)
    with pytest.raises(FederationError) as info:
        strategy.handshake(grid)
    message = str(info.value)
    assert message.startswith(
        "no node hosts client(s) 2-3 (2 node(s) connected within 0.5 s; unavailable: node 1001 (node unavailable));"
    ), message


def test_a_node_whose_clientapp_raised_still_fails_the_handshake():
    strategy, grid, _ = strategy_and_grid(["0-1", "2-3"], dead=set(), connect_timeout=30)
    app = grid.app

    def failing(message, context):
        if context.node_id == 1001:
            raise RuntimeError("bad node data")
        return app(message, context)

    grid.app = failing
    with pytest.raises(FederationError, match=r"^node 1001 failed the handshake: .*bad node data"):
        strategy.handshake(grid)
