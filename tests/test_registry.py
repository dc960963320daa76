"""The registry walk over problems, data sources and partitions, and every part listed by ``fedshuffle show``."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError, DataError
from fedshuffle.data.catalog import PARTITIONS, SOURCES, Samples
from fedshuffle.experiments.build import build_problem_and_data
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.methods import METHODS
from fedshuffle.metrics import METRICS
from fedshuffle.problems import PROBLEMS
from fedshuffle.samplers import SAMPLERS
from fedshuffle.server import SERVER_OPTIMIZERS


def _tokens(rng: np.random.Generator) -> Samples:
    """Six-token sequences over a vocabulary of 5 and their next tokens (the shape of LEAF's Shakespeare)."""
    return Samples(rng.integers(0, 5, size=(12, 6)), rng.integers(0, 5, size=12), 5)


if "registry_walk_tokens" not in SOURCES:
    SOURCES.add("registry_walk_tokens", _tokens, "token sequences for the registry walk (tests only)")

#: a data section each problem can be built on from its defaults (images: an .npz of the shape it takes)
DATA_FOR = {
    "quadratic": {"client_sizes": [2, 3]},
    "logistic": {"source": "synthetic", "samples": 40, "features": 3, "partition": "iid", "clients": 4},
    "cnn": {"source": "npz", "partition": "iid", "clients": 2, "shape": (3, 8, 8)},
    "mnist_cnn": {"source": "npz", "partition": "iid", "clients": 2, "shape": (1, 28, 28)},
    "lenet5": {"source": "npz", "partition": "iid", "clients": 2, "shape": (3, 32, 32)},
    "resnet18": {"source": "npz", "partition": "iid", "clients": 2, "shape": (3, 32, 32)},
    "char_lstm": {"source": "registry_walk_tokens", "partition": "iid", "clients": 2},
}
MULTICLASS = {"source": "synthetic", "samples": 40, "features": 3, "classes": 3, "partition": "iid", "clients": 4}
#: a value each declared problem parameter refuses
INVALID_PROBLEM = {"l2": -1.0, "hidden": [0]}


def _images(tmp_path, shape) -> str:
    path = tmp_path / "images.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.normal(size=(4, *shape)), y=rng.integers(0, 3, size=4))
    return str(path)


def _raw(name, tmp_path):
    data = dict(DATA_FOR.get(name, MULTICLASS))
    if data.get("source") == "npz":
        data["path"] = _images(tmp_path, data.pop("shape"))
    return {"problem": {"name": name}, "data": data}


@pytest.mark.parametrize("name", PROBLEMS.names())
def test_every_registered_problem_builds_from_its_defaults_and_names_each_bad_parameter(name, tmp_path):
    entry = PROBLEMS[name]
    assert entry.summary and entry.citation
    problem, data = build_problem_and_data(validate(RunSpec, _raw(name, tmp_path)))
    import torch

    x = problem.init_params(torch.Generator().manual_seed(0), torch.float64)
    assert x.shape == (problem.dim,) and torch.isfinite(
        problem.weighted_loss(x, data.features, data.labels, data.sample_weights())
    )
    takes = set(__import__("inspect").signature(entry.factory).parameters)
    for key, value in INVALID_PROBLEM.items():
        if key not in takes:
            continue
        raw = _raw(name, tmp_path)
        raw["problem"][key] = value
        with pytest.raises(ConfigError) as err:
            build_problem_and_data(validate(RunSpec, raw))
        assert f"problem.{key}" in str(err.value), (name, key, str(err.value))


def test_a_classifier_on_unlabelled_targets_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        build_problem_and_data(validate(RunSpec, {"problem": {"name": "softmax"}, "data": {"client_sizes": [2, 3]}}))
    assert err.value.field == "problem.name" and "quadratic" in err.value.message


@pytest.mark.parametrize("name", PARTITIONS.names())
def test_every_partition_splits_every_training_sample_once_and_names_a_missing_setting(name):
    raw = {"problem": {"name": "softmax"}, "data": {**MULTICLASS, "partition": name, "samples": 60}}
    if name == "sizes":  # blocks of given sizes, not a number of clients
        raw["data"]["client_sizes"] = [10, 20, 30]
        del raw["data"]["clients"]
    try:
        _, data = build_problem_and_data(validate(RunSpec, raw))
    except ConfigError as err:  # a partition that needs more of the data (coarse labels) says so
        assert err.field == "data.partition" and "needs" in err.message
        return
    owned = np.concatenate(data.client_indices)
    assert (
        PARTITIONS[name].summary and len(np.unique(owned)) == len(owned) <= 60
    )  # equal-size splits may leave samples out
    assert len(owned) == 60 or name not in ("sizes", "iid", "dirichlet")
    raw["data"].pop("clients", None), raw["data"].pop("client_sizes", None)
    with pytest.raises(ConfigError) as err:
        build_problem_and_data(validate(RunSpec, raw))
    assert err.value.field in ("data.clients", "data.client_sizes")


@pytest.mark.parametrize("name", SOURCES.names())
def test_every_source_names_what_it_is_missing(name):
    """Built with nothing but its name, a source either works or says which data setting it needs."""
    raw = {
        "problem": {"name": "quadratic" if name == "targets" else "softmax"},
        "data": {"source": name, "download": False},
    }
    try:
        _, data = build_problem_and_data(validate(RunSpec, raw))
    except ConfigError as err:  # a setting it needs, or the file it could not find offline
        assert (err.field.startswith("data.") or isinstance(err, DataError)) and err.message
    else:
        assert data.num_clients >= 1


def test_show_lists_every_registered_part():
    result = CliRunner().invoke(app, ["show", "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    for kind, registry in {
        "methods": METHODS,
        "problems": PROBLEMS,
        "sources": SOURCES,
        "partitions": PARTITIONS,
        "samplers": SAMPLERS,
        "server-optimizers": SERVER_OPTIMIZERS,
        "metrics": METRICS,
    }.items():
        assert [e["name"] for e in listing[kind]] == list(registry.names())
    assert any(e["name"] == "fedshuffle" and e["citation"] for e in listing["methods"])
