"""Loading an experiment from a TOML file or a preset (:data:`PRESETS_DIR`): the file read within its size limit,
validated, its claims and tuning checked, its name defaulted from the file's, and its data paths taken relative to
the file."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

from fedshuffle import plugins
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.inputs import read_regular_file, usable_path_name
from fedshuffle.core.validation import validate
from fedshuffle.experiments.claims import parse_claims
from fedshuffle.experiments.schema.experiment import Experiment
from fedshuffle.experiments.schema.names import name_problem, slug

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS_DIR = Path(__file__).parents[2] / "presets"
#: bytes of a config file (the largest preset is 9 KB)
MAX_CONFIG_BYTES = 1 << 20


def _fits_file_system(v: str) -> bool:
    """Whether :func:`~fedshuffle.core.inputs.usable_path_name` takes ``v`` (a path it refuses is never looked up:
    the lookup would raise)."""
    try:
        return usable_path_name(v) is not None
    except ValueError:
        return False


def load_experiment(path_or_preset: str | Path) -> Experiment:
    """An experiment from a TOML file path or a preset name."""
    path = _config_path(path_or_preset)
    raw = _read_toml(path)
    with plugins.config_folder(path.parent):
        experiment = validate(Experiment, raw)
    parse_claims(experiment.claims, [v.label for v in experiment.variants])
    experiment.check_tuning()
    if not experiment.experiment.name or experiment.experiment.name == "experiment":
        experiment.experiment.name = path.stem if name_problem(path.stem) is None else slug(path.stem)
    for data in (experiment.data, *(v.data for v in experiment.variants)):
        _rebase_data_paths(data, path.parent)
    return experiment


def _config_path(path_or_preset: str | Path) -> Path:
    """The file ``path_or_preset`` names: a path (a ``.toml`` one even where it is missing: reading it says so), else
    a preset's file; neither, or a folder, is an error listing the presets."""
    path = Path(path_or_preset)
    try:
        found = path.exists() or path.suffix == ".toml"
        if not found:
            path = PRESETS_DIR / f"{path_or_preset}.toml"
            found = path.exists()
    except OSError as exc:  # a name longer than the file system allows
        raise ConfigError(
            "config", f"cannot use {str(path_or_preset)[:60]!r}... as a file name ({exc.strerror or exc})"
        ) from None
    if not found:
        names = preset_names()
        hint = difflib.get_close_matches(str(path_or_preset), names, n=1)
        raise ConfigError(
            "preset",
            f"no preset or file {str(path_or_preset)!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; presets: "
            f"{', '.join(names)}",
        )
    if path.is_dir():
        raise ConfigError(
            "config", f"{path} is a folder; give a TOML file or a preset name (presets: {', '.join(preset_names())})"
        )
    return path


def _read_toml(path: Path) -> dict[str, Any]:
    """The TOML table of the config file ``path`` (at most :data:`MAX_CONFIG_BYTES`); what cannot be read is an
    error naming the file."""
    try:
        return tomllib.loads(read_regular_file(path, "config", MAX_CONFIG_BYTES, "TOML config file").decode("utf-8"))
    except ConfigError:
        raise
    except (
        tomllib.TOMLDecodeError,
        UnicodeDecodeError,
        ValueError,
    ) as exc:  # ValueError: a number of more than 4,300 digits
        raise ConfigError("config", f"{path} is not valid TOML ({' '.join(str(exc).split())[:200]})") from None
    except RecursionError:
        raise ConfigError("config", f"{path} nests arrays or tables too deeply") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path} ({exc.strerror or exc})") from None


def _rebase_data_paths(data: dict[str, Any], folder: Path) -> None:
    """``data.path`` and ``data.data_dirs`` of one (base or variant) ``[data]`` section, taken relative to the config
    file's ``folder`` first, whatever the working directory: a relative ``path`` that exists there, every relative
    folder of ``data_dirs``."""
    data_path = data.get("path")
    if (
        isinstance(data_path, str)
        and _fits_file_system(data_path)
        and not Path(data_path).expanduser().is_absolute()
        and (folder / data_path).exists()
    ):
        data["path"] = str(folder / data_path)
    dirs = data.get("data_dirs")
    if isinstance(dirs, list):
        data["data_dirs"] = [
            str((folder / d).resolve()) if isinstance(d, str) and not Path(d).expanduser().is_absolute() else d
            for d in dirs
        ]


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))
