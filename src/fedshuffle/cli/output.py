"""Tables and numbers as the commands print them.

On a terminal a table is a rich table as wide as the terminal; anywhere else (a pipe, a file, a
log) it is a Markdown table whose cells are never cut, so ``fedshuffle presets > presets.md`` reads
as well as the screen. Numbers over seeds are ``mean ± std``, and the mean alone for one seed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rich.table import Table
from rich.text import Text

from fedshuffle.cli.common import console


def mean_std(mean: float, std: float, n: int, digits: int = 4) -> str:
    """``mean ± std`` over ``n`` seeds; the mean alone when there is one seed (its std says nothing)."""
    return f"{mean:.{digits}g}" if n <= 1 else f"{mean:.{digits}g} ± {std:.2g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(columns: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[str] = ()) -> str:
    """A Markdown table; columns named in ``right`` are right-aligned."""
    lines = [
        "| " + " | ".join(map(_cell, columns)) + " |",
        "|" + "|".join(" ---: " if c in right else " --- " for c in columns) + "|",
    ]
    lines += ["| " + " | ".join(_cell(str(v)) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str | Text]],
    *,
    right: Collection[str] = (),
    no_wrap: Collection[str] = (),
) -> None:
    """A rich table on a terminal (full width), else ``title`` and a Markdown table, nothing truncated or wrapped.
    A cell may be a :class:`rich.text.Text`: styled on a terminal, its plain text in Markdown."""
    if console.is_terminal:
        table = Table(title=title or None)
        for col in columns:
            table.add_column(col, justify="right" if col in right else "left", no_wrap=col in no_wrap)
        for row in rows:
            table.add_row(*(cell if isinstance(cell, Text) else str(cell) for cell in row))
        console.print(table, soft_wrap=False)
        return
    if title:
        print(f"{title}\n")
    print(markdown(columns, rows, right) + "\n")
