"""Pydantic validation with one readable line per problem, raised as :class:`~fedshuffle.core.errors.ConfigError`.

Every table of a configuration (the experiment file, its claims, a part's settings) is validated through
:func:`validate`, so that every error reads alike: ``section.setting: what is wrong (got value)``, and an
unknown setting lists the accepted ones.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from fedshuffle.core.errors import ConfigError

#: the names pydantic gives the members of a union in an error's location (not settings)
_UNION_TAG = re.compile(
    r"^(int|float|str|bool|none|constrained-\w+|function-\w+\[.*|literal\[.*|list\[.*|tuple\[.*|dict\[.*"
    r"|sequence\[.*|json-or-python\[.*)$"
)


def _format_error(error: Mapping[str, Any], model: type[BaseModel], prefix: str) -> tuple[str, str]:
    """(the setting, what is wrong with it) of one pydantic error."""
    loc = [str(p) for p in error["loc"] if not _UNION_TAG.match(str(p))]
    field = prefix + ".".join(loc)
    raised = (error.get("ctx") or {}).get("error")
    if isinstance(
        raised, ConfigError
    ):  # raised by a validator that names its own setting (a part's settings, experiments.schema)
        return f"{field + '.' if field else ''}{raised.field}", raised.message
    if error["type"] == "extra_forbidden":
        parent: Any = model
        for part in loc[:-1]:
            if part.isdigit():
                continue
            annotation = (
                parent.model_fields[part].annotation
                if isinstance(parent, type) and part in getattr(parent, "model_fields", {})
                else None
            )
            annotation = (
                next((a for a in get_args(annotation) if isinstance(a, type)), annotation)
                if get_args(annotation)
                else annotation
            )
            parent = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if parent is None:
                break
        known = list(parent.model_fields) if parent is not None else []
        hint = difflib.get_close_matches(loc[-1], known, n=1)
        return field, f"unknown setting{f' (did you mean {hint[0]!r}?)' if hint else ''}; accepted: {', '.join(known)}"
    return field, f"{error['msg'].removeprefix('Value error, ')} (got {error.get('input')!r})"


def _one_line(problems: Mapping[str, list[str]]) -> str:
    """Every problem on one line: a setting that fails each member of a union reads ``Input should be A or B (got
    v)``."""
    parts = []
    for field, messages in problems.items():
        got = {m.rpartition(" (got ")[2] for m in messages}
        if len(messages) > 1 and len(got) == 1 and all(" (got " in m for m in messages):
            wants = [m.rpartition(" (got ")[0].removeprefix("Input should be ") for m in messages]
            parts.append(f"{field}: Input should be {' or '.join(wants)} (got {got.pop()}")
        else:
            parts.append(f"{field}: {'; '.join(messages)}")
    return "; ".join(parts)


def validate(model: type[BaseModel], raw: Mapping[str, Any], prefix: str = "") -> Any:
    """``model.model_validate(raw)`` with every problem on one readable line, raised as :class:`ConfigError`
    naming the first setting."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems: dict[str, list[str]] = {}
        for field, message in sorted({_format_error(e, model, prefix) for e in exc.errors()}):
            problems.setdefault(field, []).append(message)
        field = next(iter(problems))
        raise ConfigError(field, _one_line(problems)[len(field) + 2 :]) from None
