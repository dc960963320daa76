"""A results folder cannot run code, write outside itself, hang a command, or pass off another run's
state or edited numbers as a run's own: every such folder ends in one line (or, asked for, a warning).

Each test reproduces an attack on a results folder, written as a hostile user would: a pickled
``os.system`` behind a valid checkpoint header, a checkpoint copied from another seed or variant,
links and FIFOs in place of results files, experiment names that are paths, a summary without its seal.
"""

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import signal
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import toy_config
from fuzzing import nest, unnest
from fedshuffle.cli import app
from fedshuffle.core.checkpoint import MAGIC, OLD_MAGIC, decode, encode, load_checkpoint, save_checkpoint
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import write_atomic, write_json
from fedshuffle.state import ClientStateStore


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=200)


def one_line(result, *statuses):
    """The command ended with one of ``statuses``, its error on one line (``error: ...``, or ``run ...: failed: ...``
    for a run of an experiment), no traceback; returns its standard error."""
    assert result.exit_code in statuses, result.output
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:") or ": failed: " in line]
    assert len(errors) >= 1, result.output
    return result.stderr


@contextlib.contextmanager
def deadline(seconds):
    """Fail instead of waiting forever (a FIFO opened for reading blocks until a writer comes)."""

    def expired(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Payload:
    """Unpickled, runs ``touch MARKER``: what a hostile checkpoint or client-state file carries."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def with_header(payload: bytes, magic: bytes = MAGIC) -> bytes:
    """A checkpoint file around ``payload`` with a correct SHA-256 header (anyone can compute one)."""
    return magic + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def hostile_checkpoints(marker):
    """A pickle of ``os.system``: raw, inside torch.save's zip (in place of the state), and in the first format."""
    zipped = io.BytesIO()
    torch.save({"run": {}, "state": Payload(marker)}, zipped)
    old = io.BytesIO()
    torch.save(Payload(marker), old)
    return {
        "raw pickle": with_header(pickle.dumps(Payload(marker))),
        "torch zip": with_header(zipped.getvalue()),
        "first format": with_header(old.getvalue(), OLD_MAGIC),
    }


@pytest.fixture
def finished(tmp_path):
    """A finished two-seed toy run (20 rounds) and its config."""
    cfg = toy_config(tmp_path, method="fedavg", rounds=20, seeds=(0, 1), eval_every=5)
    result = cli("run", cfg, "--out", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    return cfg, tmp_path / "out"


# -- no code from a checkpoint or a client-state file -----------------------------------------------------------


def test_a_checkpoint_round_trips_numpy_arrays_and_scalars_without_pickled_objects(tmp_path):
    state = {
        "params": torch.arange(5, dtype=torch.float64),
        "created": np.array([True, False, True]),
        "hashes": {"c": np.array([2**64 - 1, 3], dtype=np.uint64)},
        "rows": [{"round": 3, "loss": 0.25, "x": None}],
        "grid": np.arange(6, dtype=np.float32).reshape(2, 3),
        "empty": np.zeros((0, 4)),
        "scalar": np.float64(1.5),
        "count": np.int64(7),
        "pair": (1, "a"),
    }
    save_checkpoint(tmp_path / "c.pt", state, {"config_hash": "abc", "label": "A", "seed": 1, "round": 3})
    back = load_checkpoint(tmp_path / "c.pt", {"config_hash": "abc", "label": "A", "seed": 1})
    assert torch.equal(back["params"], state["params"])
    for key in ("created", "grid", "empty"):
        assert (
            back[key].dtype == state[key].dtype
            and back[key].shape == state[key].shape
            and np.array_equal(back[key], state[key])
        )
    assert back["hashes"]["c"].dtype == np.uint64 and back["hashes"]["c"][0] == 2**64 - 1
    assert back["rows"] == state["rows"] and back["pair"] == (1, "a")
    assert type(back["scalar"]) is float and back["scalar"] == 1.5 and type(back["count"]) is int and back["count"] == 7
    assert decode(encode({"a": [np.array([1, 2])]}))["a"][0].tolist() == [1, 2]
    with pytest.raises(TypeError, match="cannot hold"):
        encode({"x": np.array([object()], dtype=object)})
    with pytest.raises(TypeError, match="cannot hold a Payload"):
        encode({"x": Payload(tmp_path / "m")})


def same_tree(a, b):
    """Equal nested dicts/lists of tensors (bitwise, same dtype), arrays (same dtype) and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_every_methods_simulation_state_survives_the_checkpoint(optimizer, tmp_path):
    """Simulation.state_dict() of every method (server optimizer state, method state, client-state store in
    memory and in files, counters) comes back from checkpoint.pt exactly."""
    from fedshuffle.experiments.runner import build_simulation
    from fedshuffle.experiments.schema import RunSpec, validate
    from fedshuffle.methods import METHODS

    for method in sorted(METHODS):
        cyclic = method in ("rr_cli", "fedcdr")
        raw = {
            "method": {"name": method},
            "local": {"lr": 0.01},
            "server": {"optimizer": optimizer},
            "problem": {"name": "quadratic"},
            "data": {"client_sizes": [1, 2, 3]},
            "sampler": {"name": "cyclic", "cohort": 1} if cyclic else {"name": "uniform", "cohort": 2},
            "run": {"rounds": 3},
        }
        for mapped in (False, True):
            spec = validate(RunSpec, raw)
            sim, _ = build_simulation(spec, 0, str(tmp_path / f"{method}-{mapped}"))
            if mapped and sim.store is None:
                continue
            if mapped:  # the same store in files: rebuilt with no memory for it
                sim.store = type(sim.store)(
                    sim.store.num_clients,
                    sim.store.fields,
                    sim.store.dtype,
                    memory_limit=0,
                    directory=tmp_path / f"{method}-mapped",
                )
            for _ in range(2):
                sim.step()
            state = {"simulation": sim.state_dict(), "rows": [{"round": 2, "loss": 0.5}]}
            store = state["simulation"]["client_store"]
            assert store is None or ("hashes" in store) == mapped and store["created"].any()
            save_checkpoint(tmp_path / "c.pt", state, {"round": 2})
            assert same_tree(load_checkpoint(tmp_path / "c.pt"), state), (method, mapped)


@pytest.mark.parametrize("kind", ["raw pickle", "torch zip", "first format"])
def test_a_malicious_checkpoint_runs_no_code_when_resumed(kind, finished, tmp_path):
    cfg, out = finished
    marker = tmp_path / "marker"
    (out / "seed-0" / "summary.json").unlink()  # unfinished: resume will read its checkpoint
    (out / "seed-0" / "checkpoint.pt").write_bytes(hostile_checkpoints(marker)[kind])
    with pytest.raises(ConfigError, match="checkpoint"):
        load_checkpoint(out / "seed-0" / "checkpoint.pt")
    assert not marker.exists()
    stderr = one_line(cli("run", cfg, "--resume", out, "--quiet"), 3)
    assert not marker.exists(), "the checkpoint ran code"
    assert "seed-0/checkpoint.pt: " in stderr and (
        "objects other than tensors" in stderr or "earlier fedshuffle" in stderr
    )


def test_a_malicious_checkpoint_runs_no_code_when_a_sweep_is_started_again(tmp_path):
    cfg = toy_config(tmp_path, method="fedavg", rounds=10, seeds=(0,), eval_every=5)
    out, marker = tmp_path / "sweep", tmp_path / "marker"
    args = ["sweep", cfg, "--grid", "local.lr=0.004,0.002", "--out", out, "--workers", "1", "--quiet"]
    assert cli(*args).exit_code == 0
    run = next(out.rglob("seed-0"))
    (run / "summary.json").unlink()
    (run / "checkpoint.pt").write_bytes(hostile_checkpoints(marker)["torch zip"])
    one_line(cli(*args), 3)  # no --resume: a sweep started again continues its runs
    assert not marker.exists(), "the checkpoint ran code"


def test_a_malicious_checkpoint_runs_no_code_when_reproduce_is_run_again(finished, tmp_path):
    from fedshuffle.experiments.reproduce import reproduce

    cfg, _ = finished
    out, marker = tmp_path / "reproduced", tmp_path / "marker"
    reproduce([str(cfg)], out, show_progress=False)
    run = out / "toy" / "seed-0"
    (run / "summary.json").unlink()
    (run / "checkpoint.pt").write_bytes(hostile_checkpoints(marker)["torch zip"])
    reproduce([str(cfg)], out, show_progress=False)  # the folder is continued: its runs resume from their checkpoints
    assert not marker.exists(), "the checkpoint ran code"
    assert not (run / "summary.json").exists()  # that run failed, naming its checkpoint, and was not finished


def test_a_malicious_client_state_journal_runs_no_code(tmp_path):
    marker = tmp_path / "marker"
    store = ClientStateStore(4, {"control": 3}, memory_limit=0, directory=tmp_path / "state")
    store.set("control", np.array([1, 2]), torch.ones(2, 3, dtype=torch.float64))
    state = store.state_dict()  # writes the journal, as before checkpoint.pt
    buf = io.BytesIO()
    np.savez(
        buf,
        __tag__=np.array(state["tag"]),
        **{"control.clients": np.array([Payload(marker)], dtype=object), "control.rows": np.zeros((1, 3))},
    )
    write_atomic(tmp_path / "state" / "journal.npz", buf.getvalue())
    resumed = ClientStateStore(4, {"control": 3}, memory_limit=0, directory=tmp_path / "state")
    with pytest.raises(ConfigError, match="journal.npz: damaged client-state journal"):
        resumed.load_state_dict(state)
    assert not marker.exists()


# -- a checkpoint belongs to its run ----------------------------------------------------------------------------


def test_a_checkpoint_copied_from_another_seed_or_variant_is_refused(tmp_path):
    cfg = toy_config(
        tmp_path,
        method="fedavg",
        rounds=20,
        seeds=(0, 1),
        eval_every=5,
        extra='\n[[variants]]\nlabel = "A"\n\n[[variants]]\nlabel = "B"\nlocal = { lr = 0.002 }\n',
    )
    out = tmp_path / "out"
    assert cli("run", cfg, "--out", out, "--quiet").exit_code == 0
    before = (out / "a" / "seed-0" / "metrics.csv").read_bytes()
    for source in (out / "a" / "seed-1", out / "b" / "seed-0"):
        (out / "a" / "seed-0" / "summary.json").unlink(missing_ok=True)
        shutil.copy(source / "checkpoint.pt", out / "a" / "seed-0" / "checkpoint.pt")
        stderr = one_line(cli("run", cfg, "--resume", out, "--quiet"), 3)
        assert "a/seed-0/checkpoint.pt: belongs to another run" in stderr and "TypeError" not in stderr
        assert ("seed: 1 there, 0 here" in stderr) == (source.name == "seed-1") and (
            "label: 'B' there, 'A' here" in stderr
        ) == (source.parent.name == "b")
        assert (out / "a" / "seed-0" / "metrics.csv").read_bytes() == before  # the folder still holds its own run


# -- nothing written outside the results folder, nothing that blocks ------------------------------------------


def test_links_in_a_results_folder_are_refused_and_their_targets_untouched(finished, tmp_path):
    cfg, out = finished
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for link in (out / ".lock", out / ".write-test", out / "seed-0" / ".lock"):
        shutil.rmtree(tmp_path / "copy", ignore_errors=True)
        shutil.copytree(out, tmp_path / "copy", symlinks=True)
        target = tmp_path / "copy" / link.relative_to(out)
        target.unlink(missing_ok=True)
        target.symlink_to(victim)
        (tmp_path / "copy" / "seed-0" / "summary.json").unlink()
        stderr = one_line(cli("run", cfg, "--resume", tmp_path / "copy", "--quiet"), 3, 4)
        assert "symbolic link" in stderr and victim.read_text() == "precious\n", link.name


def test_a_linked_run_or_variant_folder_is_refused(tmp_path):
    cfg = toy_config(
        tmp_path,
        method="fedavg",
        rounds=10,
        seeds=(0,),
        eval_every=5,
        extra='\n[[variants]]\nlabel = "A"\n\n[[variants]]\nlabel = "B"\n',
    )
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    assert cli("run", cfg, "--out", out, "--quiet").exit_code == 0
    for linked in (out / "a", out / "b" / "seed-0"):
        shutil.rmtree(elsewhere, ignore_errors=True)
        shutil.move(linked, elsewhere)
        linked.symlink_to(elsewhere, target_is_directory=True)
        (elsewhere / "summary.json").unlink(missing_ok=True)
        (elsewhere / "seed-0" / "summary.json").unlink(missing_ok=True)
        before = sorted(p.name for p in elsewhere.rglob("*"))
        assert f"{linked}: a symbolic link" in one_line(cli("run", cfg, "--resume", out, "--quiet"), 2)
        assert sorted(p.name for p in elsewhere.rglob("*")) == before
        linked.unlink()
        shutil.move(elsewhere, linked)


def test_a_linked_client_state_file_is_refused(tmp_path, monkeypatch):
    import fedshuffle.experiments.runner as runner_mod

    real = (
        runner_mod.build_simulation
    )  # client state in memory-mapped files whatever its size (the schema's minimum is 1 MiB)
    monkeypatch.setattr(
        runner_mod,
        "build_simulation",
        lambda spec, seed, state_dir=None: real(
            spec.model_copy(update={"run": spec.run.model_copy(update={"state_memory_mb": 0})}), seed, state_dir
        ),
    )
    cfg = toy_config(tmp_path, method="scaffold", rounds=6, seeds=(0,), eval_every=2)
    out = tmp_path / "out"
    assert cli("run", cfg, "--out", out, "--quiet").exit_code == 0
    (state,) = (out / "seed-0" / "client_state").glob("*.bin")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"x" * 10)
    state.unlink()
    state.symlink_to(victim)
    (out / "seed-0" / "summary.json").unlink()
    stderr = one_line(cli("run", cfg, "--resume", out, "--quiet"), 3, 4)
    assert f"{state.name}: a symbolic link" in stderr and victim.read_bytes() == b"x" * 10


@pytest.mark.parametrize("name", ["metrics.csv", "summary.json", "config.json", "timing.csv", "checkpoint.pt"])
def test_a_fifo_in_place_of_a_results_file_never_blocks(name, finished, tmp_path):
    """plot and table refuse the run (or do not need the file); resume refuses a FIFO it must read
    (config.json, the checkpoint of an unfinished run, timing.csv for the plot) and writes a finished
    run's metrics.csv and summary.json again from its checkpoint."""
    cfg, out = finished
    (out / "seed-0" / name).unlink()
    os.mkfifo(out / "seed-0" / name)
    if name == "checkpoint.pt":
        (out / "seed-0" / "summary.json").unlink()
    for command in (("table", out), ("plot", out, "--out", tmp_path / "p")):
        with deadline(60):
            result = cli(*command)
        if result.exit_code or name in ("metrics.csv", "summary.json"):  # those two: the run is refused
            one_line(result, 2)
    with deadline(60):
        result = cli("run", cfg, "--resume", out, "--quiet")
    if name in ("config.json", "checkpoint.pt", "timing.csv"):
        assert f"seed-0/{name}" in one_line(result, 2, 3) and "FIFO" in result.stderr
        assert stat.S_ISFIFO(os.lstat(out / "seed-0" / name).st_mode)
    else:
        assert result.exit_code == 0, result.output
        assert stat.S_ISREG(os.lstat(out / "seed-0" / name).st_mode)


def test_deep_folders_and_the_filesystem_root_are_one_line(finished, tmp_path):
    cfg, out = finished
    nest(out, 1500)
    try:
        for command in (("plot", out), ("table", out), ("run", cfg, "--resume", out, "--quiet")):
            assert "nested more than 16 levels" in one_line(cli(*command), 2), command
    finally:
        unnest(out)
    had_lock = Path("/.lock").exists()
    for command in (
        ("run", cfg, "--resume", "/", "--quiet"),
        ("run", cfg, "--out", "/", "--quiet"),
        ("table", "/"),
        ("plot", "/"),
    ):
        one_line(cli(*command), 2)
    assert Path("/.lock").exists() == had_lock


# -- experiment names are folder names ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["..", "../x", "/tmp/abs", "a\\u0000b", ".", " "])
def test_an_experiment_name_that_is_a_path_is_refused(name, tmp_path, monkeypatch):
    import fedshuffle

    (tmp_path / "work").mkdir()
    cfg = toy_config(tmp_path, method="fedavg", rounds=2, seeds=(0,), eval_every=1)
    cfg.write_text(cfg.read_text().replace("[experiment]\n", f'[experiment]\nname = "{name}"\n'))
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.chdir(tmp_path / "work")
    for command in (("run", cfg, "--quiet"), ("sweep", cfg, "--quiet", "--workers", "1")):
        assert "experiment.name: " in one_line(cli(*command), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not any((tmp_path / "work").iterdir())
    with pytest.raises(ConfigError, match="experiment.name"):
        fedshuffle.experiment({"experiment": {"name": json.loads(f'"{name}"')}, "run": {"rounds": 1}})


def test_flower_app_refuses_a_folder_that_holds_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    for where in (".", ""):
        assert "is not empty" in one_line(cli("flower-app", "quickstart", where), 2)
    assert (tmp_path / "pyproject.toml").read_text() == "[project]\nname = 'mine'\n" and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["pyproject.toml"]
    (tmp_path / "empty").mkdir()
    assert cli("flower-app", "quickstart", "empty").exit_code == 0 and (tmp_path / "empty" / "pyproject.toml").is_file()


# -- the seal: changed or unsealed results are shown only when asked ----------------------------------------


def test_results_without_their_seal_are_refused_unless_asked(finished, tmp_path):
    from fedshuffle.experiments.reproduce import judge
    from fedshuffle.experiments.schema import load_experiment

    cfg, out = finished
    summary = out / "seed-0" / "summary.json"
    doc = json.loads(summary.read_text())
    del doc["check"]
    write_json(summary, doc)
    table = out / "seed-0" / "metrics.csv"
    table.write_text("\n".join(table.read_text().splitlines()[:-1]) + "\n")  # the last evaluation removed: an edit
    for command in (("table", out), ("plot", out, "--out", tmp_path / "p")):
        assert "seed-0/summary.json: not sealed" in one_line(cli(*command), 2)
        shown = cli(*command, "--allow-unsealed")
        assert (
            shown.exit_code == 0 and "warning: " in shown.stderr and "seed-0/summary.json: not sealed" in shown.stderr
        )
    with pytest.raises(ConfigError, match="not sealed"):
        judge("toy", load_experiment(cfg), out)
    table.write_text("")  # an empty table under an unsealed summary: refused the same way, not a crash
    with pytest.raises(ConfigError, match="not sealed"):
        judge("toy", load_experiment(cfg), out)


@pytest.mark.parametrize(
    "name, statuses", [("summary.json", (2,)), ("config.json", (0, 2))]
)  # table and plot need no config.json
def test_a_results_json_holding_a_number_past_pythons_digit_limit_is_one_line(name, statuses, finished, tmp_path):
    _, out = finished
    path = out / "seed-0" / name
    path.write_text(path.read_text().replace("{", '{"huge": ' + "9" * 4301 + ", ", 1))
    for command in (("table", out), ("plot", out, "--out", tmp_path / "p")):
        result = cli(*command)
        if result.exit_code:
            one_line(result, *statuses)
        assert result.exit_code in statuses and result.exception is None or isinstance(result.exception, SystemExit), (
            result.output
        )


# -- permissions ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_results_files_get_the_umask_permissions(umask, mode, tmp_path):
    previous = os.umask(umask)
    try:
        write_atomic(tmp_path / "f.txt", "x")
        assert stat.S_IMODE(os.stat(tmp_path / "f.txt").st_mode) == mode
        if umask == 0o022:
            cfg = toy_config(tmp_path, method="fedavg", rounds=4, seeds=(0,), eval_every=2)
            assert cli("run", cfg, "--out", tmp_path / "out", "--quiet").exit_code == 0
            for name in (
                "metrics.csv",
                "summary.json",
                "config.json",
                "checkpoint.pt",
                "final_params.npy",
                "timing.csv",
            ):
                assert stat.S_IMODE(os.stat(tmp_path / "out" / "seed-0" / name).st_mode) == 0o644, name
            assert stat.S_IMODE(os.stat(tmp_path / "out" / "manifest.json").st_mode) == 0o644
    finally:
        os.umask(previous)


# -- the fuzzer's hostile results folders ------------------------------------------------------------------------


def test_fuzzed_hostile_results_folders_fail_cleanly(tmp_path, monkeypatch):
    """One case of each attack of the fuzzer (links, FIFOs, names as paths, swapped and malicious
    checkpoints, deep folders): a clean error or a correct run, no file written outside, no code run."""
    import fuzzing

    for key, value in fuzzing.environment(tmp_path).items():
        monkeypatch.setenv(key, value)
    template = fuzzing.make_template(tmp_path / "template")
    outcomes = {}
    for seed in range(len(fuzzing.HOSTILE)):
        work = tmp_path / f"case-{seed}"
        work.mkdir()
        result = fuzzing.run_case("hostile", seed, work, template)
        outcomes[result.case.split(":")[0]] = result.outcome
        assert result.outcome not in fuzzing.BAD, (
            f"{result.outcome}: {result.detail} [{result.case}] — replay: python scripts/fuzz.py --replay "
            f"hostile:{seed}"
        )
    assert set(outcomes) == set(fuzzing.HOSTILE) and outcomes["malicious"] == outcomes["swap"] == "clean_error"
