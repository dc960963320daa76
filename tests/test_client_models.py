"""The clients' own models of a method that keeps none (run.score_client_models): y_i = x − Δ_i after a client's last
local training, scored on its own data as FedCDR's x_i are; the server's trajectory is the method's own."""

import numpy as np
import pytest

import fedshuffle as fs
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.results import read_metrics
from fedshuffle.methods.client_models import ClientModels, keep_client_models

LOGISTIC = {
    "experiment": {"name": "own", "seeds": [0]},
    "problem": {"name": "logistic", "l2": 1e-3},
    "data": {"source": "synthetic", "samples": 120, "features": 5, "client_sizes": [10, 15, 20, 20, 25, 30]},
    "local": {"lr": 0.1, "epochs": 2, "batch_size": 4},
    "sampler": {"name": "cyclic", "cohort": 2},
    "run": {"rounds": 9, "eval_every": 1, "dtype": "float64"},
    "variants": [{"label": "RR-CLI", "method": {"name": "rr_cli"}, "aggregation": {"direction": "model_delta"}}],
}


def run(tmp_path, config, **run_settings):
    settings = {**config, "run": {**config["run"], **run_settings}}
    fs.experiment(settings).run(tmp_path / str(sorted(run_settings.items())), progress=False)
    return read_metrics(next((tmp_path / str(sorted(run_settings.items()))).rglob("metrics.csv")))


def test_keeping_the_clients_models_leaves_the_servers_trajectory_and_scores_them(tmp_path):
    plain, kept = run(tmp_path, LOGISTIC), run(tmp_path, LOGISTIC, score_client_models=True)
    np.testing.assert_allclose(kept["loss"], plain["loss"], rtol=1e-12)  # the server model is the method's own
    assert np.isnan(plain["local_loss"]).all() and np.isfinite(kept["local_loss"]).all()
    # before any round every client holds x⁰, the server model: its own loss is the server's (uniform weights)
    assert kept["local_loss_uniform"][0] == pytest.approx(kept["loss"][0], rel=1e-12)
    # each client trained on its own data only: after its rounds its own model fits it better than the server's
    assert kept["local_loss"][-1] < kept["loss"][-1]


def test_one_client_with_full_participation_owns_the_server_model(tmp_path):
    """With one client and the server step 1, x ← x − Δ = y: the client's own model is the server model at every
    round."""
    one = {
        **LOGISTIC,
        "data": {**LOGISTIC["data"], "client_sizes": [120]},
        "sampler": {"name": "full"},
        "variants": [{"label": "FedAvg", "method": {"name": "fedavg"}}],
    }
    kept = run(tmp_path, one, score_client_models=True)
    np.testing.assert_allclose(kept["local_loss"], kept["loss"], rtol=1e-10)


def test_a_method_that_keeps_its_own_is_itself_and_one_that_changes_its_updates_is_refused():
    from fedshuffle.methods.algorithm import build_algorithm

    fedcdr = build_algorithm("fedcdr", {"local": {"lr": 0.1, "epochs": 1}}).method
    assert keep_client_models(fedcdr) is fedcdr
    plain = build_algorithm("rr_cli", {"local": {"lr": 0.1, "epochs": 1}}).method
    assert isinstance(keep_client_models(plain), ClientModels)
    momentum = build_algorithm("fedavg", {"local": {"lr": 0.1, "epochs": 1}, "server": {"global_momentum": 0.9}}).method
    with pytest.raises(ConfigError) as info:
        keep_client_models(momentum)
    assert info.value.field == "run.score_client_models"
