"""Names that become folder names: an experiment's name (its results folder, ``results/<name>``) and the slug of any
text."""

from __future__ import annotations

import re
import unicodedata


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a folder name inside another folder (None when it can)."""
    if not name.strip() or name.strip() in (".", ".."):
        return "empty, '.' or '..'"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in name):
        return "holds a control character"
    if len(name.encode()) > 200:
        return "longer than 200 bytes"
    return None


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.").lower() or "run"
