"""The base of every section: a section's own settings are closed (an unknown key is an error), and a section whose
chooser (``name``, ``source``, ...) names a registered part validates the rest of its keys as that part's own settings
(:class:`_PartSection`). A step size declared by a part also takes ``'theory'``."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from fedshuffle.core.errors import ConfigError, did_you_mean
from fedshuffle.core.registry import Entry, Registry, Role, StepScale, StepSize, roles


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def roles(self) -> dict[str, Role]:
        """The declared role of each of the section's settings that has one (:func:`fedshuffle.core.registry.roles`)."""
        return roles(type(self).model_fields)


Theory = Literal["theory"]


def _theory_or(info: FieldInfo) -> tuple[Any, FieldInfo]:
    """A declared setting as a field of its section: a step size (the role :class:`StepSize`) also takes ``'theory'``
    (resolved from the problem and data before building) and, where its part has no default, defaults to None (the
    part asks for it when it is built); its constraints bind the number."""
    role = [m for m in info.metadata if isinstance(m, (StepSize, StepScale))]
    if not any(isinstance(m, StepSize) for m in role):
        return info.annotation, info
    constraints = [m for m in info.metadata if m not in role]
    number = Annotated[(info.annotation, *constraints)] if constraints else info.annotation
    default = None if info.is_required() else info.default
    described = f"{info.description}, or 'theory' (fedshuffle.analysis.theory)"
    return Annotated[(number | Theory | None, *role)], Field(default, description=described)


def _registered(registry: Registry, value: Any, noun: str) -> str:
    """``value`` if it names an entry of ``registry`` now (parts registered after import included)."""
    if not isinstance(value, str) or value not in registry:
        hint = difflib.get_close_matches(str(value), registry.names(), n=1)
        raise ValueError(
            f"not a registered {noun}{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: {', '.join(registry)}"
        )
    return value


def _chosen_names(value: Any) -> list[Any]:
    """The parts a chooser names: one, or a list (``run.sinks``)."""
    return list(value) if isinstance(value, list) else [value]


class _PartSection(_Section):
    """A section whose chooser (``name``, ``source``, ...) names a registered part: its other keys are that
    part's own settings, validated by the part's declared model (:mod:`fedshuffle.core.registry`) with
    its defaults filled in. A key the chosen part does not take is an error naming the part and what it
    takes. ``_choosers`` maps each chooser field (a name, or a list of names) to its registry; the section's other
    fields belong to the section."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)
    _choosers: ClassVar[dict[str, Registry]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_parts(cls, raw: Any) -> Any:
        """Each chooser names a part registered now (parts registered after import included)."""
        if isinstance(raw, Mapping):
            for chooser, registry in cls._choosers.items():
                for name in _chosen_names(raw.get(chooser)) if chooser in raw else ():
                    try:
                        _registered(registry, name, registry.noun)
                    except ValueError as exc:
                        raise ConfigError(chooser, str(exc)) from None
        return raw

    @model_validator(mode="after")
    def _chosen_parts_settings(self) -> Any:
        given = {k: v for k, v in (self.__pydantic_extra__ or {}).items() if v is not None}  # None: the part's default
        entries = self._chosen_entries()
        steps = {k for e in entries for k, role in e.roles().items() if isinstance(role, StepSize)}
        theory = {k: given.pop(k) for k in steps if given.get(k) == "theory"}  # a step size: resolved before building
        settings: dict[str, Any] = {}
        for entry in entries:
            settings.update(entry.check({k: v for k, v in given.items() if k in entry.setting_names()}, theory))
        unknown = [k for k in given if k not in settings]
        refusal = self._another_parts_setting(unknown[0], entries) if unknown else None
        if refusal is not None:
            raise refusal
        if unknown:
            if len(entries) == 1 and len(self._choosers) == 1:
                entries[0].check(given)  # raises, naming the part and what it takes
            takes = "; ".join(f"{e.noun} {e.name!r} takes {', '.join(e.setting_names()) or 'none'}" for e in entries)
            common = [k for k in type(self).model_fields if k not in self._choosers]
            parts = " or ".join(f"{e.noun} {e.name!r}" for e in entries)
            raise ConfigError(
                unknown[0],
                f"not a setting of {parts}{did_you_mean(unknown[0], [*settings, *common])}; {takes}; "
                f"the [{self._section_name()}] section also takes {', '.join(common)}",
            )
        object.__setattr__(self, "__pydantic_extra__", {**settings, **theory})
        return self

    def _another_parts_setting(self, key: str, entries: list[Entry]) -> ConfigError | None:
        """``key`` refused as a setting of parts that are not chosen, naming them and what the chosen ``entries`` take
        (None where no registered part takes it)."""
        owners = [
            (chooser, e)
            for chooser, registry in self._choosers.items()
            for e in registry.entries()
            if key in e.setting_names()
        ]
        if not owners:
            return None
        chosen = "; ".join(
            f"{e.noun} {e.name!r} takes {', '.join(e.setting_names()) or 'no settings'}" for e in entries
        )
        chooser = owners[0][0]
        unchosen = (
            f"which {self._section_name()}.{chooser} does not list"
            if isinstance(getattr(self, chooser), list)
            else "not of the chosen one"
        )
        named = ", ".join(f"{e.noun} {e.name!r}" for _, e in owners[:3])
        return ConfigError(key, f"a setting of {named}{' ...' if len(owners) > 3 else ''}, {unchosen}; {chosen}")

    @classmethod
    def _section_name(cls) -> str:
        return next(iter(cls._choosers.values())).kind.split(".")[0]

    def own_settings(self) -> dict[str, Any]:
        """The chosen parts' own settings (defaults filled in)."""
        return dict(self.__pydantic_extra__ or {})

    def roles(self) -> dict[str, Role]:
        """The declared roles of the section's own settings and of the chosen parts' settings."""
        chosen = [entry.roles() for entry in self._chosen_entries()]
        return {k: v for part in (super().roles(), *chosen) for k, v in part.items()}

    def _chosen_entries(self) -> list[Entry]:
        """The registered parts the choosers name (one per chooser, or a list of them: ``run.sinks``)."""
        return [
            registry[name]
            for chooser, registry in self._choosers.items()
            for name in _chosen_names(getattr(self, chooser))
        ]
