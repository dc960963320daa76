"""Fuzz kinds for what a run must not trust: plugins a config names, a node's own data files, a checkpoint
that decodes but is not the run's state, privacy settings at the accountant's edges, signals during start-up
and a long ``TMPDIR``.

Each case is drawn from ``random.Random(f"{kind}:{seed}")`` and ends as one of :data:`fuzzing.OUTCOMES`:

* ``plugins`` — a module beside the config or in the working folder (it writes a marker file, exits, raises or
  does not parse), a config naming it (or a path, another module, nothing), and a consent on the command line,
  in the environment, for another module or none; ``show``, ``run``, ``inspect``, ``data`` or ``sweep`` reads
  the config. Importing without consent, or an import not announced, is ``nonsense``.
* ``nodedata`` — one client file of a node's folder (as ``fedshuffle flower-split`` writes it) replaced by
  labels outside the classes, fractional or non-finite labels, non-finite features, wrong shapes, a forged
  header, a pickled array, a FIFO, a folder, a truncated archive or a non-ASCII client number, then read as the
  node reads it. Reading it without an error naming the file is ``nonsense`` unless the arrays are sound.
* ``checkpoints`` — a run's checkpoint decoded, changed (an extra or missing key, a string counter, another
  dtype or shape, rows emptied or replaced) and written again with a correct header and digest, then resumed.
  A resume that finishes with other numbers than the uninterrupted run is ``nonsense``.
* ``privacy`` — ``[privacy]`` with σ, δ and C drawn from the edges of what the accountant evaluates. A run
  that finishes with an ε below 0 or not a number, or without its summary, is ``nonsense``.
* ``signals`` — ``python -m fedshuffle run`` (one or two worker processes) sent SIGINT or SIGTERM after
  0.05–8 s, during start-up or while it runs. Anything but exit 0/130/143 with one line and no traceback (or,
  before the interpreter ran any of fedshuffle's code, the signal's own ending or, for Ctrl-C, Python's own
  start-up message: ``_interpreter_start``) is a ``traceback``; a process of its group still alive after it
  ended, or a resume that does not finish with the uninterrupted run's numbers, is ``nonsense``.
* ``tmpdir`` — ``--workers 2`` under a ``TMPDIR`` of 90–250 characters (existing or not, with spaces or
  non-ASCII letters). Anything but the numbers of the run without workers is ``nonsense``.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from termination import signals_by_default

from fuzzing import CASE_SECONDS, Hang, Result, _forged_npy, _tail, invoke, time_limit, wall_limit

#: a few rounds of a tiny problem, two variants (one with client state); seeds from the command line
CONFIG = """[local]
lr = 0.1
[problem]
name = "logistic"
[data]
source = "synthetic"
samples = 40
features = 3
clients = 4
partition = "iid"
[run]
rounds = {rounds}
eval_every = 1
checkpoint_every = 1
[[variants]]
label = "A"
method = {{ name = "fedavg" }}
[[variants]]
label = "B"
method = {{ name = "scaffold" }}
"""


def _config(folder: Path, rounds: int = 4, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "c.toml"
    path.write_text(CONFIG.format(rounds=rounds) + extra)
    return path


def _finals(folder: Path) -> dict[str, np.ndarray]:
    """Every run's final parameters under ``folder``, by path relative to it."""
    return {str(p.relative_to(folder)): np.load(p) for p in sorted(folder.rglob("final_params.npy"))}


def _differs(mine: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> str:
    if sorted(mine) != sorted(reference):
        return f"runs {sorted(mine)} instead of {sorted(reference)}"
    return next(
        (f"{k} differs from the uninterrupted run" for k in mine if not np.array_equal(mine[k], reference[k])), ""
    )


# -- plugins ---------------------------------------------------------------------------------------------------

PLUGIN_BODIES = {
    "marker": "open({marker!r}, 'w').write('imported')\n",
    "exit0": "open({marker!r}, 'w').write('imported')\nimport sys\nsys.exit(0)\n",
    "exit3": "import sys\nsys.exit(3)\n",
    "raise": "open({marker!r}, 'w').write('imported')\nraise RuntimeError('plugin failed on import')\n",
    "keyboard": "raise KeyboardInterrupt\n",
    "syntax": "def (:\n",
    "registers": (
        "open({marker!r}, 'w').write('imported')\nfrom fedshuffle.problems import PROBLEMS\n"
        "PROBLEMS.add({name!r}, PROBLEMS['logistic'].factory, 'a copy of logistic', 'fuzz')\n"
    ),
}


def run_plugin_case(seed: int, work: Path) -> Result:
    rng = random.Random(f"plugins:{seed}")
    module = f"fuzzplugin_{seed}"
    behaviour = rng.choice(sorted(PLUGIN_BODIES))
    marker = work / "imported.txt"
    configs = work / "configs"
    configs.mkdir()
    home = rng.choice([configs, work])
    (home / f"{module}.py").write_text(PLUGIN_BODIES[behaviour].format(marker=str(marker), name=f"logistic_{seed}"))
    named = rng.choice([module, module, module, f"../{module}", f"{module}.py", "", "this_is_not_installed", "os"])
    config = _config(configs, rounds=2, extra=f"[experiment]\nplugins = {json.dumps([named] if named else [])}\n")
    consent = rng.choice(["none", "none", "cli", "env", "other", "both"])
    command = rng.choice(["show", "run", "inspect", "data", "sweep"])
    argv = {
        "show": ["show", str(config)],
        "run": ["run", str(config), "--out", str(work / "out"), "--quiet", "--workers", "1"],
        "inspect": ["inspect", str(config)],
        "data": ["data", str(config), "--out", str(work / "data")],
        "sweep": ["sweep", str(config), "--grid", "local.lr=0.1,0.2", "--out", str(work / "sweep"), "--quiet"],
    }[command]
    if consent in ("cli", "both"):
        argv += ["--plugins", module]
    if consent == "other":
        argv += ["--plugins", "some_other_module"]
    environment = {"FEDSHUFFLE_PLUGINS": module} if consent in ("env", "both") else {}
    previous = {k: os.environ.get(k) for k in environment}
    os.environ.update(environment)
    try:
        result, output = invoke(argv, work)
    finally:
        for k, v in previous.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        sys.modules.pop(module, None)
    result.case = f"{command}: plugins = [{named!r}] ({behaviour} in {home.name}), consent {consent}"
    # consent to a module covers its submodules (importing ``fuzzplugin_0.py`` imports ``fuzzplugin_0`` first)
    consented = consent in ("cli", "env", "both") and (named == module or named.startswith(f"{module}."))
    if marker.exists() and not consented:
        return Result("nonsense", "the plugin was imported without consent", result.case)
    if marker.exists() and module not in output:
        return Result("nonsense", "the plugin was imported without a line saying so", result.case)
    if result.outcome == "ran" and named.startswith(module) and not consented:
        return Result("nonsense", "a config naming an unconsented plugin ran", result.case)
    if result.outcome == "ran" and behaviour in ("exit0", "exit3", "raise", "keyboard", "syntax") and consented:
        return Result("nonsense", f"a plugin that failed on import ({behaviour}) did not stop the command", result.case)
    return result


# -- node data -------------------------------------------------------------------------------------------------

NODE_FAULTS = (
    "labels_7",
    "labels_negative",
    "labels_half",
    "labels_nan",
    "labels_2d",
    "features_nan",
    "features_inf",
    "features_1d",
    "lengths",
    "empty",
    "classes_fraction",
    "classes_negative",
    "classes_huge",
    "classes_text",
    "missing_y",
    "pickled",
    "forged_header",
    "truncated",
    "not_zip",
    "fifo",
    "folder",
    "non_ascii_name",
    "unrelated_file",
    "int_features",
    "none",
)
#: faults after which the node's data are still sound (reading them is correct)
NODE_SOUND = ("unrelated_file", "non_ascii_name", "int_features", "none")

_node_template: dict[str, Any] = {}


def _node_folder(root: Path) -> tuple[Path, Any]:
    """One node's folder of the tiny config's clients (written once per process) and the run's spec."""
    if "folder" not in _node_template:
        from fedshuffle.experiments.schema import load_experiment
        from fedshuffle.integrations.flower.nodedata import write_node_folders

        experiment = load_experiment(_config(root / "node-config"))
        ((folder, _),) = write_node_folders(experiment, 1, root / "nodes")
        _node_template.update(folder=folder, spec=experiment.runs({})[0][1])
    return _node_template["folder"], _node_template["spec"]


def _npz(**arrays: Any) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _node_fault(fault: str, path: Path, rng: random.Random) -> None:
    """Replace the client file ``path`` as ``fault`` says."""
    with np.load(path) as saved:
        x, y = saved["x"], saved["y"]
        arrays = {k: saved[k] for k in saved.files}
    labels = {"labels_7": 7, "labels_negative": -1, "labels_half": 0.5, "labels_nan": np.nan}
    if fault in labels:
        y = y.astype(np.float64)
        y[rng.randrange(len(y))] = labels[fault]
        arrays["y"] = y
    elif fault == "labels_2d":
        arrays["y"] = np.stack([y, y], axis=1)
    elif fault in ("features_nan", "features_inf"):
        x = x.astype(np.float64)
        x.flat[rng.randrange(x.size)] = np.nan if fault == "features_nan" else -np.inf
        arrays["x"] = x
    elif fault == "features_1d":
        arrays["x"] = x.reshape(-1)
    elif fault == "lengths":
        arrays["y"] = y[:-1]
    elif fault == "empty":
        arrays["x"], arrays["y"] = x[:0], y[:0]
    elif fault.startswith("classes_"):
        arrays["classes"] = {
            "fraction": np.float64(2.7),
            "negative": np.int64(-1),
            "huge": np.int64(2**31 - 1),
            "text": np.array("two"),
        }[fault[len("classes_") :]]
    elif fault == "missing_y":
        del arrays["y"]
    elif fault == "int_features":
        arrays["x"] = np.round(x * 10).astype(np.int64)
    if fault in ("pickled", "forged_header", "truncated", "not_zip", "fifo", "folder"):
        path.unlink()
    if fault == "pickled":
        buffer = io.BytesIO()
        np.savez(buffer, x=np.array([object()] * len(y), dtype=object), y=y)
        path.write_bytes(buffer.getvalue())
    elif fault == "forged_header":
        with zipfile.ZipFile(path, "w") as archive:
            with archive.open("x.npy", "w") as fh:
                _forged_npy(fh, (4_000_000_000, 3))
            buffer = io.BytesIO()
            np.save(buffer, y)
            archive.writestr("y.npy", buffer.getvalue())
    elif fault == "truncated":
        path.write_bytes(_npz(x=x, y=y)[: rng.randrange(1, 200)])
    elif fault == "not_zip":
        path.write_bytes(rng.randbytes(rng.choice([0, 1, 300])))
    elif fault == "fifo":
        os.mkfifo(path)
    elif fault == "folder":
        path.mkdir()
    elif fault == "non_ascii_name":
        shutil.copy(path, path.with_name("client-\u0663.npz"))
    elif fault == "unrelated_file":
        (path.parent / "README.txt").write_text("notes")
    elif fault not in ("none", "pickled"):
        path.write_bytes(_npz(**arrays))


def run_nodedata_case(seed: int, work: Path) -> Result:
    from fedshuffle.core.errors import ConfigError
    from fedshuffle.integrations.flower.nodedata import OwnClients

    rng = random.Random(f"nodedata:{seed}")
    template, spec = _node_folder(work.parent / f"node-template-{os.getpid()}")
    folder = work / "node"
    shutil.copytree(template, folder)
    files = sorted(folder.glob("client-*.npz"))
    fault = rng.choice(NODE_FAULTS)
    victim = rng.choice(files)
    _node_fault(fault, victim, rng)
    case = f"{fault} in {victim.name}"
    try:
        with wall_limit(CASE_SECONDS), time_limit(CASE_SECONDS):
            clients = OwnClients.read(folder, None, spec)
    except Hang as exc:
        return Result("hang", str(exc), case)
    except ConfigError as exc:
        if fault in NODE_SOUND:
            return Result("nonsense", f"sound node data refused: {exc}", case)
        if fault != "missing_file" and victim.name not in str(exc) and str(folder) not in str(exc):
            return Result("nonsense", f"the error does not name the file: {exc}", case)
        return Result("clean_error", str(exc)[:200], case)
    except Exception as exc:  # noqa: BLE001
        return Result("traceback", _tail(exc), case)
    if fault not in NODE_SOUND:
        return Result("nonsense", "unsound node data read without an error", case)
    import torch

    if not torch.isfinite(clients.features).all():
        return Result("nonsense", "non-finite features read", case)
    if set(clients.labels.unique().tolist()) - {0.0, 1.0, -1.0}:
        return Result("nonsense", f"labels {clients.labels.unique().tolist()} on a binary problem", case)
    return Result("ran", "", case)


# -- decoded checkpoints ---------------------------------------------------------------------------------------

CHECKPOINT_CHANGES = (
    "extra_key",
    "missing_key",
    "string_counter",
    "float_counter",
    "dtype16",
    "dtype64",
    "int_tensor",
    "shape",
    "rows_empty",
    "rows_ints",
    "row_missing",
    "row_extra_round",
    "none",
)


def _leaves(tree: Any, at: tuple = ()) -> list[tuple[tuple, Any]]:
    import torch

    if isinstance(tree, dict):
        return [leaf for key in tree for leaf in _leaves(tree[key], (*at, key))]
    if isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        return [leaf for k, item in enumerate(tree) for leaf in _leaves(item, (*at, k))]
    return [(at, tree)]


def _set(tree: Any, at: tuple, value: Any) -> None:
    for key in at[:-1]:
        tree = tree[key]
    if isinstance(tree, tuple):
        raise TypeError("tuple")
    tree[at[-1]] = value


def _change_checkpoint(state: dict, change: str, rng: random.Random) -> bool:
    """Change the decoded ``state`` in place as ``change`` says; False where it has nothing to change."""
    import torch

    leaves = [(at, v) for at, v in _leaves(state["simulation"]) if at]
    arrays = [(("simulation", *at), v) for at, v in leaves if isinstance(v, (torch.Tensor, np.ndarray))]
    floats = [(a, v) for a, v in arrays if v.dtype in (torch.float64, torch.float32, np.float64, np.float32)]
    integers = [(("simulation", *at), v) for at, v in leaves if type(v) is int]
    rows = state.get("rows")
    if change == "extra_key":
        state["simulation"]["bogus"] = 1
    elif change == "missing_key":
        key = rng.choice(sorted(state["simulation"]))
        del state["simulation"][key]
    elif change in ("string_counter", "float_counter") and integers:
        at, v = rng.choice(integers)
        _set(state, at, str(v) if change == "string_counter" else float(v) + 0.5)
    elif change in ("dtype16", "dtype64", "int_tensor") and floats:
        at, v = rng.choice(floats)
        dtype = {"dtype16": torch.float16, "dtype64": torch.int64, "int_tensor": torch.int32}[change]
        tensor = torch.as_tensor(v)
        _set(state, at, (tensor.round() if dtype != torch.float16 else tensor).to(dtype))
    elif change == "shape" and floats:
        at, v = rng.choice(floats)
        tensor = torch.as_tensor(v).reshape(-1)
        _set(state, at, torch.cat([tensor, tensor[:1]]))
    elif change == "rows_empty" and rows:
        state["rows"] = []
    elif change == "rows_ints":
        state["rows"] = [1, 2, 3]
    elif change == "row_missing" and rows:
        row = rng.choice(rows)
        del row[rng.choice(sorted(row))]
    elif change == "row_extra_round" and rows:
        rows.append({**rows[-1], "round": rows[-1]["round"] + 7})
    elif change != "none":
        return False
    return True


_checkpoint_template: dict[str, Any] = {}


def _checkpoint_template_folder(root: Path) -> tuple[Path, Path]:
    """A finished two-variant, one-seed run (checkpoint every round) and its config, once per process."""
    if "folder" not in _checkpoint_template:
        config = _config(root, rounds=4)
        folder = root / "template"
        result, output = invoke(["run", str(config), "--out", str(folder), "--quiet", "--workers", "1"], root, 600)
        if result.outcome != "ran":
            raise RuntimeError(f"could not build the checkpoint template: {result.detail} {output[-300:]}")
        _checkpoint_template.update(folder=folder, config=config)
    return _checkpoint_template["folder"], _checkpoint_template["config"]


def run_checkpoint_case(seed: int, work: Path) -> Result:
    from fedshuffle.core.checkpoint import read_checkpoint, save_checkpoint

    rng = random.Random(f"checkpoints:{seed}")
    template, config = _checkpoint_template_folder(work.parent / f"checkpoint-template-{os.getpid()}")
    folder = work / "results"
    shutil.copytree(template, folder)
    path = rng.choice(sorted(folder.rglob("checkpoint.pt")))
    run, state = read_checkpoint(path)
    change = rng.choice(CHECKPOINT_CHANGES)
    if not _change_checkpoint(state, change, rng):
        change = "none"
    save_checkpoint(path, state, run)
    (path.parent / "summary.json").unlink(missing_ok=True)  # as if stopped after the checkpoint
    case = f"{change} in {path.relative_to(folder)}"
    result, output = invoke(["run", str(config), "--resume", str(folder), "--quiet", "--workers", "1"], work)
    result.case = case
    if result.outcome == "ran":
        problem = _differs(_finals(folder), _finals(template))
        if problem:
            return Result("nonsense", f"resumed from a changed checkpoint: {problem}", case)
        rows = (path.parent / "metrics.csv").read_text().count("\n")
        if rows != (template / path.parent.relative_to(folder) / "metrics.csv").read_text().count("\n"):
            return Result("nonsense", "metrics.csv lost or gained rows on resume", case)
    if result.outcome == "clean_error" and "checkpoint" not in output:
        return Result("nonsense", f"refused without naming the checkpoint: {result.detail}", case)
    return result


# -- privacy at the accountant's edges -------------------------------------------------------------------------

SIGMAS = [0.0, 1e-320, 1e-300, 1.5e-154, 1e-100, 1e-5, 0.5, 1.0, 1000.0, 1001.0, 1e300, -1.0, "nan", "inf"]
DELTAS = [1e-300, 1e-12, 1e-5, 0.0249, 0.025, 0.2, 0.5, 0.999999999999, 1.0, 0.0, -1e-5]
CLIPS = [1e-300, 1e-8, 0.1, 1.0, 1e300, "inf", 0.0, -1.0]


def run_privacy_case(seed: int, work: Path) -> Result:
    rng = random.Random(f"privacy:{seed}")
    mode = rng.choice(["local", "central", "central", "none"])
    settings = {"mode": mode, "noise_multiplier": rng.choice(SIGMAS), "delta": rng.choice(DELTAS)}
    if rng.random() < 0.8:
        settings["clip"] = rng.choice(CLIPS)
    if mode == "central" and rng.random() < 0.3:
        settings["clipping"] = "adaptive"
    text = "[privacy]\n" + "".join(
        f"{k} = {v if isinstance(v, str) and v in ('nan', 'inf') else json.dumps(v)}\n" for k, v in settings.items()
    )
    config = _config(work, rounds=3, extra=text)
    result, output = invoke(["run", str(config), "--out", str(work / "out"), "--quiet", "--workers", "1"], work)
    result.case = ", ".join(f"{k}={v}" for k, v in settings.items())
    if result.outcome != "ran" or mode == "none":  # without privacy ε is not a number (no guarantee is claimed)
        return result
    summaries = sorted((work / "out").rglob("summary.json"))
    if len(summaries) < 3:  # the experiment's and one per variant's seed
        return Result("nonsense", "exit 0 without every run's summary", result.case)
    for metrics in (work / "out").rglob("metrics.csv"):
        lines = metrics.read_text().splitlines()
        header = lines[0].split(",")
        if "epsilon" in header:
            column = header.index("epsilon")
            for line in lines[1:]:
                value = float(line.split(",")[column] or "nan")
                if not value >= 0 and value != float("inf"):
                    return Result("nonsense", f"ε = {value} in {metrics.parent.name}", result.case)
    return result


# -- signals during start-up and runs, and a long TMPDIR -------------------------------------------------------

_references: dict[str, dict[str, np.ndarray]] = {}


def _command(config: Path, out: Path, workers: int, resume: bool = False) -> list[str]:
    """``fedshuffle run`` of seeds 0..2 into ``out`` (or resuming it), in a fresh interpreter."""
    where = ["--resume" if resume else "--out", str(out)]
    return [sys.executable, "-m", "fedshuffle", "run", str(config), *where, "--seeds", "0..2", "--quiet",
            "--workers", str(workers)]  # fmt: skip


def _reference(root: Path, rounds: int) -> dict[str, np.ndarray]:
    """The uninterrupted run's final parameters (seeds 0..2, no workers), once per process and length."""
    key = str(rounds)
    if key not in _references:
        folder = root / f"reference-{rounds}-{os.getpid()}"
        shutil.rmtree(folder, ignore_errors=True)
        config = _config(folder, rounds=rounds)
        subprocess.run(_command(config, folder / "out", 1), check=True, capture_output=True, timeout=600)
        _references[key] = _finals(folder / "out")
    return _references[key]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _outlived(proc: subprocess.Popen) -> bool:
    """Whether a process of ``proc``'s group (its own session) is still alive 10 s after ``proc`` ended."""
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _group_alive(proc.pid)


def _spawn(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None, seconds: float = 300
) -> tuple[int, str, bool]:
    """Run ``argv`` in its own process group: exit status, output, and whether any process of the group
    outlived it by 10 s (all are killed in the end)."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=seconds)
        return proc.returncode, output.decode(errors="replace"), _outlived(proc)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


#: characters of a command's output kept with a bad case (scripts/fuzz.py writes them into its JSON)
OUTPUT_KEPT = 6000


def _ended(code: int, output: str, left: bool, allowed: tuple[int, ...], case: str) -> Result | None:
    """The outcome of a finished command that did not end as allowed; None when it did."""
    if "Traceback (most recent call last)" in output:
        return Result("traceback", output.strip().splitlines()[-1][:200], case, output[-OUTPUT_KEPT:])
    if code not in allowed:
        return Result("traceback", f"exit {code}: {output.strip()[-200:]}", case, output[-OUTPUT_KEPT:])
    if left:
        return Result("nonsense", "a process of the command's group outlived it", case)
    return None


#: a traceback's frame in one of the package's files
_PACKAGE_FRAME = re.compile(r'File "[^"]*/fedshuffle/')


def _interpreter_start(code: int, output: str) -> bool:
    """Whether a command ended by Ctrl-C before the interpreter ran any of fedshuffle's code: CPython installs
    its KeyboardInterrupt handler before it imports ``site`` and finds the package, and ends with its own
    message there: ``Fatal Python error: init_import_site`` and exit 1, or a KeyboardInterrupt traceback and exit
    -2. Its output starts with that message, and no frame of it is in the package's files."""
    first = output.lstrip().splitlines()[:1]
    own = (code == 1 and first == ["Fatal Python error: init_import_site: Failed to import the site module"]) or (
        code == -signal.SIGINT and first == ["Traceback (most recent call last):"]
    )
    return own and _PACKAGE_FRAME.search(output) is None and output.rstrip().endswith("KeyboardInterrupt")


def run_signal_case(seed: int, work: Path) -> Result:
    rng = random.Random(f"signals:{seed}")
    rounds = rng.choice([4, 40])
    reference = _reference(work.parent, rounds)
    config = _config(work, rounds=rounds)
    workers = rng.choice([1, 2])
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    delay = rng.choice([0.05, 0.3, 1.0, 2.0, 3.0, 5.0, 8.0])
    twice = rng.random() < 0.2
    name = signal.Signals(signum).name
    case = f"{name} after {delay} s{' (twice)' if twice else ''}, workers {workers}, {rounds} rounds"
    proc = subprocess.Popen(
        _command(config, work / "out", workers),
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=signals_by_default,
    )
    try:
        time.sleep(delay)
        proc.send_signal(signum)
        if twice:
            time.sleep(0.2)
            if proc.poll() is None:
                proc.send_signal(signum)
        output, _ = proc.communicate(timeout=120)
        left = _outlived(proc)
    except subprocess.TimeoutExpired:
        return Result("hang", f"still running 120 s after {signal.Signals(signum).name}", case)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = output.decode(errors="replace")
    if proc.returncode == -signum and not text and not (work / "out").exists() and not left:
        # killed by the signal while the interpreter started, before any of fedshuffle's code ran (a shell
        # reports it as 128 + the signal's number, as fedshuffle's own handler exits)
        return Result("clean_error", "ended by the signal during the interpreter's start", case)
    started = signum == signal.SIGINT and _interpreter_start(proc.returncode, text)
    if started and not (work / "out").exists() and not left:
        return Result("clean_error", "Ctrl-C during the interpreter's start: Python's own message", case)
    bad = _ended(proc.returncode, text, left, (0, 128 + signum), case)
    if bad:
        return bad
    if proc.returncode == 0:
        problem = _differs(_finals(work / "out"), reference)
        return Result("nonsense", problem, case) if problem else Result("ran", "finished before the signal", case)
    if not (work / "out").exists():
        return Result("clean_error", f"exit {proc.returncode} before the results folder", case)
    code, resumed, left = _spawn(_command(config, work / "out", workers, resume=True), work)
    bad = _ended(code, resumed, left, (0,), case + ", then resumed")
    if bad:
        return bad
    problem = _differs(_finals(work / "out"), reference)
    if problem:
        return Result("nonsense", f"resumed: {problem}", case)
    return Result("clean_error", f"exit {proc.returncode}, resumed to the same numbers", case)


def run_tmpdir_case(seed: int, work: Path) -> Result:
    rng = random.Random(f"tmpdir:{seed}")
    reference = _reference(work.parent, 4)
    length = rng.choice([90, 100, 104, 108, 120, 160, 250])
    letter = rng.choice(["t", "t", "é", " "])
    tmp = work / "tmp"
    while len(str(tmp)) < length:
        tmp = tmp / (letter * min(40, length - len(str(tmp))) + "x")
    exists = rng.random() < 0.8
    if exists:
        tmp.mkdir(parents=True)
    config = _config(work, rounds=4)
    case = f"TMPDIR of {len(str(tmp))} characters ({letter!r}, {'exists' if exists else 'missing'})"
    code, output, left = _spawn(_command(config, work / "out", 2), work, {**os.environ, "TMPDIR": str(tmp)})
    bad = _ended(code, output, left, (0,), case)
    if bad:
        return bad
    problem = _differs(_finals(work / "out"), reference)
    return Result("nonsense", problem, case) if problem else Result("ran", "", case)


def run_trust_case(kind: str, seed: int, work: Path) -> Result:
    """One case of the kinds of ``fuzzing.TRUST_KINDS``."""
    runner = {
        "plugins": run_plugin_case,
        "nodedata": run_nodedata_case,
        "checkpoints": run_checkpoint_case,
        "privacy": run_privacy_case,
        "signals": run_signal_case,
        "tmpdir": run_tmpdir_case,
    }[kind]
    return runner(seed, work)
