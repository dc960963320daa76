"""User parts from the user's own modules: ``[experiment] plugins`` and the ``fedshuffle.plugins`` entry points.

A plugin is any importable module that registers parts when imported (``METHODS.add(...)``,
``SOURCES.add(...)``, ...). Importing it runs its code, so a config alone never imports one: an
experiment names its plugins::

    [experiment]
    plugins = ["mypkg.methods"]

and the person running it consents to each, on the command line (``--plugins mypkg.methods``, or
``--plugins mypkg`` for every module of the package), in the environment
(``FEDSHUFFLE_PLUGINS=mypkg.methods``, a comma list) or in Python (:func:`allow`). A package may
declare its modules once, in its ``pyproject.toml``; installing it is the consent::

    [project.entry-points."fedshuffle.plugins"]
    mypkg = "mypkg.methods"

A consented module that is not installed is imported from the config's folder or the working folder.
Every import is announced in one line on stderr. Worker processes (``--workers``) import the same
modules before their first run. A part defined in the script being run (``__main__``) cannot reach a
worker process, which does not run the script: :func:`check_reachable` says so in one line.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path

from fedshuffle.core.errors import ConfigError

ENTRY_POINT_GROUP = "fedshuffle.plugins"
#: the environment variable that consents to plugin modules (a comma list)
ENVIRONMENT = "FEDSHUFFLE_PLUGINS"
#: a dotted module name
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", re.ASCII)
#: module (or package) → who consented to it
_consents: dict[str, str] = {}
#: module → the folder it was imported from ("" where it was found on sys.path)
_imported: dict[str, str] = {}
_entry_points_loaded = False
#: the folder of the config being read: a consented module that is not installed may come from it
_config_folder: ContextVar[Path | None] = ContextVar("config_folder", default=None)


def split(values: Iterable[str] | str) -> list[str]:
    """Module names from ``"a,b"`` or ``["a", "b,c"]`` (empty parts dropped)."""
    items = [values] if isinstance(values, str) else list(values)
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def _check_names(names: Sequence[object], field: str) -> list[str]:
    for name in names:
        if not isinstance(name, str) or not _MODULE.match(name):
            raise ConfigError(field, f"{name!r} is not a module name (a dotted name such as 'mypkg.methods')")
    return [str(name) for name in names]


def allow(modules: Iterable[str] | str, by: str = "fedshuffle.plugins.allow") -> None:
    """Consent to importing ``modules`` (names, or comma lists of names) when a config names them in
    ``[experiment] plugins``; a package's name consents to its modules too. ``by`` is said when one is imported."""
    for name in _check_names(split(modules), by):
        _consents.setdefault(name, by)


def withdraw(by: str) -> None:
    """Forget the consents given by ``by`` (a command's ``--plugins`` holds for that command only)."""
    for name in [name for name, who in _consents.items() if who == by]:
        del _consents[name]


def consented_by(by: str) -> list[str]:
    """The modules consented to by ``by`` (e.g. ``"--plugins"``), in the order given."""
    return [name for name, who in _consents.items() if who == by]


def _consent(name: str) -> str | None:
    """Who consented to importing ``name`` (None: nobody)."""
    from_environment = _check_names(split(os.environ.get(ENVIRONMENT, "")), ENVIRONMENT)
    for given, by in [*_consents.items(), *((n, ENVIRONMENT) for n in from_environment)]:
        if name == given or name.startswith(given + "."):
            return by
    return None


@contextlib.contextmanager
def config_folder(folder: Path) -> Iterator[None]:
    """While a config file in ``folder`` is read, a consented module that is not installed may come from ``folder``."""
    token = _config_folder.set(folder.resolve())
    try:
        yield
    finally:
        _config_folder.reset(token)


def _folder_of(name: str) -> str:
    """Where ``name`` is imported from: "" for sys.path (an installed or already imported module), else the config's
    folder or the working folder that holds it."""
    top = name.split(".")[0]
    if top in sys.modules or importlib.util.find_spec(top) is not None:
        return ""
    for folder in (_config_folder.get(), Path.cwd()):
        if folder is not None and importlib.machinery.PathFinder.find_spec(top, [str(folder)]) is not None:
            return str(folder)
    return ""


def _import(name: str, folder: str, field: str) -> None:
    """Import ``name`` (from ``folder`` where not ""); anything that stops the import is one :class:`ConfigError`."""
    if folder:
        sys.path.insert(0, folder)
    try:
        importlib.import_module(name)
    except KeyboardInterrupt:
        raise
    except ConfigError:
        raise
    except BaseException as exc:  # noqa: BLE001 — SystemExit too: a plugin never ends the command, the user reads why
        why = " ".join(str(exc).split())[:200]
        because = f"{type(exc).__name__}: {why}" if why else type(exc).__name__
        raise ConfigError(field, f"importing plugin {name!r} failed ({because})") from None
    finally:
        if folder and folder in sys.path:
            sys.path.remove(folder)
    _imported[name] = folder


def _announce(name: str, by: str, folder: str) -> None:
    where = f" from {folder}" if folder else ""
    print(f"plugin: importing {name} (consented by {by}){where}", file=sys.stderr, flush=True)


def load(modules: Iterable[object], field: str = "experiment.plugins") -> None:
    """Import each of ``modules`` a config names (once per process), each consented to; a module nobody
    consented to is refused, naming how to consent, before anything is imported."""
    names = [name for name in _check_names(list(modules), field) if name not in _imported]
    refused = [name for name in names if _consent(name) is None]
    if refused:
        listed = ",".join(refused)
        raise ConfigError(
            field,
            f"names plugin {', '.join(map(repr, refused))}: a plugin is code, and a config "
            f"alone imports none; allow it with --plugins {listed} or {ENVIRONMENT}={listed} "
            f"(in Python: fedshuffle.plugins.allow({listed!r}))",
        )
    for name in names:
        if name in _imported:
            continue
        folder = _folder_of(name)
        _announce(name, _consent(name) or "", folder)
        _import(name, folder, field)


def load_entry_points() -> None:
    """Import every module the installed packages declare under the ``fedshuffle.plugins`` entry points (once):
    installing the package consented to them."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    field = f"entry point {ENTRY_POINT_GROUP}"
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        name = _check_names([point.value.split(":")[0].strip()], field)[0]
        if name in _imported:
            continue
        package = point.dist.name if point.dist is not None else point.name
        _consents.setdefault(name, f"the entry point of installed package {package}")
        _announce(name, _consents[name], "")
        _import(name, "", field)


def imported() -> tuple[tuple[str, str], ...]:
    """The plugin modules this process imported with a consent that still holds (an earlier command's ``--plugins``
    does not), and the folder each came from ("" for sys.path), for worker processes to import the same
    (:func:`load_imported`)."""
    return tuple((name, folder) for name, folder in _imported.items() if _consent(name) is not None)


def load_imported(modules: Sequence[tuple[str, str]]) -> None:
    """In a worker process: import the modules the parent process imported (:func:`imported`), consented there."""
    for name, folder in modules:
        if name not in _imported:
            _consents.setdefault(name, "the parent process")
            _import(name, folder, "experiment.plugins")


def check_reachable(parts: Sequence[tuple[str, str, object]]) -> None:
    """Refuse parts a worker process cannot build: ``(section.setting, name, factory)`` whose factory is
    defined in the script being run (``__main__``), which worker processes do not run."""
    for field, name, factory in parts:
        if getattr(factory, "__module__", None) == "__main__":
            raise ConfigError(
                field,
                f"{name!r} is defined in the script being run, which worker processes do not run; "
                "put it in a module and name it in [experiment] plugins, or run with workers = 1",
            )
