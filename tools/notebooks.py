"""The notebooks of examples/ are generated from its scripts, so that the two never differ.

Each script is in the "percent" format that Jupyter, VS Code and PyCharm read as cells: a line ``# %%`` starts a
code cell, ``# %% [markdown]`` a Markdown cell (its lines' ``# `` removed), and ``# %% tags=["parameters"]`` the
code cell of the settings that the tests replace with smaller ones (papermill's convention). A script runs as it
is: ``python examples/01_first_comparison.py``.

``python tools/notebooks.py`` writes ``examples/notebooks/NAME.ipynb`` for every ``examples/NAME.py`` (without
outputs); tests/test_examples.py checks that they are current and runs each one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CELL = re.compile(r"^# %%(?P<markdown> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?\s*$")


def cells(script: str) -> list[dict[str, Any]]:
    """The cells of a percent-format script: ``{"cell_type", "source", "tags"}``, in order."""
    out: list[dict[str, Any]] = []
    for line in script.splitlines():
        start = CELL.match(line)
        if start:
            out.append(
                {
                    "cell_type": "markdown" if start["markdown"] else "code",
                    "lines": [],
                    "tags": json.loads(start["tags"] or "[]"),
                }
            )
        elif not out:
            raise ValueError(f"the script must start with a '# %%' line, not {line!r}")
        else:
            markdown = out[-1]["cell_type"] == "markdown"
            out[-1]["lines"].append(("" if line == "#" else line.removeprefix("# ")) if markdown else line)
    return [{"cell_type": c["cell_type"], "source": "\n".join(c["lines"]).strip("\n"), "tags": c["tags"]} for c in out]


def notebook(script: Path) -> Any:
    """The notebook of ``script`` (an nbformat v4 node, no outputs)."""
    import nbformat

    made = []
    for cell in cells(script.read_text()):
        metadata = {"tags": cell["tags"]} if cell["tags"] else {}
        maker = nbformat.v4.new_markdown_cell if cell["cell_type"] == "markdown" else nbformat.v4.new_code_cell
        made.append(maker(cell["source"], metadata=metadata))
    book = nbformat.v4.new_notebook(cells=made)
    book.metadata.update(
        {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        }
    )
    for k, cell in enumerate(book.cells):  # ids stable from one generation to the next
        cell["id"] = f"{script.stem[:2]}-{k:02d}"
    return book


def notebook_path(script: Path) -> Path:
    return EXAMPLES / "notebooks" / f"{script.stem}.ipynb"


def scripts() -> list[Path]:
    return sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))


def write_all() -> list[Path]:
    """Every script's notebook written again; returns their paths."""
    import nbformat

    written = []
    for script in scripts():
        path = notebook_path(script)
        path.parent.mkdir(exist_ok=True)
        path.write_text(nbformat.writes(notebook(script)) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_all():
        print(path.relative_to(ROOT))
