"""User parts from the user's own modules: ``[experiment] plugins`` and the ``fedshuffle.plugins`` entry points.

A plugin is any importable module that registers parts when imported (``METHODS.add(...)``,
``SOURCES.add(...)``, ...). An experiment names its plugins::

    [experiment]
    plugins = ["mypkg.methods"]

and a package may declare them once for every experiment, in its ``pyproject.toml``::

    [project.entry-points."fedshuffle.plugins"]
    mypkg = "mypkg.methods"

The configuration layer imports both before it validates a config, so a plugin's parts are named and
configured exactly like built-in ones; worker processes (``--workers``) import the same modules before
their first run. A part defined in the script being run (``__main__``) cannot reach a worker process,
which does not run the script: :func:`check_reachable` says so in one line.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Iterable, Sequence

from fedshuffle.core.errors import ConfigError

ENTRY_POINT_GROUP = "fedshuffle.plugins"
#: a dotted module name
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_imported: list[str] = []
_entry_points_loaded = False


def load(modules: Iterable[str], field: str = "experiment.plugins") -> None:
    """Import each of ``modules`` (once per process); an error names the module and why it failed."""
    for name in modules:
        if not isinstance(name, str) or not _MODULE.match(name):
            raise ConfigError(field, f"{name!r} is not a module name (a dotted name such as 'mypkg.methods')")
        if name in _imported:
            continue
        try:
            importlib.import_module(name)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 — whatever stops the import is the user's to see, in one line
            raise ConfigError(field, f"cannot import {name!r} ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
        _imported.append(name)


def load_entry_points() -> None:
    """Import every module the installed packages declare under the ``fedshuffle.plugins`` entry points (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    load([point.value.split(":")[0] for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)], f"entry point {ENTRY_POINT_GROUP}")


def imported() -> tuple[str, ...]:
    """The plugin modules this process imported, for worker processes to import the same."""
    return tuple(_imported)


def check_reachable(parts: Sequence[tuple[str, str, object]]) -> None:
    """Refuse parts a worker process cannot build: ``(section.setting, name, factory)`` whose factory is
    defined in the script being run (``__main__``), which worker processes do not run."""
    for field, name, factory in parts:
        if getattr(factory, "__module__", None) == "__main__":
            raise ConfigError(field, f"{name!r} is defined in the script being run, which worker processes do not run; "
                                     "put it in a module and name it in [experiment] plugins, or run with workers = 1")
