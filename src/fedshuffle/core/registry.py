"""One registry per kind of part (methods, problems, data sources, partitions, samplers, server optimizers, ...).

An entry is a name, a factory, a one-line summary, the paper it comes from and, for a part configured
from a section of the experiment file, its **settings**: the factory's keyword parameters are its
settings, each with a type, a default and (through ``typing.Annotated[..., pydantic.Field(...)]``) its
constraints and a one-line help, declared once next to the code::

    def dirichlet_partition(labels, rng, clients: Clients = None,
                            alpha: Annotated[float, Field(gt=0, description="concentration")] = 0.5): ...

    PARTITIONS.add("dirichlet", dirichlet_partition, "label Dirichlet shares", "Hsu et al., arXiv:1909.06335")

The registry derives a pydantic model from that signature (:attr:`Entry.settings`); the configuration
schema validates a section's settings with the chosen entry's model, so a setting the chosen part does
not take is an error naming the part and what it takes, never dropped. Parameters the framework passes
at build time (the registry's ``runtime`` names: a random stream, the samples, the aggregator) are not
settings. ``fedshuffle presets``/``show``/``parts``, the CLI help and the docs' settings tables read the
same declarations, so a part registered from user code is known everywhere, exactly like a built-in one.

A setting's **role** is a marker in the same metadata, beside its constraints (as optax's ``inject_hyperparams`` and
pfl-research's hyperparameter objects mark what may be changed from outside): ``Annotated[float, Field(gt=0),
StepSize()]`` says that the setting is a step size, wherever it is declared (the local planner, a server optimizer,
a method, a plugin's part). Everything that treats step sizes apart reads the role (:func:`roles`): ``'theory'`` is
accepted for exactly these settings, runs that differ only in them are replicas of one simulation, ``inspect``
shows them.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic.fields import FieldInfo

from fedshuffle.core.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class StepSize:
    """The role of a setting that is a step size (a marker in its ``Annotated`` metadata).

    ``quantity`` names it among the step sizes a theorem gives (:data:`fedshuffle.analysis.theory.THEOREMS`):
    ``'theory'`` as its value takes the theorem's ``quantity``; default: the setting's own name.
    """

    quantity: str | None = None


@dataclass(frozen=True)
class StepScale:
    """The role of a setting that multiplies a step size (``local.lr_multiplier``): runs that differ only in it are
    replicas of one simulation, as for a step size; it is a number, never ``'theory'``."""


@dataclass(frozen=True)
class ModelSize:
    """The role of a setting that sets how large the model is (an MLP's widths, a source's number of classes): a model
    whose copies cannot fit in memory is refused naming it."""


Role = StepSize | StepScale | ModelSize


@dataclass(frozen=True)
class Example:
    """What the check of a part (:mod:`fedshuffle.testing`) runs it on, declared where the part is registered
    (``SOURCES.add(..., example=Example(...))``), so that every registered part is checked as soon as it is added.

    ``settings``: the part's own settings. ``sections``: other sections of the check's run, by section (the
    ``[data]`` section a problem runs on; for a data source, the rest of its ``[data]`` section: the partition).
    ``files``: the data files the example reads, each a path relative to a data folder (``data.data_dirs``,
    ``$FEDSHUFFLE_DATA``) or a tuple of paths any one of which will do; the check is skipped naming the first one that
    is nowhere, and only then. ``arrays``: an ``.npz`` file written at check time, name → (shape, bound): integers in
    [0, bound) or, where the bound is None, standard normal floats; its path becomes the ``path`` setting of the
    ``[data]`` section.
    """

    settings: Mapping[str, Any] = field(default_factory=dict)
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    files: tuple[str | tuple[str, ...], ...] = ()
    arrays: Mapping[str, tuple[tuple[int, ...], int | None]] = field(default_factory=dict)


def roles(fields: Mapping[str, FieldInfo]) -> dict[str, Role]:
    """The role of each setting of ``fields`` (a settings model's ``model_fields``) that declares one, by name; a
    step size's ``quantity`` filled in with the setting's name where it gives none."""
    out: dict[str, Role] = {}
    for name, info in fields.items():
        for marker in info.metadata:
            if isinstance(marker, StepSize):
                out[name] = marker if marker.quantity else StepSize(name)
            elif isinstance(marker, (StepScale, ModelSize)):
                out[name] = marker
    return out


@functools.cache
def _optional(model: type[Settings], names: tuple[str, ...]) -> type[Settings]:
    """``model`` with the settings ``names`` optional (their values come later)."""
    return create_model(model.__name__, __base__=model, **{n: (Any, None) for n in names}) if names else model


class Settings(BaseModel):
    """A part's settings: unknown keys refused, no inf/nan, defaults filled in."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, arbitrary_types_allowed=True, validate_default=True)


def settings_model(name: str, factory: Callable[..., Any], runtime: tuple[str, ...]) -> type[Settings]:
    """The pydantic model of ``factory``'s keyword parameters other than ``runtime`` ones (its settings).

    A ``**kwargs`` parameter would swallow settings the part does not use, so it is refused.
    """
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except (NameError, TypeError):  # an annotation that cannot be resolved reads as Any
        hints = {}
    fields: dict[str, Any] = {}
    for parameter in inspect.signature(factory).parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            raise TypeError(
                f"{name}: **{parameter.name} would accept any setting and drop it; declare each setting as a keyword "
                "parameter"
            )
        if parameter.name in runtime or parameter.kind is parameter.VAR_POSITIONAL or parameter.name.startswith("_"):
            continue
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (hints.get(parameter.name, Any), default)
    model_name = "".join(part.capitalize() for part in name.replace("-", "_").split("_")) + "Settings"
    return create_model(model_name, __base__=Settings, **fields)


@dataclass(frozen=True)
class Entry:
    """A registered part: ``factory(**runtime, **settings)`` builds it.

    ``settings`` is the model of its own settings (None for registries that are not configured from a
    section, such as metrics); ``defaults`` are registry-specific metadata (a method's defaults for the
    other sections, a metric's kind).
    """

    name: str
    factory: Callable[..., Any]
    summary: str
    citation: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    settings: type[Settings] | None = None
    noun: str = "part"
    example: Example | None = field(default=None, kw_only=True)

    def setting_names(self) -> tuple[str, ...]:
        return tuple(self.settings.model_fields) if self.settings is not None else ()

    def roles(self) -> dict[str, Role]:
        """The declared role of each of its settings that has one (:func:`roles`)."""
        return roles(self.settings.model_fields) if self.settings is not None else {}

    def describe_settings(self) -> list[dict[str, Any]]:
        """Each setting's name, type, default and one-line help, as ``show``, the CLI help and the docs print them."""
        if self.settings is None:
            return []
        out = []
        for name, info in self.settings.model_fields.items():
            annotation = info.annotation
            kind = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
            default = "required" if info.is_required() else info.default
            out.append(
                {
                    "name": name,
                    "type": kind,
                    "default": list(default) if isinstance(default, tuple) else default,
                    "help": info.description or "",
                }
            )
        return out

    def check(self, given: Mapping[str, Any], pending: Collection[str] = ()) -> dict[str, Any]:
        """``given`` validated by this part's settings model, defaults filled in; errors name the setting
        (``ConfigError("alpha", ...)``; the section is added by the caller) and say what the part takes.
        ``pending``: settings whose value comes later (a step size given as ``'theory'``), neither required nor
        returned."""
        assert self.settings is not None, f"{self.noun} entries have no settings"
        unknown = [k for k in given if k not in self.settings.model_fields]
        if unknown:
            takes = self.setting_names()
            what = f"it takes {', '.join(takes)}" if takes else "it takes no settings"
            raise ConfigError(
                unknown[0], f"not a setting of {self.noun} {self.name!r}{did_you_mean(unknown[0], takes)}; {what}"
            )
        try:
            checked = _optional(self.settings, tuple(k for k in pending if k in self.settings.model_fields))
            return {k: v for k, v in checked.model_validate(dict(given)).model_dump().items() if k not in pending}
        except ValidationError as exc:
            error = exc.errors()[0]
            key = ".".join(str(p) for p in error["loc"][:1]) or "settings"
            if error["type"] == "missing":
                info = self.settings.model_fields[key]
                raise ConfigError(
                    key, f"{self.noun} {self.name!r} needs it{': ' + info.description if info.description else ''}"
                ) from None
            raise ConfigError(
                key, f"{error['msg'].removeprefix('Value error, ')} (got {error.get('input')!r})"
            ) from None

    def build(self, settings: Mapping[str, Any], **runtime: Any) -> Any:
        """The part with ``settings`` (checked, defaults filled) and those ``runtime`` values its factory takes."""
        accepted = inspect.signature(self.factory).parameters
        return self.factory(**{k: v for k, v in runtime.items() if k in accepted}, **self.check(settings))


class Registry:
    """Name → :class:`Entry`, for one kind of part (``kind`` names the setting that chooses it).

    ``runtime``: the names of the values the framework passes to every factory at build time; when
    given, each entry's other keyword parameters are its settings (:func:`settings_model`).
    """

    def __init__(self, kind: str, runtime: tuple[str, ...] | None = None, noun: str | None = None) -> None:
        self.kind = kind
        self.runtime = runtime
        self.noun = noun or kind.split(".")[0]
        self._entries: dict[str, Entry] = {}

    @property
    def configured(self) -> bool:
        """Whether entries declare settings (a section of the experiment file configures them)."""
        return self.runtime is not None

    def add(
        self,
        name: str,
        factory: Callable[..., Any],
        summary: str,
        citation: str = "",
        *,
        example: Example | None = None,
        **defaults: Any,
    ) -> Entry:
        """Register ``name``; ``example``: what its check runs it on (:class:`Example`)."""
        settings = self._settings(name, factory)
        return self._store(Entry(name, factory, summary, citation, defaults, settings, self.noun, example=example))

    def _settings(self, name: str, factory: Callable[..., Any]) -> type[Settings] | None:
        return settings_model(name, factory, self.runtime) if self.runtime is not None else None

    def _store(self, entry: Entry) -> Entry:
        """Keep ``entry`` (a registry of richer entries builds its own and stores it here)."""
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name!r} is registered twice")
        self._entries[entry.name] = entry
        return entry

    def remove(self, name: str) -> None:
        """Forget ``name`` (a part registered for a test or a notebook cell that is run again)."""
        self._entries.pop(name, None)

    def __getitem__(self, name: str) -> Entry:
        if name not in self._entries:
            raise ConfigError(
                self.kind, f"unknown {name!r}{did_you_mean(name, self._entries)}; accepted: {', '.join(self._entries)}"
            )
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entries(self) -> tuple[Entry, ...]:
        return tuple(self._entries.values())


def call_with(factory: Callable[..., Any], **offered: Any) -> Any:
    """``factory(**chosen)``: those of the ``offered`` values that ``factory``'s own parameters name."""
    accepted = inspect.signature(factory).parameters
    return factory(**{k: v for k, v in offered.items() if k in accepted})
