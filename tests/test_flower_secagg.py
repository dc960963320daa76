"""Secure aggregation through Flower's SecAgg+ (fedshuffle.integrations.flower.secagg), on an in-process grid.

* A SecAgg+ run of a sum-only method (FedShuffle, FedNova, FedAvg) takes the simulation's step in every round to
  within the quantization bound K·2c/Q, and ends near ``fedshuffle run``'s model.
* The server never holds a member's update: training replies carry counts only, SecAgg+'s inputs arrive masked.
* Dropouts are SecAgg+'s: a node lost after training is left out of the sum (its members dropped, the weights
  rescaled), too many lost halt the round; a node whose input would be clipped stops the run naming the setting.
* A method that needs each member's update, a federation of one node and bad settings are refused before any message.
* On Flower's simulation engine (Ray on 127.0.0.1, a child process), a SecAgg+ run of FedShuffle ends within the
  bound of ``fedshuffle run``'s model.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flower_harness import FLOWER_ENV, FakeGrid, run_child

for _key in ("FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK"):  # before Flower reads them
    os.environ.setdefault(_key, FLOWER_ENV[_key])
pytest.importorskip(
    "flwr", reason="the Flower integration needs flwr (pip install 'fedshuffle[flower]', Python >= 3.11)"
)

from flwr.app import ArrayRecord, ConfigRecord  # noqa: E402
from flwr.common import bytes_to_ndarray, ndarray_to_bytes  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402

from fedshuffle.core.errors import ConfigError  # noqa: E402
from fedshuffle.experiments.runner import build_simulation  # noqa: E402
from fedshuffle.integrations.flower.app import client_app, server_app  # noqa: E402
from fedshuffle.integrations.flower.common import AppSettings  # noqa: E402
from fedshuffle.integrations.flower.messages import TRAIN, record_tensors  # noqa: E402
from fedshuffle.integrations.flower.secagg import SecureAggregation  # noqa: E402
from fedshuffle.integrations.flower.strategy import FederationError, FedShuffleStrategy, keep_members  # noqa: E402
from fedshuffle.methods import METHODS  # noqa: E402
from test_flower import experiment, server_context, simulated, single_run, variant  # noqa: E402

SECURE = SecureAggregation()
HOSTS = ["0-1", "2-3", "4-5"]


class Transport(FakeGrid):
    """The in-process grid with a network's semantics SecAgg+ relies on: each node gets its own copy of a message
    (Flower's workflow sends one content object to every node, and ``secaggplus_mod`` edits what it receives);
    ``lost`` = {(node, SecAgg+ stage)}: that node's replies in that stage never arrive; ``tampered``: these nodes'
    masked
    inputs arrive with 2³¹ added to every entry; ``received`` keeps every reply."""

    def __init__(
        self, *args, lost: set[tuple[int, str]] = frozenset(), tampered: set[int] = frozenset(), **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lost, self.tampered, self.received = set(lost), set(tampered), []
        app = self.app
        self.app = lambda message, context: app(copy.deepcopy(message), context)

    def push_messages(self, messages) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for message in messages:
            configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
            if configs is not None and (message.metadata.dst_node_id, configs.get(Key.STAGE)) in self.lost:
                self._replies.pop(message.metadata.message_id, None)
            reply = self._replies.get(message.metadata.message_id)
            if (
                configs is not None
                and message.metadata.dst_node_id in self.tampered
                and configs.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS
            ):
                masked = reply.content.config_records[RECORD_KEY_CONFIGS]
                masked[Key.MASKED_PARAMETERS] = [
                    ndarray_to_bytes((bytes_to_ndarray(b) + (1 << 31)) % (1 << 32))
                    for b in masked[Key.MASKED_PARAMETERS]
                ]
        return ids

    def pull_messages(self, message_ids) -> list:
        replies = super().pull_messages(message_ids)
        self.received += replies
        return replies


def federation(name: str, sampler: dict | None = None, rounds: int = 4, lost: set[tuple[int, str]] = frozenset()):
    """Six clients on three nodes (0-1, 2-3, 4-5)."""
    exp = experiment([variant(name, sampler=sampler or {"name": "uniform", "cohort": 4})], clients=6, rounds=rounds)
    return exp, single_run(exp), Transport(client_app(exp), 3, hosts=HOSTS, lost=lost)


def model(arrays) -> torch.Tensor:
    return record_tensors(arrays)["model"]


def secure_round(strategy: FedShuffleStrategy, grid: Transport, r: int, arrays):
    messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
    return strategy.aggregate_train(r, grid.send_and_receive(messages))


@pytest.mark.parametrize(
    "name, sampler",
    [
        ("fedshuffle", {"name": "importance", "cohort": 3}),
        ("fednova", {"name": "uniform", "cohort": 4}),
        ("fedavg", {"name": "uniform", "cohort": 2}),
        ("fedcdr", {"name": "cyclic", "cohort": 2, "order": "shuffle_once"}),
    ],
)
def test_a_secure_run_takes_the_simulations_step_in_every_round_within_the_quantization_bound(name, sampler):
    """Round by round from the same model, the SecAgg+ round's model is the simulation's to within η_g·K·2c/Q (K nodes
    in
    the sum, η_g = 1 here), and the whole run ends within the rounds' bounds of ``fedshuffle run``'s model, which moved
    far more.
    FedNova's ω_i = w_iτ_eff/(p_i‖a_i‖₁) and FedAvg's cohort-normalized w_i/Σ_S w_j travel with the plans like
    FedShuffle's w_i/p_i;
    FedCDR's step Σ_S w_i g_i is a sum too, and its nodes keep each client's (y_i, x_i, x̂_i) across the rounds."""
    exp, run, grid = federation(name, sampler)
    strategy = FedShuffleStrategy(run, secure=SECURE)
    strategy.handshake(grid)
    sim, _ = build_simulation(run.spec, run.seed)
    arrays, bound = strategy.initial_arrays(), 0.0
    start = model(arrays)
    for r in range(1, 5):
        sim.params = model(arrays).clone()
        sim.step()
        arrays, metrics = secure_round(strategy, grid, r, arrays)
        nodes = int(metrics["secagg_nodes"])
        assert metrics["dropped"] == 0 and (2 <= nodes <= 3 if metrics["members"] else nodes == 0)
        gap = float((model(arrays) - sim.params).abs().max())
        assert gap <= SECURE.tolerance(nodes), (r, gap)
        bound += SECURE.tolerance(nodes)
    plain = simulated(run, 4)
    assert float((model(arrays) - plain).abs().max()) <= bound
    assert float((plain - start).abs().max()) > 1e3 * bound


def test_a_round_whose_members_sit_on_one_node_sums_it_with_a_zero_input_from_another():
    """One member per round: SecAgg+ never sums a single node, so a second node inputs zeros; the round is the
    simulation's."""
    exp, run, grid = federation("fedavg", {"name": "uniform", "cohort": 1}, rounds=2)
    strategy = FedShuffleStrategy(run, secure=SECURE)
    strategy.handshake(grid)
    arrays = strategy.initial_arrays()
    for r in (1, 2):
        arrays, metrics = secure_round(strategy, grid, r, arrays)
        assert (metrics["members"], metrics["secagg_nodes"]) == (1, 2)
        assert (
            len(
                {
                    m.metadata.dst_node_id
                    for m in grid.sent
                    if m.metadata.message_type == TRAIN and m.metadata.group_id == str(r) and "plans" in m.content
                }
            )
            == 1
        )
    assert float((model(arrays) - simulated(run, 2)).abs().max()) <= 2 * SECURE.tolerance(2)


def test_the_server_never_holds_a_members_update():
    """Every reply the server receives: training replies carry an empty payload (counts only); SecAgg+'s masked inputs
    have entries beyond Q (an unmasked quantized input lies in 0..Q), and no reply holds a float array of the model's
    size."""
    exp, run, grid = federation("fedshuffle", rounds=2)
    FedShuffleStrategy(run, secure=SECURE).start(grid)
    dim = build_simulation(run.spec, run.seed)[0].params.numel()
    masked = 0
    for reply in grid.received:
        content = reply.content
        if "payload" in content:
            assert isinstance(content["payload"], ArrayRecord) and len(content["payload"]) == 0
        for record in content.array_records.values():
            assert all(array.numpy().size != dim for array in record.values())
        configs = content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is not None and Key.MASKED_PARAMETERS in configs:
            vector = np.concatenate(
                [bytes_to_ndarray(b).ravel() for b in configs[Key.MASKED_PARAMETERS]]
            )  # SecAgg+'s weight factor, then the input
            assert (
                vector.size == dim + 1
                and np.issubdtype(vector.dtype, np.integer)
                and vector.max() > SECURE.quantization_range
            )
            masked += 1
    assert masked >= 4  # two rounds, at least two nodes each


def test_a_node_lost_during_secagg_is_left_out_of_the_sum_and_its_members_dropped():
    """Node 1002 (clients 4, 5) trains but its masked input never arrives: SecAgg+ removes its masks with the other
    nodes'
    shares, and the round is the simulation's on the members of nodes 1000 and 1001 (FedAvg's weights w_i/Σ w_j rescaled
    to them). Losing two of three nodes leaves too few shares: SecAgg+ halts and the round drops every member."""
    exp, run, grid = federation("fedavg", {"name": "full"}, rounds=2, lost={(1002, Stage.COLLECT_MASKED_VECTORS)})
    strategy = FedShuffleStrategy(run, secure=SECURE)
    strategy.handshake(grid)
    sim, _ = build_simulation(run.spec, run.seed)
    rnd, points = sim.open_round()
    kept = keep_members(rnd, rnd.cohort < 4)
    broadcast = sim.broadcast(kept, points, [])
    sim.close_round(kept, points, broadcast, sim.method.client_update(broadcast, kept.plans, {}, sim.trainer(kept)))
    arrays, metrics = secure_round(strategy, grid, 1, strategy.initial_arrays())
    assert (metrics["members"], metrics["dropped"], metrics["secagg_nodes"]) == (4, 2, 2)
    rho = 1.0 / float(sim.data.weights[:4].sum())  # the server rescales the two nodes' sum to the kept members' weights
    assert float((model(arrays) - sim.params).abs().max()) <= rho * SECURE.tolerance(2)
    assert float((model(arrays) - simulated(run, 1)).abs().max()) > 1e3 * SECURE.tolerance(
        2
    )  # leaving them out mattered
    grid.lost |= {(1001, Stage.COLLECT_MASKED_VECTORS)}
    before = model(arrays)
    arrays, metrics = secure_round(strategy, grid, 2, arrays)
    assert (metrics["members"], metrics["dropped"]) == (0, 6) and torch.equal(model(arrays), before)
    assert strategy.half.dropped == 8


def test_a_malformed_masked_input_stops_the_run_instead_of_moving_the_model():
    """SecAgg+ checks no input: a masked input shifted by 2³¹ (mod 2³²) unmasks to a sum far beyond K·c, which the
    server refuses."""
    exp, run, grid = federation("fedshuffle", rounds=1)
    grid.tampered = {1001}
    with pytest.raises(
        FederationError,
        match=r"round 1: the SecAgg\+ sum of \d node\(s\) has entries beyond ±.*a node sent a malformed masked input",
    ):
        FedShuffleStrategy(run, secure=SECURE).start(grid)


def test_an_input_beyond_the_clipping_range_stops_the_run_naming_the_setting():
    exp, run, grid = federation("fedshuffle", rounds=1)
    with pytest.raises(
        FederationError, match=r"outside ±1e-09 \(SecAgg\+ would clip it\): raise run-config secagg-clipping-range"
    ):
        FedShuffleStrategy(run, secure=SecureAggregation(clipping_range=1e-9)).start(grid)


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "fedshuffle_mvr"])
def test_a_method_that_needs_each_members_update_is_refused_with_one_line_before_any_message(name):
    exp = experiment([variant(name)])
    grid = FakeGrid(client_app(exp), 4)
    with pytest.raises(ConfigError) as err:
        server_app(exp)(grid, server_context({"secure-aggregation": True}))
    assert err.value.field == "run-config.secure-aggregation" and grid.sent == []
    assert (
        "\n" not in str(err.value)
        and f"{name!r} runs" in str(err.value)
        and "set secure-aggregation = false for it" in str(err.value)
    )


def test_which_methods_qualify_follows_their_server_half():
    """Sum-only: every method with the default halves (FedAvg's family, FedNova, FedShuffle(Gen), Nastya, RR-CLI,
    FedProx) and
    FedCDR (Σ_S w_i g_i); SCAFFOLD and FedDyn aggregate their updates twice (two weighted sums with last-occurrence
    weights),
    FedShuffleMVR needs each member's full gradients: refused."""
    from fedshuffle.methods.algorithm import build_algorithm

    qualify = {
        name for name in METHODS.names() if build_algorithm(name, {"local": {"lr": 0.1}}).method.server_needs_only_sum
    }
    assert {
        "fedavg",
        "fedavg_rr",
        "fedavg_min",
        "fedavg_mean",
        "fednova",
        "fednova_rr",
        "fedshuffle",
        "fedshuffle_gen",
        "nastya",
        "rr_cli",
        "fedprox",
        "generalized_fedavg",
        "fedcdr",
    } <= qualify
    assert qualify.isdisjoint({"scaffold", "feddyn", "fedshuffle_mvr"})


@pytest.mark.parametrize(
    "run_config, field",
    [
        ({"secure-aggregation": True, "secagg-num-shares": 2}, "run-config.secagg-num-shares"),
        ({"secure-aggregation": True, "secagg-num-shares": 3.5}, "run-config.secagg-num-shares"),
        (
            {"secure-aggregation": True, "secagg-reconstruction-threshold": 3},
            "run-config.secagg-reconstruction-threshold",
        ),
        ({"secure-aggregation": True, "secagg-clipping-range": 0.0}, "run-config.secagg-clipping-range"),
        ({"secure-aggregation": True, "secagg-quantization-range": 1 << 31}, "run-config.secagg-quantization-range"),
        ({"secure-aggregation": 1}, "run-config.secure-aggregation"),
    ],
)
def test_bad_secagg_settings_are_refused_naming_them(run_config, field):
    with pytest.raises(ConfigError) as err:
        SecureAggregation.from_settings(AppSettings.from_run_config(run_config))
    assert err.value.field == field


def test_settings_default_to_flowers_and_a_federation_of_one_node_is_refused_before_training():
    settings = SecureAggregation.from_settings(
        AppSettings.from_run_config({"secure-aggregation": True, "secagg-num-shares": 0.5})
    )
    assert (
        settings == SecureAggregation(0.5, 2, 8.0, 1 << 22) and SecureAggregation.from_settings(AppSettings()) is None
    )
    assert SECURE.tolerance(2) == pytest.approx(2 * 16 / 2**22)
    exp = experiment([variant("fedshuffle")])
    grid = FakeGrid(client_app(exp), 1, hosts=["0-3"])
    with pytest.raises(ConfigError, match="at least 2 nodes; the federation has 1"):
        server_app(exp)(grid, server_context({"secure-aggregation": True}))
    assert not [m for m in grid.sent if m.metadata.message_type == TRAIN]


#: a SecAgg+ run on Flower's simulation engine (``fedshuffle.integrations.flower.simulate``: Ray bound to 127.0.0.1)
ENGINE = """
import os, sys
from flower_harness import FLOWER_ENV
os.environ.update(FLOWER_ENV)
from fedshuffle.integrations.flower import simulate
simulate(sys.argv[1], 4, {"out": sys.argv[2], "round-timeout": 120.0, "secure-aggregation": True}, cpus=2)
"""


def test_a_secure_fedshuffle_run_on_flowers_simulation_engine_ends_within_the_bound_of_fedshuffle_run(tmp_path):
    """Four virtual SuperNodes (one client each), three sampled per round, three rounds: the final model is ``fedshuffle
    run``'s
    to within Σ_rounds 3·2c/Q (every round sums three nodes' inputs), and the model moved far more than that."""
    exp = experiment([variant("fedshuffle", sampler={"name": "uniform", "cohort": 3})], clients=4, rounds=3)
    (tmp_path / "experiment.json").write_text(exp.model_dump_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    status, log = run_child(
        [sys.executable, "-c", ENGINE, str(tmp_path / "experiment.json"), str(tmp_path / "out")], 300, env
    )
    assert status == 0, log[-4000:]
    assert log.count("Secure aggregation completed") == 3
    run = single_run(exp)
    final = torch.from_numpy(np.load(tmp_path / "out" / run.label / f"seed-{run.seed}" / "final_params.npy"))
    plain, bound = simulated(run, 3), 3 * SECURE.tolerance(3)
    assert float((final - plain).abs().max()) <= bound
    assert float((plain - simulated(run, 0)).abs().max()) > 1e3 * bound


def test_the_written_app_carries_the_secagg_settings_off_by_default(tmp_path):
    """``fedshuffle flower-app``'s pyproject.toml lists every key (Flower refuses ``--run-config`` keys an app does
    not declare)."""
    import tomllib

    from fedshuffle.integrations.flower.bundle import write_app

    exp = experiment([variant("fedshuffle")])
    (tmp_path / "exp.json").write_text(exp.model_dump_json())
    config = tomllib.loads((write_app(tmp_path / "exp.json", tmp_path / "app") / "pyproject.toml").read_text())["tool"][
        "flwr"
    ]["app"]["config"]
    assert SecureAggregation.from_settings(AppSettings.from_run_config(config)) is None
    assert (
        SecureAggregation.from_settings(AppSettings.from_run_config({**config, "secure-aggregation": True})) == SECURE
    )


@pytest.mark.parametrize(
    "privacy",
    [
        {"mode": "local", "clip": 0.5, "noise_multiplier": 0.3},
        {"mode": "central", "clip": 0.5, "noise_multiplier": 0.3},
    ],
)
def test_differentially_private_updates_sum_securely_to_the_simulations_private_step(privacy):
    """DP and SecAgg+ compose: members clip (and with local DP noise) their Δ_i before the secure sum, the server adds
    the
    central noise to the sum; each round's model is the DP simulation's to within the quantization bound, and the noise
    moved it."""
    exp = experiment([variant("fedshuffle", sampler={"name": "uniform", "cohort": 4}, privacy=privacy)], clients=6)
    run = single_run(exp)
    grid = Transport(client_app(exp), 3, hosts=HOSTS)
    strategy = FedShuffleStrategy(run, secure=SECURE)
    strategy.handshake(grid)
    sim, _ = build_simulation(run.spec, run.seed)
    plain = build_simulation(
        single_run(experiment([variant("fedshuffle", sampler={"name": "uniform", "cohort": 4})], clients=6)).spec,
        run.seed,
    )[0]
    arrays = strategy.initial_arrays()
    for r in range(1, 4):
        sim.params, plain.params = model(arrays).clone(), model(arrays).clone()
        sim.step(), plain.step()
        arrays, metrics = secure_round(strategy, grid, r, arrays)
        assert float((model(arrays) - sim.params).abs().max()) <= SECURE.tolerance(int(metrics["secagg_nodes"]))
        assert float((sim.params - plain.params).abs().max()) > 1e3 * SECURE.tolerance(3)


def test_adaptive_clipping_is_refused_with_secure_aggregation_in_one_line():
    exp = experiment(
        [variant("fedshuffle", privacy={"mode": "central", "clip": 0.5, "clipping": "adaptive"})], clients=6
    )
    grid = FakeGrid(client_app(exp), 3, hosts=HOSTS)
    with pytest.raises(ConfigError) as err:
        server_app(exp)(grid, server_context({"secure-aggregation": True}))
    assert err.value.field == "run-config.secure-aggregation" and grid.sent == [] and "\n" not in str(err.value)
    assert "adaptive clipping" in str(err.value)
