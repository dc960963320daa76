import functools
import hashlib
import http.server
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fedshuffle.data import FederatedDataset, contiguous_partition, objective_weights
from fedshuffle.methods import METHODS

import progress
import termination

# The cores shared among the parallel workers (pytest-xdist), for this process and the commands the tests
# start: workers each running every core's worth of operator threads make every parallel call wait for
# time slices (a 123 × 123 eigendecomposition took 0.7 s instead of 0.6 ms while another process ran).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def pytest_addoption(parser):
    progress.add_options(parser)


@pytest.hookimpl(trylast=True)  # after pytest-xdist has set up its session
def pytest_configure(config):
    termination.stop_on_sigterm()  # SIGTERM unwinds the tests, stopping the processes they started
    progress.register(config)


def quadratic_dataset(sizes, targets=None):
    """Clients with contiguous blocks of targets (default: canonical basis, the paper's (36))."""
    total = sum(sizes)
    x = torch.eye(total, dtype=torch.float64) if targets is None else torch.as_tensor(targets, dtype=torch.float64)
    return FederatedDataset(
        x, torch.zeros(total), contiguous_partition(sizes), objective_weights(np.array(sizes), "size")
    )


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
    monkeypatch.delenv("FEDSHUFFLE_MIRROR", raising=False)


@pytest.fixture
def shared_data():
    """The offline copies of the real datasets (LIBSVM, ...), beside the repository."""
    if not (SHARED_DATA / "phishing" / "phishing").is_file():
        pytest.skip("real datasets not found beside the repository")
    return SHARED_DATA


#: the sections an algorithm's settings are in; a name two of them declare is the first one's when written bare
ALGORITHM_SECTIONS = ("local", "aggregation", "method", "server", "schedule")


def _flat_settings():
    """Each setting the algorithm's sections declare (their own and their parts': the methods', the server
    optimizers', the schedules'), key → (section, setting): as ``<section>_<setting>`` (``server_lr``,
    ``schedule_name``) and, as the first section declaring it, by its name (``lr`` is ``local.lr``)."""
    from fedshuffle.experiments.schema import RunSpec
    from fedshuffle.schedules import SCHEDULES
    from fedshuffle.server import SERVER_OPTIMIZERS

    parts = {"method": METHODS, "server": SERVER_OPTIMIZERS, "schedule": SCHEDULES}
    prefixed, bare = {}, {}
    for section in ALGORITHM_SECTIONS:
        names = list(RunSpec.model_fields[section].annotation.model_fields)
        if section in parts:
            names += [s for entry in parts[section].entries() for s in entry.setting_names()]
        for name in names:
            prefixed[f"{section}_{name}"] = (section, name)
            bare.setdefault(name, (section, name))
    return {**bare, **prefixed}


def nested(flat):
    """``{"lr": 0.1, "server_lr": 2}`` → ``{"local": {"lr": 0.1}, "server": {"lr": 2}}``."""
    out, declared = {}, _flat_settings()
    for key, value in flat.items():
        section, name = declared[key]
        out.setdefault(section, {})[name] = value
    return out


def build_flat(name, flat=None, rounds=1):
    """:func:`fedshuffle.build_algorithm` with the parts' settings written flat."""
    from fedshuffle import build_algorithm

    return build_algorithm(name, nested(flat or {}), rounds)


@pytest.fixture(scope="session", autouse=True)
def nothing_listens_beyond_loopback():
    """Nothing the test suite starts (Ray, servers) listens on an interface other than loopback: the
    listening sockets of this process tree are polled all along (tests/listening.py)."""
    import listening

    if not listening.available():
        yield
        return
    with listening.Watch() as watch:
        yield
    assert not watch.seen, f"the test suite listened beyond loopback: {sorted(watch.seen)}"


@pytest.fixture
def server(tmp_path):
    """A static HTTP server on 127.0.0.1 serving ``tmp_path/www``; yields (base URL ending in "/", folder,
    request log); always shut down."""
    root = tmp_path / "www"
    root.mkdir()
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", root, requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def sha(data: bytes) -> str:
    """The SHA-256 hex digest the loaders verify."""
    return hashlib.sha256(data).hexdigest()


TOY_CONFIG = """
[experiment]
seeds = {seeds}
[problem]
name = "quadratic"
[data]
client_sizes = [1, 2, 3]
[method]
name = "{method}"
[local]
lr = 0.004
[server]
momentum = 0.5
[sampler]
name = "uniform"
cohort = 2
[run]
rounds = {rounds}
eval_every = {eval_every}
"""


def toy_config(
    tmp_path, *, method: str, rounds: int, seeds=(0,), eval_every: int, name: str = "toy.toml", extra: str = ""
) -> Path:
    """A small quadratic experiment file (three clients of sizes 1, 2, 3; 2 per round) for the CLI tests."""
    path = tmp_path / name
    path.write_text(TOY_CONFIG.format(method=method, rounds=rounds, seeds=list(seeds), eval_every=eval_every) + extra)
    return path
