from pathlib import Path

import numpy as np
import pytest
import torch

from fedshuffle.data import FederatedDataset, contiguous_partition, objective_weights


def quadratic_dataset(sizes, targets=None):
    """Clients with contiguous blocks of targets (default: canonical basis, the paper's (36))."""
    total = sum(sizes)
    x = torch.eye(total, dtype=torch.float64) if targets is None else torch.as_tensor(targets, dtype=torch.float64)
    return FederatedDataset(x, torch.zeros(total), contiguous_partition(sizes), objective_weights(np.array(sizes), "size"))


@pytest.fixture
def toy():
    """The FedShuffle paper's quadratic (36): e_1..e_6 split 1/2/3 over three clients."""
    return quadratic_dataset([1, 2, 3])


def params_trajectory(sim, rounds):
    """The global model after each of ``rounds`` rounds, stacked ``(rounds, d)``."""
    out = []
    for _ in range(rounds):
        sim.step()
        out.append(sim.params.clone())
    return torch.stack(out)


def assert_relative_close(a, b, rtol):
    """max |a − b| ≤ rtol · max |b|."""
    err = float((a - b).abs().max() / b.abs().max())
    assert err <= rtol, err


def client_means(data):
    return np.stack([data.features[ix].mean(0).numpy() for ix in data.client_indices])


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own download/solution cache and no inherited data folders."""
    monkeypatch.setenv("FEDSHUFFLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDSHUFFLE_DATA", raising=False)
    monkeypatch.delenv("FEDSHUFFLE_LIBSVM_URL", raising=False)


@pytest.fixture
def shared_data():
    """The offline copies of the real datasets (LIBSVM, ...), beside the repository."""
    if not (SHARED_DATA / "phishing" / "phishing").is_file():
        pytest.skip("real datasets not found beside the repository")
    return SHARED_DATA
