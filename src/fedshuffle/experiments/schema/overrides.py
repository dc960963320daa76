"""Overrides of an experiment's sections: ``--set section.setting=value`` parsed, sections merged (a part replaced
by another drops the settings only it took), and an invalid merged setting reported against the override that gave
it."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.schema.sections import _CHOOSERS, SECTIONS, RunSpec, _deep_merge
from fedshuffle.server import chosen_optimizer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _blamed_on_override(exc: ConfigError, prefix: str, overrides: Mapping[str, Any], given_as: str) -> ConfigError:
    """``exc`` about a setting that ``overrides`` gives, as an error of that override (``--set local.lr: ...``); a
    ``--set`` value holding commas, such as ``local.lr=0.01,0.02``, is pointed to ``fedshuffle sweep --grid``."""
    section, _, rest = exc.field.removeprefix(prefix).partition(".")
    setting = rest.split(".")[0]
    given = overrides.get(section)
    if not isinstance(given, Mapping) or setting not in given:
        return exc
    message = exc.message
    value = given[setting]
    if given_as == "--set" and isinstance(value, str) and "," in value:
        sweep = f"fedshuffle sweep CONFIG --grid {section}.{setting}={value}"
        message += f"; to run each of several values, sweep them: {sweep}"
    return ConfigError(f"{given_as} {section}.{setting}" + rest.removeprefix(setting), message)


def _merge_parts(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` ← ``update`` by section, where an update that chooses another part drops the base's settings of
    the part it replaces (those the new part does not take); everything else is merged as it is and validated."""
    base = dict(base)
    for section, choosers in _CHOOSERS.items():
        old, new = base.get(section), update.get(section)
        if not isinstance(old, Mapping) or not isinstance(new, Mapping):
            continue
        kept = dict(old)
        for chooser, registry in choosers.items():
            default = RunSpec.model_fields[section].annotation.model_fields[chooser].default
            if section == "server":
                default = chosen_optimizer(old)
            before, after = old.get(chooser, default), new.get(chooser)
            if not isinstance(before, str) or not isinstance(after, str):
                continue  # no part replaced (unchanged, or a list of parts such as run.sinks: merged as a value)
            if before == after or before not in registry or after not in registry:
                continue
            replaced = set(registry[before].setting_names()) - set(registry[after].setting_names())
            for key in replaced - set(new):
                kept.pop(key, None)
        base[section] = kept
    return _deep_merge(base, update)


MAX_VALUE_CHARS = 100_000


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """``["algorithm.lr=0.1", "run.rounds=50"]`` → nested dict; values parsed as TOML where possible."""
    out: dict[str, Any] = {}
    for item in assignments:
        if "=" not in item:
            raise ConfigError("--set", f"expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or parts[0] not in SECTIONS:
            raise ConfigError(
                "--set", f"key must be section.setting with section one of {', '.join(SECTIONS)}; got {key!r}"
            )
        if len(value) > MAX_VALUE_CHARS:
            raise ConfigError(
                "--set", f"{key.strip()}: the value has {len(value)} characters; at most {MAX_VALUE_CHARS}"
            )
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        except (ValueError, RecursionError) as exc:  # a number of more than 4,300 digits, lists nested hundreds deep
            why = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc).split(":")[0]
            raise ConfigError("--set", f"{key.strip()}: cannot read the value ({why})") from None
        out.setdefault(parts[0], {})[parts[1]] = parsed
    return out
