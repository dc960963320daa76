"""The Flower server trusts no reply: rogue replies (built here as Flower Messages, fed to the strategy's
aggregation without a network) are dropped with a logged reason, or stop the run with one line, and
never change the model; deployment misuse ends with one line naming the setting or node."""

from __future__ import annotations

import io
import logging
import re

import numpy as np
import pytest
import torch

from flower_harness import FakeGrid
from test_flower import experiment, model, server_context, single_run, variant

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedshuffle.core.errors import ConfigError
from fedshuffle.integrations.flower.app import OneLineErrors, client_app, server_app
from fedshuffle.integrations.flower.common import AppSettings
from fedshuffle.integrations.flower.messages import GRADIENTS, TRAIN
from fedshuffle.integrations.flower.strategy import FederationError, FedShuffleStrategy

ROGUE = 2  # the client whose reply is forged


def scaffold_round():
    """SCAFFOLD (two payload arrays), full participation of 4 clients: the strategy after configure_train of
    round 1, the messages it sent, and the genuine replies."""
    exp = experiment([{"label": "scaffold", "method": {"name": "scaffold"}, "sampler": {"name": "full"}}])
    grid = FakeGrid(client_app(exp), 4)
    logged: list[str] = []
    strategy = FedShuffleStrategy(single_run(exp), log=logged.append)
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid))
    return exp, strategy, messages, grid.send_and_receive(messages), logged


def without_client(exp, client: int):
    """The model after round 1 when ``client``'s reply never came (the reference for a dropped member)."""
    grid = FakeGrid(client_app(exp), 4)
    strategy = FedShuffleStrategy(single_run(exp))
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    sent_to = {m.metadata.message_id: int(m.content["instructions"]["client"]) for m in messages}
    arrays, _ = strategy.aggregate_train(1, [r for r in replies if sent_to[r.metadata.reply_to_message_id] != client])
    return model(arrays)


def forged(reply: Message, sent: Message, *, payload=None, result=None, drop: tuple[str, ...] = ()) -> Message:
    """A reply to ``sent`` with the genuine one's records, some replaced (``payload``/``result``: a function of
    the genuine record, or a record) or removed (``drop``)."""
    records = {key: reply.content[key] for key in ("payload", "result")}
    for key, change in (("payload", payload), ("result", result)):
        if change is not None:
            records[key] = change(records[key]) if callable(change) else change
    return Message(RecordDict({k: v for k, v in records.items() if k not in drop}), reply_to=sent)


def arrays_with(record: ArrayRecord, name: str, make) -> ArrayRecord:
    """``record`` with array ``name`` replaced by ``make(its numpy array)`` (an ndarray or an Array)."""
    out = {key: record[key] for key in record}
    value = make(np.array(record[name].numpy()))
    out[name] = value if isinstance(value, Array) else Array(value)
    return ArrayRecord(out)


def config_with(record: ConfigRecord, **values) -> ConfigRecord:
    out = dict(record)
    out.update({key.replace("_", "-"): value for key, value in values.items()})
    return ConfigRecord(out)


def with_nan(a):
    a[0, 0] = np.nan
    return a


def with_inf(a):
    a[-1, -1] = -np.inf
    return a


def lying_header(a):
    """An Array whose header says float64 of the right shape while its bytes are float32."""
    genuine = Array(a.astype(np.float32))
    return Array(dtype="float64", shape=a.shape, stype=genuine.stype, data=genuine.data)


def garbage(a):
    return Array(dtype="float64", shape=a.shape, stype="numpy.ndarray", data=b"\x93NUMPY not really")


#: rogue replies: how the reply is forged, and what the logged reason must name
ROGUES = {
    "int64 delta": (
        dict(payload=lambda r: arrays_with(r, "delta", lambda a: np.round(a * 1e6).astype(np.int64))),
        r"payload\.delta: expected dtype float64",
    ),
    "bool delta": (
        dict(payload=lambda r: arrays_with(r, "delta", lambda a: a > 0)),
        r"payload\.delta: expected dtype float64.*bool",
    ),
    "float32 control_delta": (
        dict(payload=lambda r: arrays_with(r, "control_delta", lambda a: a.astype(np.float32))),
        r"payload\.control_delta: .*float32",
    ),
    "header lies about the bytes": (
        dict(payload=lambda r: arrays_with(r, "delta", lying_header)),
        r"payload\.delta: .*not a readable|payload\.delta: .*its data",
    ),
    "unreadable bytes": (
        dict(payload=lambda r: arrays_with(r, "delta", garbage)),
        r"payload\.delta: not a readable NumPy array",
    ),
    "a row too many": (
        dict(payload=lambda r: arrays_with(r, "delta", lambda a: np.concatenate([a, a]))),
        r"payload\.delta: expected dtype float64, shape \(1, 3\), got .*shape \(2, 3\)",
    ),
    "a coordinate short": (
        dict(payload=lambda r: arrays_with(r, "delta", lambda a: a[:, :-1].copy())),
        r"got dtype float64, shape \(1, 2\)",
    ),
    "empty delta": (dict(payload=lambda r: arrays_with(r, "delta", lambda a: np.zeros(0))), r"shape \(0,\)"),
    "NaN entry": (dict(payload=lambda r: arrays_with(r, "delta", with_nan)), r"payload\.delta: 1 non-finite entry"),
    "infinite entry": (
        dict(payload=lambda r: arrays_with(r, "control_delta", with_inf)),
        r"payload\.control_delta: 1 non-finite entry",
    ),
    "missing control_delta": (
        dict(payload=lambda r: ArrayRecord({"delta": r["delta"]})),
        r"missing \['control_delta'\]",
    ),
    "an extra array": (
        dict(payload=lambda r: ArrayRecord({**{k: r[k] for k in r}, "x": Array(np.zeros(4))})),
        r"unexpected \['x'\]",
    ),
    "no payload": (dict(drop=("payload",)), r"no 'payload' in the reply"),
    "payload of scalars": (dict(payload=ConfigRecord({"delta": 1.0})), r"payload: expected arrays, got ConfigRecord"),
    "no result": (dict(drop=("result",)), r"no 'result' in the reply"),
    "sample-gradients 10**15": (
        dict(result=lambda r: config_with(r, sample_gradients=10**15)),
        r"result\.sample-gradients: expected an integer in 0\.\.\d+, got 1000000000000000",
    ),
    "negative sample-gradients": (
        dict(result=lambda r: config_with(r, sample_gradients=-5)),
        r"result\.sample-gradients",
    ),
    "sample-gradients as a bool": (
        dict(result=lambda r: config_with(r, sample_gradients=True)),
        r"result\.sample-gradients",
    ),
    "members miscounted": (
        dict(result=lambda r: config_with(r, members=2)),
        r"result\.members: expected an integer in 1\.\.1, got 2",
    ),
    "another round": (dict(result=lambda r: config_with(r, round=7)), r"result\.round"),
    "another client": (dict(result=lambda r: config_with(r, client=0)), r"result\.client"),
    "NaN diagnostic": (
        dict(result=lambda r: config_with(r, **{"extra.loss": float("nan")})),
        r"result\.extra\.loss: expected a finite number",
    ),
    "unknown entry": (dict(result=lambda r: config_with(r, cost="free")), r"result: unexpected entries \['cost'\]"),
}


@pytest.mark.parametrize("case", list(ROGUES))
def test_a_rogue_reply_drops_its_member_with_the_reason_logged_and_never_changes_the_model(case):
    forge, reason = ROGUES[case]
    exp, strategy, messages, replies, logged = scaffold_round()
    sent = {m.metadata.message_id: m for m in messages}
    rogue = [
        forged(r, sent[r.metadata.reply_to_message_id], **forge) if int(r.content["result"]["client"]) == ROGUE else r
        for r in replies
    ]
    arrays, metrics = strategy.aggregate_train(1, rogue)
    assert metrics["dropped"] == 1 and metrics["rejected"] == 1 and metrics["members"] == 3
    assert torch.equal(model(arrays), without_client(exp, ROGUE))  # exactly the round without the rogue member
    assert strategy.half.last_round.tolist() == [0, 0, -1, 0]  # its state is not accepted
    (line,) = [text for text in logged if "invalid reply" in text]
    assert f"client {ROGUE} " in line and "round 1" in line and "\n" not in line
    assert re.search(reason, line), line


def test_with_invalid_reply_stop_a_rogue_reply_stops_the_run_with_one_line():
    exp, _, _, _, _ = scaffold_round()
    strategy = FedShuffleStrategy(single_run(exp), invalid_reply="stop")
    grid = FakeGrid(client_app(exp), 4)
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid))
    genuine = grid.send_and_receive(messages)
    sent = {m.metadata.message_id: m for m in messages}
    replies = [
        forged(r, sent[r.metadata.reply_to_message_id], payload=lambda rec: arrays_with(rec, "delta", with_nan))
        if int(r.content["result"]["client"]) == ROGUE
        else r
        for r in genuine
    ]
    before = strategy.half.params.clone()
    with pytest.raises(FederationError) as info:
        strategy.aggregate_train(1, replies)
    assert (
        "\n" not in str(info.value)
        and f"client {ROGUE} " in str(info.value)
        and "payload.delta: 1 non-finite entry" in str(info.value)
    )
    assert torch.equal(strategy.half.params, before)


def test_a_reply_from_another_node_is_refused():
    exp, strategy, messages, replies, logged = scaffold_round()
    by_client = {int(m.content["instructions"]["client"]): m for m in messages}
    impostor = []
    for reply in replies:
        if int(reply.content["result"]["client"]) == ROGUE:  # answered in the name of client 2 by client 3's node
            reply = Message(RecordDict({k: reply.content[k] for k in ("payload", "result")}), reply_to=by_client[ROGUE])
            reply.metadata.__dict__["_src_node_id"] = by_client[3].metadata.dst_node_id
        impostor.append(reply)
    arrays, metrics = strategy.aggregate_train(1, impostor)
    assert metrics["rejected"] == 1 and torch.equal(model(arrays), without_client(exp, ROGUE))
    assert any("sent by node" in text for text in logged)


def test_a_rogue_gradient_in_fedshuffle_mvrs_exchange_drops_the_member():
    """FedShuffleMVR asks every member for ∇f_i at x^r and x^{r−1} before the round; a NaN or float32 gradient is
    refused there."""
    exp = experiment([variant("fedshuffle_mvr", sampler={"name": "full"})])
    for forge in (lambda a: with_nan(a[None])[0], lambda a: a.astype(np.float32)):
        grid = FakeGrid(client_app(exp), 4)
        original = grid.app

        def app(message, context, forge=forge):
            reply = original(message, context)
            if message.metadata.message_type == GRADIENTS and int(message.content["instructions"]["client"]) == ROGUE:
                reply = Message(
                    RecordDict({"gradients": arrays_with(reply.content["gradients"], "0", forge)}), reply_to=message
                )
            return reply

        grid.app = app
        logged: list[str] = []
        strategy = FedShuffleStrategy(single_run(exp), log=logged.append)
        messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid))
        assert sorted(
            int(m.content["instructions"]["client"]) for m in messages if m.metadata.message_type == TRAIN
        ) == [0, 1, 3]
        arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
        assert metrics["dropped"] == 1 and metrics["rejected"] == 1 and bool(torch.isfinite(model(arrays)).all())
        assert any("gradients.0" in text for text in logged)


# -- deployment misuse: one line ------------------------------------------------------------------


def one_line_log(error: BaseException) -> str:
    """What Flower's ServerApp runner logs for an exception of the app (flwr.common.logger.log with exc_info),
    through the app's filter."""
    from flwr.common.logger import log

    server_app(experiment([variant("fedavg")]))  # installs the filter
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        try:
            raise error
        except BaseException as exc:  # noqa: BLE001 - as Flower's runner catches it
            log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=exc)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


class DuplicateGrid(FakeGrid):
    """Five nodes, two of them told partition-id 0 (one client each)."""

    def __init__(self, app):
        super().__init__(app, 5, node_config=lambda k: {"partition-id": max(k - 1, 0), "num-partitions": 4})


class MalformedHandshakeGrid(FakeGrid):
    """Node 1's handshake reply lacks its fields."""

    def __init__(self, app):
        super().__init__(app, 4)
        original = self.app

        def answer(message, context):
            reply = original(message, context)
            if context.node_id == self.node_of(1) and message.metadata.message_type == "query.fedshuffle":
                reply = Message(RecordDict({"node": ConfigRecord({"partition-id": "one"})}), reply_to=message)
            return reply

        self.app = answer


@pytest.mark.parametrize(
    "grid, run_config, error, text",
    [
        (
            lambda app: FakeGrid(app, 3),
            {"connect-timeout": 0.3},
            FederationError,
            r"node 1000 hosts clients 0 \(num-partitions=3\); the federation has 4 clients",
        ),
        (
            lambda app: FakeGrid(app, 2, hosts=["0-1", "3"]),
            {"connect-timeout": 0.3},
            FederationError,
            r"no node hosts client\(s\) 2 \(2 node\(s\) connected within 0\.3 s\); the run has clients 0\.\.3",
        ),
        (DuplicateGrid, {}, FederationError, r"nodes \d+ and \d+ both host client 0"),
        (
            lambda app: FakeGrid(app, 2, hosts=["0-2", "2-3"]),
            {},
            FederationError,
            r"nodes 1000 and 1001 both host client 2",
        ),
        (
            lambda app: FakeGrid(app, 2, hosts=["0-1", "2-9"]),
            {},
            FederationError,
            r"node 1001 hosts clients 2-9 \(num-partitions=-1\); the federation has 4 clients",
        ),
        (
            lambda app: FakeGrid(app, 2, hosts=["0-1", "3-2"]),
            {},
            FederationError,
            r"node 1001 failed the handshake: .*node-config\.clients: expected client ids \(ASCII digits\) and "
            r"ranges such as '0-4' or '0,3,7', at most 1,000,000 clients, got '3-2'",
        ),
        (
            MalformedHandshakeGrid,
            {},
            FederationError,
            r"node 1001 sent a malformed handshake reply: node\.clients: expected a list of client ids, got None",
        ),
        (
            lambda app: FakeGrid(app, 4),
            {"invalid-reply": "ignore"},
            ConfigError,
            r"run-config\.invalid-reply: unknown policy 'ignore'; accepted: drop, stop",
        ),
        (
            lambda app: FakeGrid(app, 4),
            {"round-timeout": "long"},
            ConfigError,
            r"run-config\.round-timeout: expected float",
        ),
        (lambda app: FakeGrid(app, 4), {"resume": 1}, ConfigError, r"run-config\.resume: expected bool"),
        (
            lambda app: FakeGrid(app, 4, node_config=lambda k: {"partition-id": "zero" if k == 0 else k}),
            {},
            FederationError,
            r"node 1000 failed the handshake: .*node-config\.partition-id: expected an integer \(ASCII digits\), got "
            r"'zero'",
        ),
    ],
)
def test_deployment_misuse_ends_with_one_line_naming_the_node_or_setting(grid, run_config, error, text):
    exp = experiment([variant("fedavg")])
    federation = grid(client_app(exp, {}))
    with pytest.raises(error, match=text) as info:
        server_app(exp)(federation, server_context(run_config))
    assert {m.metadata.message_type for m in federation.sent} <= {"query.fedshuffle"}  # nothing trained
    logged = one_line_log(info.value)
    assert logged.count("\n") == 1 and "Traceback" not in logged and "ServerApp raised an exception" in logged, logged


def test_other_exceptions_keep_their_traceback_in_the_log():
    logged = one_line_log(ZeroDivisionError("a bug"))
    assert "Traceback" in logged and "ZeroDivisionError: a bug" in logged
    assert (
        sum(isinstance(f, OneLineErrors) for f in logging.getLogger("flwr").filters) == 1
    )  # installed once, however many apps


def test_the_invalid_reply_policy_is_a_run_config_setting():
    assert AppSettings.from_run_config({"invalid-reply": "stop"}).invalid_reply == "stop"
    assert AppSettings().invalid_reply == "drop"
    with pytest.raises(ConfigError, match="run-config.invalid-reply"):
        FedShuffleStrategy(single_run(experiment([variant("fedavg")])), invalid_reply="warn")
