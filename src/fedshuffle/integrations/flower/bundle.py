"""``fedshuffle flower-app CONFIG DIR``: a fedshuffle experiment as a ready Flower App folder (no Flower needed to write it).

The folder holds ``pyproject.toml`` (the app's components and run configuration), ``experiment.json``
(the validated experiment, paths made absolute) and ``fedshuffle_app.py`` (the ServerApp and ClientApp
built from it). ``flwr run DIR <connection>`` runs it on a SuperLink whose nodes have fedshuffle installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import write_atomic
from fedshuffle.experiments.schema import Experiment, slug
from fedshuffle.integrations.flower.common import EXPERIMENT_FILE, AppSettings, federated_runs, read_experiment

MODULE = "fedshuffle_app"

APP_MODULE = f'''"""A fedshuffle experiment as a Flower App (written by ``fedshuffle flower-app``; the experiment is {EXPERIMENT_FILE})."""

from pathlib import Path

from fedshuffle.integrations.flower.app import client_app, server_app

EXPERIMENT = Path(__file__).with_name("{EXPERIMENT_FILE}")

server = server_app(EXPERIMENT)
client = client_app(EXPERIMENT)
'''


def _toml_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def pyproject(name: str, description: str, settings: AppSettings) -> str:
    """The app's pyproject.toml: components, and the run configuration :class:`AppSettings` reads."""
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
dependencies = ["fedshuffle[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedshuffle"

[tool.flwr.app.components]
serverapp = "{MODULE}:server"
clientapp = "{MODULE}:client"

[tool.flwr.app.config]
variant = {_toml_string(settings.variant)}          # one variant's label; "" runs every variant in turn
seed = {settings.seed}                 # -1: the experiment's first seed
set = {_toml_string(settings.overrides)}              # overrides as in `fedshuffle run --set`, separated by ";"
out = {_toml_string(settings.out)}              # results folder on the server's machine ("" = none)
round-timeout = {settings.round_timeout!r}   # seconds a round waits; members later than that are dropped (unfinished work)
connect-timeout = {settings.connect_timeout!r} # seconds to wait for nodes hosting every client
resume = {str(settings.resume).lower()}          # continue each run from its checkpoint in `out`
invalid-reply = {_toml_string(settings.invalid_reply)}   # a reply that fails the server's checks: "drop" its member for the round, or "stop" the run
node-data = {str(settings.node_data).lower()}       # the nodes bring their own data (node config data-path); the server builds none
evaluation = {_toml_string(settings.evaluation)}    # who scores the model: "central" (the server), "federated" (each node its clients), "auto"
"""


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


def write_app(config: str | Path, directory: str | Path, settings: AppSettings | None = None) -> Path:
    """Write the Flower App of experiment ``config`` (a TOML file or preset) into ``directory``; returns it.

    ``settings`` become the app's default run configuration. Every selected run is validated first.
    A ``directory`` that holds anything is refused: the app never replaces files it did not write.
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
        raise ConfigError("DIR", f"{directory} is not empty: the app's files would replace what is there; give a new or empty folder")
    name = experiment.experiment.name
    description = experiment.experiment.title or f"fedshuffle experiment {name} ({len(runs)} run(s))"
    write_atomic(directory / "pyproject.toml", pyproject(f"fedshuffle-{slug(name)}".replace("_", "-"), description, settings))
    write_atomic(directory / EXPERIMENT_FILE, json.dumps(raw, indent=2, sort_keys=True) + "\n")
    write_atomic(directory / f"{MODULE}.py", APP_MODULE)
    return directory
