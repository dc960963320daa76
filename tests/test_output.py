"""What the commands print: a rich table on a terminal, a Markdown table (never cut or wrapped) anywhere else."""

from __future__ import annotations

import io

from rich.console import Console
from rich.text import Text

from fedshuffle.cli import output

LONG = "a claim quoted from the paper, " * 6  # 180 characters: past any 80-column wrap


def test_in_a_pipe_a_table_is_markdown_and_no_line_is_wrapped(capsys, monkeypatch):
    monkeypatch.setattr(output, "console", Console(file=io.StringIO(), width=80))  # not a terminal
    output.print_table(
        "claims", ("claim", "verdict", "n"), [(LONG, Text.assemble(("holds", "green"), ": 3 seeds"), "3")], right=("n",)
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == ["claims", "", "| claim | verdict | n |", "| --- | --- | ---: |"]
    assert lines[4] == f"| {LONG} | holds: 3 seeds | 3 |"  # one line, the styled cell as its plain text


def test_on_a_terminal_a_table_is_a_rich_table(capsys, monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(output, "console", Console(file=screen, force_terminal=True, width=100, color_system=None))
    output.print_table("claims", ("claim", "verdict"), [("short", Text("holds", style="green"))])
    assert capsys.readouterr().out == ""  # nothing as Markdown
    drawn = screen.getvalue()
    assert "claims" in drawn and "┃ claim" in drawn and "│ short" in drawn and "| --- |" not in drawn
