"""``fedshuffle flower-app CONFIG DIR``: a fedshuffle experiment as a ready Flower App folder (no Flower needed to write
it).

The folder holds ``pyproject.toml`` (the app's components and run configuration), ``experiment.json``
(the validated experiment, paths made absolute) and ``fedshuffle_app.py`` (the ServerApp and ClientApp
built from it). ``flwr run DIR <connection>`` runs it on a SuperLink whose nodes have fedshuffle installed.

The app pins the fedshuffle it was made with: its dependency is ``fedshuffle[flower]==<version>``, and its
module refuses, with one line, to load where another version is installed (:func:`require_version`).
With a bundled wheel (``--bundle-wheel``) the app holds ``wheels/fedshuffle-<version>-py3-none-any.whl`` and its
dependency points at that file, so that Flower's runtime installation (``uv sync`` into a fresh environment per
run, which a SuperLink does by default) installs it without an index; fedshuffle's own dependencies (PyTorch,
NumPy, …), like ``flwr`` itself, then come from the environment the Flower runtime runs in. Flower's app
bundle carries only ``.py``/``.toml``/``.md``/``.yaml``/``.json`` files, so the wheel stays on the machine
the app was written on (a SuperNode elsewhere gets fedshuffle by ``pip install`` of the same wheel).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import write_atomic
from fedshuffle.experiments.schema import SECTIONS, Experiment, slug
from fedshuffle.integrations.flower.common import (
    EXPERIMENT_FILE,
    AppSettings,
    FederatedRun,
    federated_runs,
    pyproject_lines,
    read_experiment,
)

MODULE = "fedshuffle_app"
#: the folder of the app that holds the bundled wheel
WHEELS = "wheels"
#: :func:`installed_version` where no fedshuffle distribution is installed (the package imported from a source tree)
NOT_INSTALLED = "unknown (not installed)"


def app_module(version: str, plugin_modules: Sequence[str] = ()) -> str:
    """The app's module: the version check, the consent to the experiment's plugins (given when the app was written),
    then the ServerApp and the ClientApp of the experiment, with a place for Flower mods (``MODS``)."""
    return f'''"""A fedshuffle experiment as a Flower App (written by ``fedshuffle flower-app`` with fedshuffle
{version}; the experiment is {EXPERIMENT_FILE})."""

from pathlib import Path

from fedshuffle.integrations.flower.app import client_app, server_app
from fedshuffle.integrations.flower.bundle import require_version
from fedshuffle.plugins import allow

# the fedshuffle this app was made with: a machine running another one refuses it
require_version({json.dumps(version)})
allow({json.dumps(list(plugin_modules))}, "the Flower App (consented when it was written)")

EXPERIMENT = Path(__file__).with_name("{EXPERIMENT_FILE}")

# Flower mods around every message this ClientApp answers, in order: your own `mod(message, context, call_next)`,
# or flwr.clientapp.mod's message_size_mod and arrays_size_mod (logging). fixedclipping_mod, adaptiveclipping_mod and
# LocalDpMod expect Flower's own training message (one array record) and answer fedshuffle's with an error:
# differential privacy is the experiment's [privacy] section.
MODS = []

server = server_app(EXPERIMENT)
client = client_app(EXPERIMENT, mods=MODS)
'''


def installed_version() -> str:
    """The version of the fedshuffle distribution this interpreter imports (its installed metadata)."""
    try:
        return metadata.version("fedshuffle")
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def require_version(made_with: str) -> None:
    """Refuse (:class:`ConfigError`, one line) to build an app made with another fedshuffle than the installed one."""
    running = installed_version()
    if running != made_with:
        raise ConfigError(
            "fedshuffle",
            f"this Flower app was made with fedshuffle {made_with}, this machine runs fedshuffle {running}: "
            f"install fedshuffle=={made_with} here (or the wheel in the app's {WHEELS}/ folder), or write the app "
            "again",
        )


def _toml_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _dependency(version: str, wheel: Path | None) -> str:
    """The app's dependency on fedshuffle: the version it was made with, from an index or from the bundled ``wheel``
    (uv's source; its metadata declares no requirement, so that nothing else is fetched: the runtime's environment has
    them)."""
    if wheel is None:
        return f'dependencies = ["fedshuffle[flower]=={version}"]\n'
    return (
        f'dependencies = ["fedshuffle=={version}"]\n\n'
        "# the bundled wheel, installed by Flower's runtime installation (uv sync) without an index; fedshuffle's own\n"
        "# dependencies (torch, numpy, ...) and flwr come from the environment the SuperLink or SuperNode runs in\n"
        f"[tool.uv.sources]\nfedshuffle = {{ path = {_toml_string(str(wheel))} }}\n\n"
        f'[[tool.uv.dependency-metadata]]\nname = "fedshuffle"\nversion = {_toml_string(version)}\nrequires-dist = []\n'
    )


def experiment_keys(runs: Sequence[FederatedRun]) -> list[str]:
    """The experiment's settings as run-config keys ``section.setting`` (those of a scalar value in any selected run):
    Flower refuses a ``--run-config`` key the app does not declare, so the app declares each one, as "" (the
    experiment's own value)."""
    keys: set[str] = set()
    for run in runs:
        for section, settings in run.spec.model_dump(mode="json").items():
            if section in SECTIONS and isinstance(settings, dict):
                keys.update(f"{section}.{k}" for k, v in settings.items() if isinstance(v, (bool, int, float, str)))
    return sorted(keys)


def _run_config(settings: AppSettings, runs: Sequence[FederatedRun]) -> str:
    """The ``[tool.flwr.app.config]`` lines: every key of :class:`AppSettings` with its value and its description,
    then the experiment's settings (:func:`experiment_keys`)."""
    experiment = "".join(f'{key} = ""\n' for key in experiment_keys(runs))
    return (
        pyproject_lines(settings)
        + "\n# the experiment's settings, as `fedshuffle run --set` takes them (\"\" = the experiment's own value)\n"
        + experiment
    )


def pyproject(
    name: str,
    description: str,
    settings: AppSettings,
    version: str | None = None,
    wheel: Path | None = None,
    runs: Sequence[FederatedRun] = (),
) -> str:
    """The app's pyproject.toml: components, the run configuration :class:`AppSettings` reads, and the dependency
    on fedshuffle ``version`` (default: the installed one), from the bundled ``wheel`` where one is given."""
    return f"""# A fedshuffle experiment as a Flower App (written by `fedshuffle flower-app`).
# Run it with `flwr run <this folder> <connection>`; change a setting with `flwr run ... -c 'key=value'`.

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = {_toml_string(name)}
version = "1.0.0"
description = {_toml_string(description)}
license = "MIT"
{_dependency(version or installed_version(), wheel)}
[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedshuffle"

[tool.flwr.app.components]
serverapp = "{MODULE}:server"
clientapp = "{MODULE}:client"

[tool.flwr.app.config]
{_run_config(settings, runs)}"""


def _absolute(sections: Mapping[str, Any], base: Path, data_paths: bool = True) -> dict[str, Any]:
    """Sections with ``problem.targets`` and (``data_paths``) ``data.path`` and ``data.data_dirs`` made absolute (as
    ``fedshuffle run`` reads them from ``base``); with nodes that bring their own data, no machine reads the data
    settings' files, and the app keeps them as the config gives them."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in sections.items()}
    problem = out.get("problem")
    if isinstance(problem, dict) and isinstance(problem.get("targets"), str) and problem["targets"] != "identity":
        problem["targets"] = str((base / problem["targets"]).resolve())
    data = out.get("data")
    if isinstance(data, dict) and data_paths:
        if isinstance(data.get("path"), str):
            data["path"] = str((base / data["path"]).resolve())
        if isinstance(data.get("data_dirs"), list):
            data["data_dirs"] = [str((base / d).resolve()) for d in data["data_dirs"]]
    return out


def build_wheel(into: Path) -> Path:
    """The wheel of the running fedshuffle, built into ``into`` from its source tree (copied first, so the tree gets
    no build files) by pip without an index or build isolation: offline, with the setuptools installed here."""
    import fedshuffle

    package = Path(fedshuffle.__file__).resolve().parent
    root = package.parents[1]
    if not (root / "pyproject.toml").is_file() or package != root / "src" / "fedshuffle":
        raise ConfigError(
            "--bundle-wheel",
            f"fedshuffle runs from {package}, not from a source tree (src/fedshuffle beside a pyproject.toml): "
            "give its wheel with --wheel FILE",
        )
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "source"
        shutil.copytree(root / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (root / name).is_file():
                shutil.copy2(root / name, tree / name)
        built = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "--quiet",
                "--wheel-dir",
                str(Path(tmp) / "dist"),
                str(tree),
            ],
            capture_output=True,
            text=True,
        )
        wheels = sorted((Path(tmp) / "dist").glob("fedshuffle-*.whl"))
        if built.returncode != 0 or len(wheels) != 1:
            why = ((built.stderr or built.stdout).strip().splitlines() or ["no wheel was written"])[-1]
            raise ConfigError("--bundle-wheel", f"pip could not build fedshuffle's wheel from {root} ({why})")
        into.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(wheels[0], into / wheels[0].name))


def _checked_wheel(wheel: Path, version: str, field: str) -> Path:
    """``wheel`` if it is a fedshuffle wheel of ``version`` (by its file name, PEP 427); else a ConfigError on
    ``field``."""
    parts = wheel.name.split("-")
    if not wheel.is_file() or wheel.suffix != ".whl" or len(parts) < 5 or parts[0] != "fedshuffle":
        raise ConfigError(field, f"{wheel} is not a fedshuffle wheel file (fedshuffle-<version>-py3-none-any.whl)")
    if parts[1] != version:
        raise ConfigError(
            field,
            f"{wheel.name} is fedshuffle {parts[1]}, the installed fedshuffle that writes the app is {version}: "
            "bundle that version's wheel",
        )
    return wheel


def write_app(
    config: str | Path,
    directory: str | Path,
    settings: AppSettings | None = None,
    *,
    bundle_wheel: bool = False,
    wheel: str | Path | None = None,
) -> Path:
    """Write the Flower App of experiment ``config`` (a TOML file or preset) into ``directory``; returns it.

    ``settings`` become the app's default run configuration. Every selected run is validated first.
    A ``directory`` that holds anything is refused: the app never replaces files it did not write.
    The app depends on the installed fedshuffle's version; ``bundle_wheel`` (built from the source tree, see
    :func:`build_wheel`) or ``wheel`` (that file, of the same version) puts the wheel into ``directory/wheels`` and
    points the dependency at it, by its absolute path (see the module docstring).
    """
    settings = settings or AppSettings()
    experiment = read_experiment(config)
    runs = federated_runs(experiment, settings)  # every variant validated, the selection checked
    cwd = Path.cwd()
    raw = experiment.model_dump(mode="json")
    raw.update(_absolute({"data": raw["data"], "problem": raw["problem"]}, cwd, not settings.node_data))
    raw["variants"] = [_absolute(v, cwd, not settings.node_data) for v in raw["variants"]]
    Experiment.model_validate(raw)  # what the app will read back
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError("DIR", f"{directory} exists and is not a folder")
    if directory.is_dir() and any(directory.iterdir()):
        raise ConfigError(
            "DIR", f"{directory} is not empty: the app's files would replace what is there; give a new or empty folder"
        )
    version = installed_version()
    if version == NOT_INSTALLED:
        raise ConfigError(
            "fedshuffle",
            "no fedshuffle distribution is installed (is it imported from a source tree on PYTHONPATH?): "
            "install it (pip install -e .) so that the app can pin its version",
        )
    name = experiment.experiment.name
    description = experiment.experiment.title or f"fedshuffle experiment {name} ({len(runs)} run(s))"
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is not None:
            bundled = _checked_wheel(Path(wheel), version, "--wheel")
        elif bundle_wheel:
            bundled = _checked_wheel(build_wheel(Path(tmp)), version, "--bundle-wheel")
        else:
            bundled = None
        target = None
        if bundled is not None:  # before any file of the app is written: a failed build leaves no half-written app
            target = (directory / WHEELS / bundled.name).resolve()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(bundled, target)
        write_atomic(
            directory / "pyproject.toml",
            pyproject(f"fedshuffle-{slug(name)}".replace("_", "-"), description, settings, version, target, runs),
        )
    write_atomic(directory / EXPERIMENT_FILE, json.dumps(raw, indent=2, sort_keys=True) + "\n")
    write_atomic(directory / f"{MODULE}.py", app_module(version, experiment.experiment.plugins))
    return directory
