"""MkDocs hooks: pages generated from the code at build time, so the documentation cannot drift.

A page asks for generated content with an HTML comment on a line of its own:

* ``<!-- fedshuffle:presets PAPER -->`` — the presets whose ``[experiment] paper`` contains ``PAPER``
  (title, figure, variants, seeds, rounds), from the preset files;
* ``<!-- fedshuffle:registry NAME -->`` — the entries of a registry (``methods``, ``problems``,
  ``sources``, ``partitions``, ``samplers``, ``server_optimizers``, ``metrics``): name, summary, source;
* ``<!-- fedshuffle:flower_settings -->`` — the Flower app's run-config keys (key, default, description), from
  :class:`fedshuffle.integrations.flower.common.AppSettings`.

The docstrings' Sphinx roles (``:class:`~fedshuffle.x.Y```) are shown as code (``Y``).

After the build, every preset must have appeared on some page, or the build fails.

docs/cli.md, the command line's reference, is generated from the typer app (:func:`cli_page`) and kept in the
repository, where it reads as it is; tests/test_docs.py checks that it is current, and
``python tools/docs_hooks.py`` writes it again.
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^<!-- fedshuffle:(\w+)(?: (.*?))? -->$", re.MULTILINE)
#: a Sphinx role as the docstrings write them (:class:`~fedshuffle.x.Y`), once rendered to HTML
ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>(~?)([^<]*)</code>")

_listed: set[str] = set()


class DocsError(Exception):
    """A marker that cannot be filled, or a preset missing from the pages."""


def registries() -> dict[str, Any]:
    from fedshuffle.data.catalog import PARTITIONS, SOURCES
    from fedshuffle.executors import EXECUTORS
    from fedshuffle.experiments.sinks import SINKS
    from fedshuffle.methods import METHODS
    from fedshuffle.metrics import METRICS
    from fedshuffle.problems import PROBLEMS
    from fedshuffle.samplers import SAMPLERS
    from fedshuffle.server import SERVER_OPTIMIZERS

    return {
        "methods": METHODS,
        "problems": PROBLEMS,
        "sources": SOURCES,
        "partitions": PARTITIONS,
        "samplers": SAMPLERS,
        "server_optimizers": SERVER_OPTIMIZERS,
        "executors": EXECUTORS,
        "sinks": SINKS,
        "metrics": METRICS,
    }


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


CLI_PAGE_HEAD = """# Command line

Every command and option of `fedshuffle`, generated from the command itself (`python tools/docs_hooks.py` writes
this page again; a test checks that it is current). `fedshuffle COMMAND --help` prints the same in a terminal. Bad
input stops before any work with one line naming the setting or option and what is accepted (exit status 2).
"""


def _declared_help(callback: Any) -> dict[str, str]:
    """Parameter name → the help declared on a command's ``typer.Argument``/``typer.Option`` (click 8.5 drops an
    argument's help from the parameter typer builds, so it is read from the declaration)."""
    import typing

    from typer.models import ParameterInfo

    hints = typing.get_type_hints(callback, include_extras=True)
    return {
        name: info.help
        for name, hint in hints.items()
        for info in getattr(hint, "__metadata__", ())
        if isinstance(info, ParameterInfo) and info.help
    }


def _option_row(param: Any, declared: dict[str, str]) -> str:
    """One Markdown row of an argument or option: its names, what it takes, its default and its help."""
    import click

    names = (
        ", ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
        if isinstance(param, click.Option)
        else f"`{param.name.upper()}`"
    )
    flag = isinstance(param, click.Option) and param.is_flag
    takes = "flag" if flag else param.type.name.upper() + (" (repeat)" if getattr(param, "multiple", False) else "")
    if isinstance(param.show_default, str):
        default = param.show_default
    elif param.required:
        default = "required"
    elif param.default is None or param.default == [] or (flag and param.default is False):
        default = "—"
    else:
        default = f"`{param.default}`"
    return f"| {names} | {takes} | {default} | {_cell(getattr(param, 'help', None) or declared.get(param.name, ''))} |"


def render_cli_markdown() -> str:
    """Every command of the typer app as Markdown: usage, description, and a table of its arguments and options."""
    import click
    import typer

    from fedshuffle.cli import app

    group = typer.main.get_command(app)
    root = click.Context(group, info_name="fedshuffle")
    options = [p for p in group.params if p.name != "help"]
    parts = [
        "## fedshuffle",
        "",
        "```text",
        group.get_usage(root).removeprefix("Usage: "),
        "```",
        "",
        group.help or "",
        "",
        "| argument or option | takes | default | what |",
        "| --- | --- | --- | --- |",
        *(_option_row(p, {}) for p in options),
    ]
    for name, command in group.commands.items():
        context = click.Context(command, info_name=name, parent=root)
        params = [p for p in command.params if p.name != "help"]
        parts += [
            "",
            f"## fedshuffle {name}",
            "",
            "```text",
            command.get_usage(context).removeprefix("Usage: "),
            "```",
            "",
            command.help or "",
            "",
        ]
        if params:
            declared = _declared_help(command.callback)
            parts += [
                "| argument or option | takes | default | what |",
                "| --- | --- | --- | --- |",
                *(_option_row(p, declared) for p in params),
            ]
    return "\n".join(parts)


def cli_page() -> str:
    """docs/cli.md as it must read."""
    return f"{CLI_PAGE_HEAD}\n{render_cli_markdown()}\n"


def command_names() -> list[str]:
    import typer

    from fedshuffle.cli import app

    return list(typer.main.get_command(app).commands)


def render_presets(paper: str) -> str:
    from fedshuffle.api import preset_table

    rows = [row for row in preset_table() if paper in row["paper"]]
    if not rows:
        raise DocsError(f"no preset has a paper containing {paper!r}")
    lines = ["| preset | figure | what | variants | seeds | rounds |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        _listed.add(row["name"])
        seeds = ", ".join(map(str, row["seeds"]))
        lines.append(
            f"| `{row['name']}` | {_cell(row['figure'])} | {_cell(row['title'])} | "
            f"{_cell(', '.join(row['variants']))} | {seeds} | {row['rounds']} |"
        )
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
        settings = (
            "<br>".join(
                f"`{s['name']}` = `{s['default']}`{': ' + s['help'] if s['help'] else ''}"
                for s in entry.describe_settings()
            )
            or "—"
        )
        lines.append(f"| `{entry.name}` | {_cell(entry.summary)} | {_cell(settings)} | {_cell(entry.citation)} |")
    return "\n".join(lines)


def expand(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generated content."""

    def fill(match: re.Match) -> str:
        kind, argument = match.group(1), (match.group(2) or "").strip()
        if kind == "presets":
            return render_presets(argument)
        if kind == "registry":
            return render_registry(argument)
        if kind == "flower_settings":
            from fedshuffle.integrations.flower.common import settings_table

            return settings_table()
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
        raise PluginError(
            f"presets on no paper page (add a <!-- fedshuffle:presets PAPER --> marker): {', '.join(missing)}"
        )


if __name__ == "__main__":
    from pathlib import Path

    Path(__file__).resolve().parent.parent.joinpath("docs", "cli.md").write_text(cli_page())
