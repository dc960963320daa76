"""What the partitions give beyond their check (tests/test_checks.py), and every part listed by ``fedshuffle show``."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError
from fedshuffle.data.catalog import PARTITIONS, SOURCES
from fedshuffle.experiments.build import build_problem_and_data
from fedshuffle.experiments.schema import RunSpec, validate
from fedshuffle.methods import METHODS
from fedshuffle.metrics import METRICS
from fedshuffle.problems import PROBLEMS
from fedshuffle.samplers import SAMPLERS
from fedshuffle.server import SERVER_OPTIMIZERS


#: a small labelled set of three classes (no coarse labels)
MULTICLASS = {"source": "synthetic", "samples": 60, "features": 3, "classes": 3, "clients": 4}


def test_a_classifier_on_unlabelled_targets_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        build_problem_and_data(validate(RunSpec, {"problem": {"name": "softmax"}, "data": {"client_sizes": [2, 3]}}))
    assert err.value.field == "problem.name" and "quadratic" in err.value.message


@pytest.mark.parametrize("name", ["sizes", "iid", "dirichlet"])
def test_the_partitions_that_keep_every_sample_give_each_training_sample_to_one_client(name):
    """The walk over every partition (tests/test_checks.py) checks that no sample is given twice; these give all."""
    data = {**MULTICLASS, "partition": name}
    if name == "sizes":
        data = {**{k: v for k, v in data.items() if k != "clients"}, "client_sizes": [10, 20, 30]}
    _, dataset = build_problem_and_data(validate(RunSpec, {"problem": {"name": "softmax"}, "data": data}))
    assert sorted(np.concatenate(dataset.client_indices)) == list(range(60))


def test_a_partition_that_needs_coarse_labels_on_data_without_them_is_refused_naming_the_partition():
    raw = {"problem": {"name": "softmax"}, "data": {**MULTICLASS, "partition": "pachinko"}}
    with pytest.raises(ConfigError) as err:
        build_problem_and_data(validate(RunSpec, raw))
    assert err.value.field == "data.partition" and "coarse labels" in err.value.message, err.value


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
