"""Deploying the Flower apps: the fedshuffle version an app is pinned to, the bundled wheel, Flower's default local
simulation offline, and a SuperLink with TLS and SuperNode authentication.

* In process: the app's pyproject.toml depends on the installed fedshuffle's version, or on the wheel it bundles;
  the app's module refuses another installed version, and the handshake a node running another version, each
  with one line naming both versions, before any training message.
* ``flwr run APP`` on Flower's default connection (the local simulation runtime ``flwr`` starts) in a network and
  PID namespace of its own holding nothing but the loopback interface: no index can be reached, Flower's runtime
  installation installs the bundled wheel, and the run reaches the simulation's model; every process it started
  ends with the namespace.
* Certificates (a CA, the SuperLink's for 127.0.0.1) and SuperNode key pairs made in the test: a SuperLink with TLS
  and ``--enable-supernode-auth``, two registered SuperNodes, the simulation's model; a SuperNode whose key is not
  registered, and one that does not trust the CA, are refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import listening
from flower_harness import FLOWER_ENV, FakeGrid, SocketWatch, outside_loopback, run_app, stop_group

for _key in ("FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK"):  # before Flower reads them
    os.environ.setdefault(_key, FLOWER_ENV[_key])
pytest.importorskip(
    "flwr", reason="the Flower integration needs flwr (pip install 'fedshuffle[flower]', Python >= 3.11)"
)
pytest.importorskip("cryptography", reason="the certificates are made with cryptography (installed with flwr)")

from flwr.app import Context, RecordDict  # noqa: E402

from deploy_harness import make_node_keys, secure_federation  # noqa: E402
from fedshuffle.core.errors import ConfigError  # noqa: E402
from fedshuffle.experiments.runner import build_simulation  # noqa: E402
from fedshuffle.experiments.schema import Experiment, validate  # noqa: E402
from fedshuffle.integrations.flower import bundle, client as node_side  # noqa: E402
from fedshuffle.integrations.flower.app import client_app, server_app  # noqa: E402
from fedshuffle.integrations.flower.bundle import installed_version, write_app  # noqa: E402
from fedshuffle.integrations.flower.common import AppSettings, federated_runs  # noqa: E402
from fedshuffle.integrations.flower.messages import TRAIN  # noqa: E402
from fedshuffle.integrations.flower.strategy import FederationError  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent
#: seconds a test with Flower processes may take, start to results (a heavily shared machine may need more)
DEPLOYMENT_SECONDS = float(os.environ.get("FEDSHUFFLE_FLOWER_DEADLINE", "240"))
#: what Flower logs when a SuperNode cannot connect to its SuperLink (flwr.supercore.exit.ExitCode 305) before exiting
SUPERNODE_CONNECTION_FAILED = "Exit Code: 305"


def experiment(rounds: int = 1) -> Experiment:
    """FedShuffle on a small logistic problem of two clients of unequal sizes, both in every round (each message to a
    SuperNode costs a ClientApp process: one round keeps the tests with Flower processes short)."""
    return validate(
        Experiment,
        {
            "experiment": {"name": "deploy-test", "seeds": [7]},
            "problem": {"name": "logistic", "l2": 0.05},
            "data": {
                "source": "synthetic",
                "samples": 24,
                "features": 3,
                "clients": 2,
                "partition": "dirichlet",
                "alpha": 0.8,
            },
            "local": {"lr": 0.2, "batch_size": 3},
            "sampler": {"name": "full"},
            "run": {"rounds": rounds, "eval_every": 1},
            "variants": [{"label": "fedshuffle", "method": {"name": "fedshuffle"}}],
        },
    )


def config_file(folder: Path, exp: Experiment) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "exp.json"
    path.write_text(exp.model_dump_json())
    return path


def assert_reaches_the_simulations_model(out: Path, exp: Experiment, rounds: int = 1) -> None:
    (run,) = federated_runs(exp, AppSettings())
    sim, _ = build_simulation(run.spec, run.seed)
    for _ in range(rounds):
        sim.step()
    got = torch.from_numpy(np.load(out / run.label / f"seed-{run.seed}" / "final_params.npy"))
    torch.testing.assert_close(got, sim.params, rtol=0, atol=1e-12)


def server_context(run_config: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)


def load_app_module(app_dir: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, app_dir / "fedshuffle_app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the pin, the bundled wheel, the version checks ----------------------------------------------------------


def test_the_app_pins_the_installed_fedshuffle_and_can_bundle_its_wheel(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fedshuffle.cli import app as cli
    from flwr.common.config import validate_config

    version = installed_version()
    build_files = [(ROOT / "build").exists(), (ROOT / "src" / "fedshuffle.egg-info").exists()]
    config = config_file(tmp_path, experiment())
    plain = CliRunner().invoke(cli, ["flower-app", str(config), str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    assert tomllib.loads((tmp_path / "plain" / "pyproject.toml").read_text())["project"]["dependencies"] == [
        f"fedshuffle[flower]=={version}"
    ]
    assert not (tmp_path / "plain" / "wheels").exists()

    bundled = CliRunner().invoke(cli, ["flower-app", str(config), str(tmp_path / "bundled"), "--bundle-wheel"])
    assert bundled.exit_code == 0, bundled.output
    app_dir = tmp_path / "bundled"
    pyproject = tomllib.loads((app_dir / "pyproject.toml").read_text())
    (wheel,) = (app_dir / "wheels").glob("*.whl")
    assert wheel.name == f"fedshuffle-{version}-py3-none-any.whl"
    assert pyproject["project"]["dependencies"] == [f"fedshuffle=={version}"]
    assert pyproject["tool"]["uv"]["sources"]["fedshuffle"] == {"path": str(wheel.resolve())}
    assert pyproject["tool"]["uv"]["dependency-metadata"] == [
        {"name": "fedshuffle", "version": version, "requires-dist": []}
    ]
    valid, errors, _ = validate_config(pyproject, check_module=True, project_dir=app_dir)
    assert valid, errors
    with zipfile.ZipFile(wheel) as archive:  # this tree's code, under the version the app pins
        names = set(archive.namelist())
        assert (
            archive.read("fedshuffle/integrations/flower/bundle.py")
            == (ROOT / "src/fedshuffle/integrations/flower/bundle.py").read_bytes()
        )
        metadata = archive.read(f"fedshuffle-{version}.dist-info/METADATA").decode()
    assert "fedshuffle/presets/quickstart.toml" in names and f"\nVersion: {version}\n" in metadata
    assert [
        (ROOT / "build").exists(),
        (ROOT / "src" / "fedshuffle.egg-info").exists(),
    ] == build_files  # built from a copy of the tree

    given = CliRunner().invoke(
        cli, ["flower-app", str(config), str(tmp_path / "given"), "--wheel", str(wheel)]
    )  # a wheel one has
    assert given.exit_code == 0, given.output
    copied = tmp_path / "given" / "wheels" / wheel.name
    assert copied.read_bytes() == wheel.read_bytes()
    assert tomllib.loads((tmp_path / "given" / "pyproject.toml").read_text())["tool"]["uv"]["sources"][
        "fedshuffle"
    ] == {"path": str(copied.resolve())}

    other = tmp_path / "fedshuffle-0.0.1-py3-none-any.whl"
    other.write_bytes(wheel.read_bytes())
    refused = CliRunner().invoke(cli, ["flower-app", str(config), str(tmp_path / "other"), "--wheel", str(other)])
    assert (
        refused.exit_code == 2
        and "--wheel" in refused.output
        and "0.0.1" in refused.output
        and version in refused.output
    )
    assert "Traceback" not in refused.output and not (tmp_path / "other").exists()

    monkeypatch.setattr(
        bundle, "installed_version", lambda: bundle.NOT_INSTALLED
    )  # imported from a source tree, no metadata
    with pytest.raises(ConfigError, match="no fedshuffle distribution is installed") as err:
        write_app(config, tmp_path / "unpinned")
    assert err.value.field == "fedshuffle" and not (tmp_path / "unpinned").exists()


def test_the_apps_module_refuses_to_load_under_another_fedshuffle_version_naming_both(tmp_path, monkeypatch):
    app_dir = write_app(config_file(tmp_path, experiment()), tmp_path / "app")
    module = load_app_module(app_dir, "fedshuffle_app_same_version")
    assert callable(module.server) and callable(module.client)
    monkeypatch.setattr(bundle, "installed_version", lambda: "0.0.1")  # what require_version reads
    with pytest.raises(ConfigError) as err:
        load_app_module(app_dir, "fedshuffle_app_other_version")
    message = str(err.value)
    assert err.value.field == "fedshuffle" and "\n" not in message
    assert "this machine runs fedshuffle 0.0.1" in message and f"made with fedshuffle {installed_version()}" in message


def test_a_node_running_another_fedshuffle_version_is_refused_at_the_handshake_naming_both(monkeypatch):
    exp = experiment()
    monkeypatch.setattr(
        node_side, "installed_version", lambda: "0.0.1"
    )  # the node's side only; the server keeps its own
    grid = FakeGrid(client_app(exp), 2)
    with pytest.raises(FederationError) as err:
        server_app(exp)(grid, server_context({}))
    message = str(err.value)
    assert (
        "\n" not in message
        and "runs fedshuffle 0.0.1" in message
        and f"the server fedshuffle {installed_version()}" in message
    )
    assert {m.metadata.message_type for m in grid.sent} == {"query.fedshuffle"}  # refused before any training message
    monkeypatch.setattr(node_side, "installed_version", installed_version)
    silent = FakeGrid(client_app(exp), 2)  # a node of a fedshuffle before the check: its reply does not say
    answer = silent.app

    def without_version(message, context):
        reply = answer(message, context)
        if message.metadata.message_type == "query.fedshuffle":
            del reply.content["node"]["fedshuffle-version"]
        return reply

    silent.app = without_version
    expected = (
        rf"node 1000 runs fedshuffle unknown \(its reply does not say\), the server fedshuffle {installed_version()}:"
    )
    with pytest.raises(FederationError, match=expected):
        server_app(exp)(silent, server_context({}))
    same = FakeGrid(client_app(exp), 2)
    server_app(exp)(same, server_context({}))
    assert TRAIN in {m.metadata.message_type for m in same.sent}  # the same version trains


# -- Flower's default local simulation, offline -------------------------------------------------------------


#: the namespace's network: loopback, plus a host address (TEST-NET-2) and a default route on it, which is what makes
#: Ray listen on every interface; nothing beyond the namespace is reachable (offline), and nothing in it from outside
NAMESPACE_SETUP = (
    "ip link set lo up && ip addr add 198.51.100.7/32 dev lo && ip route add default dev lo src 198.51.100.7"
)


def namespace_command(command: list[str]) -> list[str]:
    """``command`` as the first process of a network namespace (:data:`NAMESPACE_SETUP`) and a PID namespace (all
    its processes end with it), with /proc of its own."""
    return [
        "unshare",
        "--net",
        "--pid",
        "--fork",
        "--mount-proc",
        "sh",
        "-c",
        NAMESPACE_SETUP + ' && exec "$@"',
        "offline",
        *command,
    ]


def can_isolate() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    try:
        return subprocess.run(namespace_command(["true"]), capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_flowers_default_local_simulation_runs_the_app_offline_from_its_bundled_wheel(tmp_path):
    """``flwr run APP`` with no connection named: Flower's default ``local`` connection, whose SuperLink (simulation
    runtime, runtime dependency installation on, as ``flwr`` starts it) installs the app's dependencies with
    ``uv sync`` into a fresh environment. Without an index the bundled wheel is all it installs. With
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (as the docs say) every socket of the namespace listens on loopback."""
    if not (can_isolate() and listening.available()):
        pytest.skip(
            "needs unshare --net --pid (namespaces of its own) to run Flower offline, and /proc to read its sockets"
        )
    exp = experiment()
    app_dir = write_app(config_file(tmp_path, exp), tmp_path / "app", bundle_wheel=True)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "FLWR_"))}
    env.update(
        FLOWER_ENV,
        FLWR_HOME=str(tmp_path / "flwr-home"),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(HERE)]),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )
    started, seen = time.monotonic(), set()
    command = namespace_command(
        [
            sys.executable,
            str(HERE / "deploy_harness.py"),
            "local-run",
            str(DEPLOYMENT_SECONDS - 20),
            str(app_dir),
            "--run-config",
            f'out="{out}"',
        ]
    )
    with open(tmp_path / "result.json", "wb") as stdout, open(tmp_path / "stderr.txt", "wb") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, start_new_session=True)
    try:
        while process.poll() is None and time.monotonic() - started < DEPLOYMENT_SECONDS:
            try:
                seen.update(listening.listening(listening.process_tree(process.pid), namespace_of=process.pid))
            except (OSError, ValueError):
                pass  # a process of the tree ended while it was read
            time.sleep(0.3)
    finally:
        stop_group(process)
    print(f"flwr run on the default local simulation, offline: {time.monotonic() - started:.1f} s")
    assert process.returncode == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    result = json.loads((tmp_path / "result.json").read_text().strip().splitlines()[-1])
    assert result["status"] == "finished:completed", result["details"][-3000:]
    wheel = app_dir.resolve() / "wheels" / f"fedshuffle-{installed_version()}-py3-none-any.whl"
    assert f"Installed: [fedshuffle=={installed_version()} (from {wheel.as_uri()})]" in result["log"], result["log"][
        -3000:
    ]
    assert_reaches_the_simulations_model(out, exp)
    assert seen, "no listening socket was seen: the check did not run"
    assert [s for s in seen if not listening.is_loopback(s[0])] == [], seen


# -- TLS and SuperNode authentication --------------------------------------------------------------------------


def wait_exit(process: subprocess.Popen, deadline: float) -> int | None:
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return process.poll()


def test_a_superlink_with_tls_and_node_authentication_serves_registered_nodes_and_refuses_others(tmp_path):
    """Certificates and keys made here (``cryptography``); ``flwr supernode register`` adds two nodes' public keys;
    those two SuperNodes (TLS trusting the test's CA, requests signed with their keys) run FedShuffle to the
    simulation's model. A SuperNode with an unregistered key, and one with a registered key that does not trust
    the CA, exit with Flower's connection failure; nothing listens beyond 127.0.0.0/8."""
    deadline = time.monotonic() + DEPLOYMENT_SECONDS
    exp = experiment()
    app_dir = write_app(config_file(tmp_path, exp), tmp_path / "app")
    out = tmp_path / "out"
    work = tmp_path / "federation"
    (run,) = federated_runs(exp, AppSettings())
    summary = out / run.label / f"seed-{run.seed}" / "summary.json"
    with secure_federation(work, deadline) as federation:
        keys = [make_node_keys(work / "keys", name) for name in ("node-0", "node-1", "stranger")]
        for _, public in keys[:2]:
            registered = federation.register(public)
            answer = registered.stdout[registered.stdout.find("{") :]
            assert registered.returncode == 0 and json.loads(answer)["success"], registered.stdout + registered.stderr
        stranger = federation.node("stranger", 'clients="1"', keys[2][0], federation.certificates["ca"], retries=1)
        untrusting = federation.node("no-ca", 'clients="1"', keys[1][0], None, retries=1)
        nodes = [federation.node(str(k), f'clients="{k}"', keys[k][0], federation.certificates["ca"]) for k in range(2)]
        watches = [SocketWatch(p.pid) for p in [federation.processes[0], *nodes]]

        def watch() -> None:
            for w in watches:
                w.sample()

        status, seconds = run_app(
            app_dir,
            federation.connection,
            federation.env,
            f'out="{out}" round-timeout=60.0',
            summary.exists,
            deadline,
            watch,
        )
        listed = federation.flwr(["supernode", "ls", "--format", "json"])
        for process, name, reason in [
            (stranger, "stranger", "Failed to activate SuperNode"),
            (untrusting, "no-ca", "CERTIFICATE_VERIFY_FAILED"),
        ]:
            log = work / f"supernode-{name}.log"
            assert wait_exit(process, deadline) not in (None, 0), log.read_text()[-2000:]
            assert SUPERNODE_CONNECTION_FAILED in log.read_text() and reason in log.read_text(), log.read_text()[-2000:]
    print(f"TLS and node authentication, a round on two SuperNodes: {seconds:.1f} s")
    assert status == "finished:completed", (work / "superlink.log").read_text()[-3000:]
    assert_reaches_the_simulations_model(out, exp)
    assert len(json.loads(listed.stdout)["nodes"]) == 2  # only the registered keys ever became nodes
    assert "https://127.0.0.1" in (work / "superlink.log").read_text()
    sockets = set().union(*(w.seen for w in watches))
    assert sockets and outside_loopback(sockets) == [], outside_loopback(sockets)
