"""Every way the documentation starts Ray or Flower listens on loopback only: each recipe of docs/flower.md, taken
from the page's own text, is run and the listening sockets of all its processes are read while it runs.

Recipes that start Ray run inside a network namespace of their own (``unshare -n``), made to look like a
host on a network (an address besides 127.0.0.1 and a default route, which is what makes Ray listen on
every interface) while reaching nothing, so that a recipe that exposes Ray exposes it to nobody; their
sockets are read in that namespace. The Ray executor's local Ray is checked in tests/test_ray_network.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import listening
from flower_harness import FLOWER_ENV, free_port, scripts_dir, stop_group

pytest.importorskip("flwr", reason="the Flower recipes need flwr (pip install 'fedshuffle[flower]')")
pytest.importorskip("ray", reason="Flower's simulation engine needs Ray")
pytestmark = pytest.mark.skipif(not listening.available(), reason="reads listening sockets from /proc (Linux)")

ROOT = Path(__file__).resolve().parents[1]
#: the page whose recipes are run as written
RECIPES = ROOT / "docs" / "flower.md"
PAGE = RECIPES.read_text()
#: seconds a recipe may take, start to end
RECIPE_SECONDS = 240.0

EXPERIMENT = """
[experiment]
name = "recipe"
seeds = [1]
[problem]
name = "logistic"
l2 = 0.1
[data]
source = "synthetic"
samples = 20
features = 3
clients = 2
partition = "iid"
[local]
lr = 0.1
batch_size = 4
[sampler]
name = "full"
[run]
rounds = 1
[[variants]]
label = "fedshuffle"
method = { name = "fedshuffle" }
"""


def readme_block(language: str, containing: str) -> str:
    """The fenced ``language`` block of :data:`RECIPES` that contains ``containing``."""
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", PAGE, flags=re.S) if containing in b]
    assert len(blocks) == 1, f"expected one {language} block with {containing!r} in {RECIPES.name}, found {len(blocks)}"
    return blocks[0]


def clean_env(tmp_path: Path) -> dict[str, str]:
    """The environment a user would have: no Ray setting, Flower's telemetry off, this tree's fedshuffle."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        FLOWER_ENV,
        FLWR_HOME=str(tmp_path / "flwr-home"),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
        PATH=os.pathsep.join([str(scripts_dir()), env.get("PATH", "")]),
    )  # Flower's commands, as in an activated environment
    return env


#: a network namespace that looks like a host on a network: loopback up, a host address (TEST-NET-2) and a default route
NAMESPACE_SETUP = (
    "ip link set lo up && ip addr add 198.51.100.7/32 dev lo && ip route add default dev lo src 198.51.100.7"
)


def isolated(command: list[str]) -> list[str]:
    """``command`` in a network namespace of its own (:data:`NAMESPACE_SETUP`)."""
    return ["unshare", "-n", "sh", "-c", NAMESPACE_SETUP + ' && exec "$@"', "isolated", *command]


def can_isolate() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    return subprocess.run(isolated(["true"]), capture_output=True, timeout=30).returncode == 0


def run_watched(command: list[str], env: dict[str, str], log: Path, deadline: float) -> set[tuple[str, int, int]]:
    """Run ``command`` (its own process group, always stopped) and return the sockets its process tree listened
    on, sampled every 0.2 s in its network namespace until it exits."""
    seen: set[tuple[str, int, int]] = set()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                seen.update(listening.listening(listening.process_tree(process.pid), namespace_of=process.pid))
            except (OSError, ValueError):
                pass  # a process of the tree ended while it was read
            time.sleep(0.2)
        assert process.poll() is not None, (
            f"the recipe did not finish in {RECIPE_SECONDS:g} s: {log.read_text()[-2000:]}"
        )
    finally:
        stop_group(process)
    assert process.returncode == 0, log.read_text()[-3000:]
    return seen


def listening_processes(seen) -> set[int]:
    return {pid for _, _, pid in seen}


@pytest.fixture
def experiment_file(tmp_path) -> Path:
    path = tmp_path / "my.toml"
    path.write_text(EXPERIMENT)
    return path


def test_the_readme_flower_simulation_recipe_listens_on_loopback_only(tmp_path, experiment_file):
    """The page's ``simulate(...)`` block, as written (the config and results paths replaced), in a clean environment
    (fenced as ``py``, not ``python``: run here, in a process of its own, rather than by tests/test_docs.py)."""
    code = (
        readme_block("py", "simulate(")
        .replace('"my.toml"', repr(str(experiment_file)))
        .replace('"results/flower-sim"', repr(str(tmp_path / "out")))
    )
    command = [sys.executable, "-c", code]
    seen = run_watched(
        isolated(command) if can_isolate() else command,
        clean_env(tmp_path),
        tmp_path / "recipe.log",
        time.monotonic() + RECIPE_SECONDS,
    )
    assert (tmp_path / "out" / "fedshuffle" / "seed-1" / "summary.json").is_file()  # the recipe ran the experiment
    assert len(listening_processes(seen)) >= 3, (
        f"expected the sockets of Ray's GCS, raylet and workers, saw {sorted(seen)}"
    )
    assert [s for s in seen if not listening.is_loopback(s[0])] == []


#: Flower's simulation engine starting its Ray (its RayBackend, as ``run_simulation`` builds it) with the Ray
#: ``init_args`` the README used to recommend, one task run, then stopped
FLOWER_ENGINE_RAY = """
import time
import ray
from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

init_args = {"_node_ip_address": "127.0.0.1", "num_cpus": 1}
backend = RayBackend({"init_args": init_args, "client_resources": {"num_cpus": 1}})
try:
    ray.get(ray.remote(lambda: 1).remote())
    time.sleep(2)
finally:
    backend.terminate()
"""


def test_flowers_engine_with_a_loopback_node_address_listens_beyond_loopback_which_is_why_the_readme_does_not_use_it(
    tmp_path,
):
    """What the README used to say: Flower's simulation engine with Ray's ``_node_ip_address = "127.0.0.1"``. On a host
    with a network its Ray still listens on every interface (shown in a namespace that reaches nothing)."""
    if not can_isolate():
        pytest.skip("needs unshare -n (a network namespace) to start an exposed Ray safely")
    seen = run_watched(
        isolated([sys.executable, "-c", FLOWER_ENGINE_RAY]),
        clean_env(tmp_path),
        tmp_path / "engine.log",
        time.monotonic() + RECIPE_SECONDS,
    )
    assert [s for s in seen if not listening.is_loopback(s[0])], sorted(seen)


#: the CNN benchmark's Flower case (benchmarks/frameworks.py) cut to 4 users of 10 images, 2 per round, one round
BENCHMARK_FLOWER = """
import benchmarks.cross_device_cnn as harness
import benchmarks.frameworks as frameworks

for module in (harness, frameworks):
    module.USERS, module.COHORT, module.PER_USER, module.BATCH = 4, 2, 10, 5
print(frameworks.flower_round_seconds(0, 2))
"""


def test_the_cnn_benchmarks_flower_case_listens_on_loopback_only(tmp_path):
    """benchmarks/frameworks.py starts Ray on 127.0.0.1 before Flower's engine runs (left to itself, the engine starts
    a Ray listening on every interface: the test above); in a namespace that looks like a host on a network."""
    env = clean_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT)])
    command = [sys.executable, "-c", BENCHMARK_FLOWER]
    deadline = time.monotonic() + RECIPE_SECONDS
    seen = run_watched(isolated(command) if can_isolate() else command, env, tmp_path / "benchmark.log", deadline)
    assert "median_s" in (tmp_path / "benchmark.log").read_text()  # the case ran its rounds
    assert len(listening_processes(seen)) >= 3, f"expected the sockets of Ray's GCS, raylet, workers: {sorted(seen)}"
    assert [s for s in seen if not listening.is_loopback(s[0])] == []


def test_the_readme_superlink_recipe_listens_on_loopback_only_and_a_bad_run_config_is_one_line_in_flwr_log(tmp_path):
    """The page's ``flower-superlink`` and ``flower-supernode`` commands (ports replaced by free ones), each in its own
    process group, always stopped: once every one listens, none listens beyond loopback. Then, with the page's
    connection file, an app submitted with a bad run config fails, and ``flwr log`` has one line saying why."""
    lines = [
        line.strip().removesuffix("&").strip()
        for line in readme_block("bash", "flower-superlink").splitlines()
        if line.strip().startswith(("flower-superlink", "flower-supernode"))
    ]
    assert len(lines) == 3
    ports = {documented: str(free_port()) for documented in sorted(set(re.findall(r"\b(9\d{3})\b", " ".join(lines))))}
    env = clean_env(tmp_path)
    (tmp_path / "flwr-home").mkdir()
    processes, deadline = [], time.monotonic() + 90
    try:
        for k, line in enumerate(lines):
            for documented, port in ports.items():
                line = re.sub(rf"\b{documented}\b", port, line)
            args = shlex.split(line)
            args = [str(scripts_dir() / args[0]), *args[1:]] + (
                ["--database", str(tmp_path / "state.db")] if args[0] == "flower-superlink" else []
            )
            with open(tmp_path / f"process-{k}.log", "wb") as log:
                processes.append(
                    subprocess.Popen(
                        args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True
                    )
                )
        wanted, seen = {int(p) for p in ports.values()}, set()
        while time.monotonic() < deadline and not wanted <= {port for _, port, _ in seen}:
            for p in processes:
                assert p.poll() is None, (tmp_path / f"process-{processes.index(p)}.log").read_text()[-2000:]
                seen.update(listening.listening(listening.process_tree(p.pid)))
            time.sleep(0.3)
        for _ in range(5):  # a little longer: sockets opened after the documented ones
            for p in processes:
                seen.update(listening.listening(listening.process_tree(p.pid)))
            time.sleep(0.3)
        status, log = failed_run(tmp_path, env, ports, time.monotonic() + 120)
    finally:
        for p in reversed(processes):
            stop_group(p)
    assert wanted <= {port for _, port, _ in seen}, f"not every documented port was opened: {sorted(seen)}"
    assert [s for s in seen if not listening.is_loopback(s[0])] == []
    assert status["status"] == "finished:failed" and "run-config.round-timeout" in status["status-details"], status
    (line,) = [text for text in log.splitlines() if "ServerApp raised an exception" in text]
    assert (
        "ConfigError: run-config.round-timeout: input should be greater than 0, got -1.0" in line
        and "Traceback" not in log
    ), log


def failed_run(tmp_path: Path, env: dict[str, str], ports: dict[str, str], deadline: float) -> tuple[dict, str]:
    """Submit a two-client app with ``round-timeout=-1.0`` through the page's connection file; the run's final
    status (``flwr ls``) and its log (``flwr log --show``)."""
    import json

    from flower_harness import flwr
    from fedshuffle.integrations.flower.bundle import write_app

    connection = readme_block("ini", "[superlink.local-link]")
    for documented, port in ports.items():
        connection = re.sub(rf"\b{documented}\b", port, connection)
    (tmp_path / "flwr-home" / "config.toml").write_text('[superlink]\ndefault = "local-link"\n\n' + connection)
    experiment = tmp_path / "exp.toml"
    experiment.write_text(EXPERIMENT)
    app = write_app(experiment, tmp_path / "app")
    submitted = flwr(
        ["run", str(app), "local-link", "--run-config", "round-timeout=-1.0", "--format", "json"],
        env,
        deadline - time.monotonic(),
    )
    run_id = json.loads(submitted.stdout)["run-id"]
    while time.monotonic() < deadline:
        listed = flwr(
            ["ls", "local-link", "--run-id", str(run_id), "--format", "json"], env, deadline - time.monotonic()
        )
        status = json.loads(listed.stdout)["runs"][0] if listed.returncode == 0 else {}
        if str(status.get("status", "")).startswith("finished"):
            return status, flwr(["log", str(run_id), "local-link", "--show"], env, deadline - time.monotonic()).stdout
        time.sleep(1.0)
    raise TimeoutError(f"run {run_id} did not finish in time")


def test_sockets_are_read_in_the_network_namespace_of_a_given_process():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        mine = listening.listening({os.getpid()}, namespace_of=os.getpid())
        assert ("127.0.0.1", port, os.getpid()) in mine
