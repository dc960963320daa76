"""MkDocs hooks: pages generated from the code at build time, so the documentation cannot drift.

A page asks for generated content with an HTML comment on a line of its own:

* ``<!-- fedshuffle:cli -->`` — the ``--help`` of the command and of every subcommand, rendered by
  the typer app itself;
* ``<!-- fedshuffle:presets PAPER -->`` — the presets whose ``[experiment] paper`` contains ``PAPER``
  (title, figure, variants, seeds, rounds), from the preset files;
* ``<!-- fedshuffle:registry NAME -->`` — the entries of a registry (``methods``, ``problems``,
  ``sources``, ``partitions``, ``samplers``, ``server_optimizers``, ``metrics``): name, summary, source.

The docstrings' Sphinx roles (``:class:`~fedshuffle.x.Y```) are shown as code (``Y``).

After the build, every preset must have appeared on some page, or the build fails.
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^<!-- fedshuffle:(\w+)(?: (.*?))? -->$", re.MULTILINE)
#: a Sphinx role as the docstrings write them (:class:`~fedshuffle.x.Y`), once rendered to HTML
ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>(~?)([^<]*)</code>")
HELP_WIDTH = 80

_listed: set[str] = set()


class DocsError(Exception):
    """A marker that cannot be filled, or a preset missing from the pages."""


def registries() -> dict[str, Any]:
    from fedshuffle.data.catalog import PARTITIONS, SOURCES
    from fedshuffle.methods import METHODS
    from fedshuffle.metrics import METRICS
    from fedshuffle.problems import PROBLEMS
    from fedshuffle.samplers import SAMPLERS
    from fedshuffle.server import SERVER_OPTIMIZERS

    return {"methods": METHODS, "problems": PROBLEMS, "sources": SOURCES, "partitions": PARTITIONS, "samplers": SAMPLERS,
            "server_optimizers": SERVER_OPTIMIZERS, "metrics": METRICS}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def cli_help(args: list[str]) -> str:
    """``fedshuffle ARGS --help`` as plain text, as a terminal HELP_WIDTH columns wide would show it."""
    from typer.testing import CliRunner

    from fedshuffle.cli import app

    env = {"COLUMNS": str(HELP_WIDTH), "TERMINAL_WIDTH": str(HELP_WIDTH), "NO_COLOR": "1", "TERM": "dumb"}
    result = CliRunner().invoke(app, [*args, "--help"], env=env, prog_name="fedshuffle", terminal_width=HELP_WIDTH)
    if result.exit_code != 0:
        raise DocsError(f"fedshuffle {' '.join(args)} --help failed (exit {result.exit_code}): {result.output}{result.exception!r}")
    return "\n".join(line.rstrip() for line in result.output.strip("\n").splitlines())


def command_names() -> list[str]:
    import typer

    from fedshuffle.cli import app

    return list(typer.main.get_command(app).commands)


def render_cli() -> str:
    parts = ["## fedshuffle", "", "```text", cli_help([]), "```"]
    for name in command_names():
        parts += ["", f"## fedshuffle {name}", "", "```text", cli_help([name]), "```"]
    return "\n".join(parts)


def render_presets(paper: str) -> str:
    from fedshuffle.api import preset_table

    rows = [row for row in preset_table() if paper in row["paper"]]
    if not rows:
        raise DocsError(f"no preset has a paper containing {paper!r}")
    lines = ["| preset | figure | what | variants | seeds | rounds |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        _listed.add(row["name"])
        seeds = ", ".join(map(str, row["seeds"]))
        lines.append(f"| `{row['name']}` | {_cell(row['figure'])} | {_cell(row['title'])} | {_cell(', '.join(row['variants']))} | {seeds} | {row['rounds']} |")
    return "\n".join(lines)


def render_registry(name: str) -> str:
    table = registries().get(name)
    if table is None:
        raise DocsError(f"no registry {name!r}; accepted: {', '.join(registries())}")
    if not table.configured:
        lines = [f"| `{table.kind}` | what | from |", "| --- | --- | --- |"]
        lines += [f"| `{entry.name}` | {_cell(entry.summary)} | {_cell(entry.citation)} |" for entry in table.entries()]
        return "\n".join(lines)
    lines = [f"| `{table.kind}` | what | its settings (default) | from |", "| --- | --- | --- | --- |"]
    for entry in table.entries():
        settings = "<br>".join(f"`{s['name']}` = `{s['default']}`{': ' + s['help'] if s['help'] else ''}" for s in entry.describe_settings()) or "—"
        lines.append(f"| `{entry.name}` | {_cell(entry.summary)} | {_cell(settings)} | {_cell(entry.citation)} |")
    return "\n".join(lines)


def expand(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated content."""

    def fill(match: re.Match) -> str:
        kind, argument = match.group(1), (match.group(2) or "").strip()
        if kind == "cli":
            return render_cli()
        if kind == "presets":
            return render_presets(argument)
        if kind == "registry":
            return render_registry(argument)
        raise DocsError(f"unknown marker fedshuffle:{kind}")

    return MARKER.sub(fill, markdown)


def unlisted_presets() -> list[str]:
    from fedshuffle.experiments.schema import preset_names

    return [name for name in preset_names() if name not in _listed]


# -- MkDocs events ----------------------------------------------------------------------------------


def on_pre_build(config: Any) -> None:
    _listed.clear()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return expand(markdown)
    except DocsError as exc:
        raise PluginError(f"{page.file.src_path}: {exc}") from None


def plain_roles(html: str) -> str:
    """The docstrings' Sphinx roles as code: ``:class:`~a.b.C``` → ``C``, ``:func:`a.b```→ ``a.b``."""
    return ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return plain_roles(html)


def on_post_build(config: Any) -> None:
    from mkdocs.exceptions import PluginError

    missing = unlisted_presets()
    if missing:
        raise PluginError(f"presets on no paper page (add a <!-- fedshuffle:presets PAPER --> marker): {', '.join(missing)}")
