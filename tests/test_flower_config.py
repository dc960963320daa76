"""The Flower app's configuration and its hooks: the experiment overridden by ordinary run-config keys (as Flower
parses and fuses them), Flower mods in the written ClientApp, and node data written by Flower's dataset tooling
(flwr-datasets partitions: a saved Dataset's Arrow folder, Parquet, CSV) read with pyarrow through the node files'
checks."""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from flower_harness import FakeGrid
from test_flower import assert_equal_to_rounding, experiment, model, server_context, simulated, single_run, variant

from flwr.common.config import flatten_dict, fuse_dicts, parse_config_args

from fedshuffle.core.errors import ConfigError
from fedshuffle.integrations.flower.app import client_app
from fedshuffle.integrations.flower.bundle import write_app
from fedshuffle.integrations.flower.common import AppSettings, federated_runs, settings_table
from fedshuffle.integrations.flower.nodedata import write_node_folders
from fedshuffle.integrations.flower.partitions import Columns
from fedshuffle.integrations.flower.strategy import FederationError, FedShuffleStrategy

TOML = (
    '[experiment]\nname = "tiny"\nseeds = [3]\n[problem]\nname = "logistic"\nl2 = 0.1\n'
    '[data]\nsource = "synthetic"\nsamples = 20\nfeatures = 3\nclients = 2\npartition = "iid"\n'
    '[local]\nlr = 0.1\nbatch_size = 4\n[sampler]\nname = "full"\n[run]\nrounds = 5\n'
    '[[variants]]\nlabel = "FedAvg"\nmethod = { name = "fedavg" }\n'
    '[[variants]]\nlabel = "FedProx"\nmethod = { name = "fedprox" }\nlocal = { prox_mu = 0.5 }\n'
)


@pytest.fixture
def app_dir(tmp_path):
    config = tmp_path / "exp.toml"
    config.write_text(TOML)
    return write_app(config, tmp_path / "app")


def app_config(app_dir) -> dict:
    return tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


# -- the experiment as ordinary run-config keys -----------------------------------------------------------


def test_dotted_run_config_keys_override_the_experiment_as_fedshuffle_run_set_does(app_dir):
    """`flwr run . --run-config "local.lr=0.05 run.rounds=2"`: Flower parses the keys, fuses them with the app's
    declared ones (it refuses an undeclared key), and the app reads the same runs as --set would give."""
    declared = flatten_dict(app_config(app_dir))
    assert declared["local.lr"] == "" and declared["run.rounds"] == "" and declared["local.prox_mu"] == ""
    fused = fuse_dicts(declared, parse_config_args(["local.lr=0.05 run.rounds=2"]))
    exp = json.loads((app_dir / "experiment.json").read_text())
    from fedshuffle.experiments.schema import Experiment, validate

    exp = validate(Experiment, exp)
    by_keys = federated_runs(exp, AppSettings.from_run_config(fused))
    by_set = federated_runs(exp, AppSettings(overrides="local.lr=0.05; run.rounds=2"))
    assert [r.digest for r in by_keys] == [r.digest for r in by_set]
    assert [(r.spec.local.lr, r.spec.run.rounds) for r in by_keys] == [(0.05, 2), (0.05, 2)]
    assert by_keys[1].spec.local.prox_mu == 0.5  # a key left at "" keeps the experiment's (the variant's) value
    with pytest.raises(ValueError, match="local.lrr"):
        fuse_dicts(declared, parse_config_args(["local.lrr=0.05"]))


@pytest.mark.parametrize(
    "run_config, text",
    [
        ({"local.lrr": 0.05}, "run-config local.lrr"),
        ({"local.lr": -1.0}, "run-config local.lr"),
        ({"local.prox_mu": 0.1}, "local.prox_mu"),  # a variant sets it to another value
        ({"nope.lr": 1}, "run-config.nope.lr: unknown setting; an experiment's is section.setting, section one of"),
    ],
)
def test_a_bad_experiment_key_is_one_line_naming_it(run_config, text):
    exp = experiment([variant("fedavg"), variant("fedprox", local={"prox_mu": 0.5})])
    with pytest.raises(ConfigError) as info:
        federated_runs(exp, AppSettings.from_run_config(run_config))
    assert text in str(info.value) and "\n" not in str(info.value)


def test_the_docs_table_and_the_written_app_list_every_key_once(app_dir):
    config = app_config(app_dir)
    keys = [line.split(" | ")[0].strip("| `") for line in settings_table().splitlines()[2:]]
    assert keys == [info.alias for info in AppSettings.model_fields.values() if not info.exclude]
    assert set(keys) <= set(config) and len(set(keys)) == len(keys)
    assert AppSettings.from_run_config(config) == AppSettings()


# -- Flower mods in the written ClientApp ---------------------------------------------------------------


def test_a_mod_added_to_the_written_app_is_called_on_every_message(app_dir, tmp_path):
    module_file = app_dir / "fedshuffle_app.py"
    text = module_file.read_text()
    assert "\nMODS = []\n" in text and "client_app(EXPERIMENT, mods=MODS)" in text
    module_file.write_text(
        text.replace(
            "\nMODS = []\n",
            "\nSEEN = []\n\n\ndef count(message, context, call_next):\n"
            "    SEEN.append(message.metadata.message_type)\n    return call_next(message, context)\n\n\n"
            "MODS = [count]\n",
        )
    )
    spec = importlib.util.spec_from_file_location("fedshuffle_app_with_mods", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run_config = {
        **flatten_dict(app_config(app_dir)),
        "run.rounds": 2,
        "variant": "FedAvg",
        "out": str(tmp_path / "out"),
    }
    grid = FakeGrid(module.client, 2, run_config)
    module.server(grid, server_context(run_config))
    assert module.SEEN == [m.metadata.message_type for m in grid.sent] and len(module.SEEN) == 2 + 2 * 2
    assert set(module.SEEN) == {"query.fedshuffle", "train"}


# -- node data written by flwr-datasets ----------------------------------------------------------------------


def save_to_disk(folder, table: pa.Table, shards: int = 2, classes: int | None = None) -> None:
    """A folder as ``datasets.Dataset.save_to_disk`` writes it: ``data-0000k-of-0000n.arrow`` (Arrow IPC streams),
    ``state.json`` naming them in order, ``dataset_info.json`` with the features (the label a ClassLabel)."""
    folder.mkdir(parents=True)
    names = []
    for k, rows in enumerate(np.array_split(np.arange(table.num_rows), shards)):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(int(rows[0]), len(rows)) if len(rows) else table.slice(0, 0))
        names.append(name)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_type": None}
    (folder / "state.json").write_text(json.dumps(state))
    features = {"x": {"feature": {"dtype": "float64", "_type": "Value"}, "_type": "Sequence"}}
    features["label"] = (
        {"names": [str(c) for c in range(classes)], "_type": "ClassLabel"} if classes else {"dtype": "int64"}
    )
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))


def partition_table(npz) -> pa.Table:
    with np.load(npz) as saved:
        x, y = saved["x"], saved["y"]
    return pa.table({"id": [f"row-{k}" for k in range(len(y))], "x": list(x), "label": y})


def as_partitions(folders, form: str) -> None:
    """Each node's client-<id>.npz rewritten in ``form``: a saved Dataset's folder, Parquet or CSV."""
    for folder, clients in folders:
        for client in clients:
            npz = folder / f"client-{client}.npz"
            table = partition_table(npz)
            if form == "arrow":
                save_to_disk(folder / f"client-{client}", table, classes=3)
            elif form == "parquet":
                pq.write_table(table, folder / f"client-{client}.parquet")
            else:
                flat = np.stack(table.column("x").to_pylist())
                columns = {f"f{j}": flat[:, j] for j in range(flat.shape[1])}
                pa_csv.write_csv(pa.table({**columns, "label": table.column("label")}), folder / f"client-{client}.csv")
            npz.unlink()


@pytest.mark.parametrize("form", ["arrow", "parquet", "csv"])
def test_nodes_with_flwr_datasets_partitions_reach_the_simulations_model(tmp_path, form):
    exp = experiment(
        [variant("fedavg", sampler={"name": "uniform", "cohort": 3})],
        clients=6,
        rounds=3,
        problem={"name": "softmax", "l2": 0.05},
        data={"classes": 3},
    )
    run = single_run(exp)
    folders = write_node_folders(exp, 2, tmp_path / "nodes")
    as_partitions(folders, form)
    columns = {"feature-columns": "f0,f1,f2"} if form == "csv" else {"feature-columns": "x"}
    grid = FakeGrid(
        client_app(exp), 2, node_config=lambda k: {"data-path": str(folders[k][0]), **columns}, hosts=[None, None]
    )
    server = FedShuffleStrategy(run)  # it holds the data: each client's rows' digest is checked against it
    result = server.start(grid)
    assert server.nodes == {0: 1000, 1: 1000, 2: 1000, 3: 1001, 4: 1001, 5: 1001}
    assert_equal_to_rounding(model(result.arrays), simulated(run, 3))


def refused(tmp_path, write, node_config=None) -> str:
    """The one line a server gets from a node whose client 1 is written by ``write(folder)``."""
    exp = experiment([variant("fedavg")], clients=2, problem={"name": "softmax", "l2": 0.05}, data={"classes": 3})
    folders = write_node_folders(exp, 1, tmp_path / "nodes")
    folder = folders[0][0]
    table = partition_table(folder / "client-1.npz")
    (folder / "client-1.npz").unlink()
    write(folder, table)
    config = {"data-path": str(folder), "feature-columns": "x", **(node_config or {})}
    grid = FakeGrid(client_app(exp), 1, node_config=lambda k: config, hosts=[None])
    with pytest.raises(FederationError) as info:
        FedShuffleStrategy(single_run(exp), connect_timeout=5).start(grid)
    assert "\n" not in str(info.value)
    return str(info.value)


def with_column(table: pa.Table, name: str, values) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, pa.array(values))


@pytest.mark.parametrize(
    "write, node_config, text",
    [
        (  # the ClassLabel says 2 classes, a label is 2
            lambda f, t: save_to_disk(f / "client-1", with_column(t, "label", [2] * t.num_rows), classes=2),
            None,
            r"client-1: y\[0\] = 2: labels must be class indices 0\.\.1",
        ),
        (
            lambda f, t: pq.write_table(
                with_column(t, "x", [[np.nan, 0.0, 0.0]] + t.column("x").to_pylist()[1:]), f / "client-1.parquet"
            ),
            None,
            r"client-1\.parquet: x\[0\]: features must be finite",
        ),
        (
            lambda f, t: pq.write_table(t, f / "client-1.parquet"),
            {"feature-columns": "id"},
            r"client-1\.parquet: column 'id' holds string, not numbers",
        ),
        (
            lambda f, t: pq.write_table(t, f / "client-1.parquet"),
            {"label-column": "y"},
            r"client-1\.parquet: no label column 'y' \(node config label-column\)",
        ),
        (
            lambda f, t: pq.write_table(
                with_column(t, "x", [[0.0]] + t.column("x").to_pylist()[1:]), f / "client-1.parquet"
            ),
            None,
            r"client-1\.parquet: column 'x' holds rows of different lengths",
        ),
        (
            lambda f, t: (f / "client-1.csv").write_text("a,b\n1,2\n"),
            None,
            r"client-1\.csv: no label column 'label'",
        ),
        (
            lambda f, t: (pq.write_table(t, f / "client-1.parquet"), save_to_disk(f / "client-1", t)),
            None,
            r"holds client 1 twice \(client-1, client-1\.parquet\)",
        ),
    ],
)
def test_a_bad_partition_is_refused_with_one_line_naming_the_node_and_the_file(tmp_path, write, node_config, text):
    line = refused(tmp_path, write, node_config)
    assert line.startswith("node 1000 failed the handshake") and re.search(text, line), line


def test_the_node_config_names_the_columns():
    assert Columns.from_node_config({}) == Columns(None, "label")
    assert Columns.from_node_config({"feature-columns": "a, b", "label-column": "y"}) == Columns(("a", "b"), "y")
    for config in ({"feature-columns": "a,,b"}, {"feature-columns": "label"}, {"label-column": 3}):
        with pytest.raises(ConfigError, match="node-config"):
            Columns.from_node_config(config)
