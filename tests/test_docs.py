"""The documentation's examples run: every ```python block of README.md, docs/ and the module docstring
of fedshuffle.api, and every
``fedshuffle`` command of their ```bash blocks — cheap ones (presets, show, inspect without a
config) are run, the others (run, sweep, plot, table, inspect --config) are parsed by the command
itself, with their presets, --set overrides and --grid values validated, but not run; every ```toml
block parses, and those with experiment sections are valid experiments.

Also checked without MkDocs: the generated pages (CLI reference, preset tables, registry tables)
render, every preset is on a paper page, and every page is in the navigation.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL
)
CHEAP_COMMANDS = {"presets", "show"}
PART_KINDS = {"methods", "problems", "sources", "partitions", "samplers", "server-optimizers", "metrics"}

sys.path.insert(0, str(ROOT / "tools"))
import docs_hooks  # noqa: E402


def blocks(page: Path, lang: str) -> list[tuple[int, str]]:
    """(line number, code) of each fenced block of ``lang`` on ``page``, dedented to its fence."""
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        if match.group("lang") != lang:
            continue
        indent = len(match.group("indent"))
        code = "\n".join(line[indent:] for line in match.group("body").splitlines())
        out.append((text.count("\n", 0, match.start()) + 2, code))
    return out


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


PYTHON_PAGES = [
    p for p in (*PAGES, ROOT / "src/fedshuffle/api.py") if blocks(p, "python")
]  # and the API's module docstring


@pytest.fixture
def clean_registries():
    """Examples register their own parts (theorems and schedules too); the rest of the test session must not see
    them."""
    from fedshuffle.analysis.theory import THEOREMS
    from fedshuffle.schedules import SCHEDULES

    tables = [*docs_hooks.registries().values(), THEOREMS, SCHEDULES]
    saved = [dict(t._entries) for t in tables]
    yield
    for table, entries in zip(tables, saved):
        table._entries.clear()
        table._entries.update(entries)


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_name)
def test_python_examples_run(page, tmp_path, monkeypatch, clean_registries):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    try:
        for line, code in blocks(page, "python"):
            # the documentation's own examples
            exec(compile(code, f"{_name(page)}:{line}", "exec"), namespace)
    finally:
        plt.close("all")


def fedshuffle_commands(code: str) -> list[list[str]]:
    """The ``fedshuffle ...`` commands of a shell block (continuations joined, comments and prompts dropped)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words and words[0] == "fedshuffle":
                commands.append(words[1:])
    return commands


BASH_COMMANDS = [
    (page, line, words) for page in PAGES for line, code in blocks(page, "bash") for words in fedshuffle_commands(code)
]


def test_the_pages_have_commands_to_check():
    assert len(BASH_COMMANDS) >= 15 and len(PYTHON_PAGES) >= 5 and TOML_BLOCKS


@pytest.mark.parametrize(
    ("page", "line", "words"), BASH_COMMANDS, ids=[f"{_name(p)}:{n}:{' '.join(w[:2])}" for p, n, w in BASH_COMMANDS]
)
def test_shell_examples_parse_and_cheap_ones_run(page, line, words, tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from fedshuffle.cli import app
    from fedshuffle.experiments.schema import load_experiment, parse_overrides
    from fedshuffle.experiments.sweep import parse_grid

    group = typer.main.get_command(app)
    if not words:  # `fedshuffle` alone prints the help
        assert CliRunner().invoke(app, ["--help"]).exit_code == 0
        return
    name, args = words[0], words[1:]
    assert name in group.commands, f"{_name(page)}:{line}: no command {name!r}"
    params = group.commands[name].make_context(name, list(args)).params  # unknown options and bad values raise here
    config = params.get("config")
    if (
        config
        and not config.endswith(".toml")
        and config not in PART_KINDS
        and name in ("run", "sweep", "show", "inspect")
    ):
        experiment = load_experiment(config)  # a preset that does not exist fails here
        overrides = parse_overrides(params.get("set_") or []) if name in ("run", "sweep") else {}
        for point in parse_grid(params.get("grid") or []):
            experiment.runs(
                {**overrides, **{k: {**overrides.get(k, {}), **v} for k, v in point.items()}}
            )  # settings and values are valid
    if name in CHEAP_COMMANDS or (name == "inspect" and not params.get("config")):
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(app, words)
        assert result.exit_code == 0, f"{_name(page)}:{line}: fedshuffle {' '.join(words)}\n{result.output}"


TOML_BLOCKS = [(page, line, code) for page in PAGES for line, code in blocks(page, "toml")]


@pytest.mark.parametrize(("page", "line", "code"), TOML_BLOCKS, ids=[f"{_name(p)}:{n}" for p, n, _ in TOML_BLOCKS])
def test_configuration_examples_are_valid_experiments(page, line, code):
    import tomllib

    import fedshuffle as fs
    from fedshuffle.experiments.schema import SECTIONS

    raw = tomllib.loads(code)  # every TOML example parses
    if set(raw) & {*SECTIONS, "experiment", "variants"}:  # an experiment (not another tool's file, e.g. Flower's)
        assert fs.experiment(raw).specs()


def test_the_command_line_page_is_current_and_lists_every_command_and_option():
    """docs/cli.md is generated from the command (``python tools/docs_hooks.py`` writes it again) and kept current."""
    import typer

    from fedshuffle.cli import app

    page = (DOCS / "cli.md").read_text()
    assert page == docs_hooks.cli_page(), "docs/cli.md is out of date: run python tools/docs_hooks.py"
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        section = page.split(f"\n## fedshuffle {name}\n", 1)[1].split("\n## fedshuffle ", 1)[0]
        assert f"fedshuffle {name} [OPTIONS]" in section
        for option in (o for p in command.params if p.name != "help" for o in p.opts if o.startswith("--")):
            assert f"`{option}`" in section, (name, option)
    assert "`--version`" in page.split("\n## fedshuffle run\n")[0]


def test_generated_pages_render():
    """Every registry's table: a header, then one row per entry naming it, with each declared setting in its row."""
    for name, registry in docs_hooks.registries().items():
        header, rule, *rows = docs_hooks.render_registry(name).split("\n")
        entries = registry.entries()
        assert header.startswith(f"| `{registry.kind}` |") and set(rule) <= set("|- ")
        assert len(rows) == len(entries), (name, len(rows), len(entries))
        for row, entry in zip(rows, entries):
            assert row.startswith(f"| `{entry.name}` |"), (name, row)
            for setting in entry.describe_settings() if registry.configured else ():
                assert f"`{setting['name']}` = " in row, (name, entry.name, setting["name"])
    with pytest.raises(docs_hooks.DocsError, match="no registry"):
        docs_hooks.render_registry("nope")


def test_every_preset_is_on_a_paper_page():
    docs_hooks.on_pre_build(None)
    for page in sorted((DOCS / "papers").glob("*.md")):
        docs_hooks.expand(page.read_text())
    assert docs_hooks.unlisted_presets() == []


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert str(page.relative_to(DOCS)) in nav, page


def test_sphinx_roles_of_the_docstrings_render_as_code():
    html = (
        "see :class:<code>~fedshuffle.api.Results</code>, :func:<code>fedshuffle.api.load_results</code> and "
        ":mod:<code>fedshuffle.metrics</code>"
    )
    assert (
        docs_hooks.plain_roles(html)
        == "see <code>Results</code>, <code>fedshuffle.api.load_results</code> and <code>fedshuffle.metrics</code>"
    )


def test_every_module_is_in_the_api_reference():
    documented = {
        line.split()[1]
        for page in (DOCS / "reference").glob("*.md")
        for line in page.read_text().splitlines()
        if line.startswith("::: ")
    }
    modules = {
        ".".join(path.relative_to(ROOT / "src").with_suffix("").parts)
        for path in (ROOT / "src/fedshuffle").rglob("*.py")
        if path.name != "__init__.py"
    }
    command_line = {m for m in modules if m.startswith("fedshuffle.cli.")} | {
        "fedshuffle.__main__"
    }  # the command line has its own page
    undocumented = sorted(modules - documented - command_line)
    assert not undocumented, f"add to a page of docs/reference (a '::: module' line): {', '.join(undocumented)}"


def test_the_docs_extra_brings_the_formatter_that_lays_out_the_api_signatures():
    """mkdocstrings formats signatures with Black (or Ruff) when one is installed, else leaves them on one line."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    assert any(requirement.startswith("black") for requirement in extra)
    rendering = pytest.importorskip(
        "mkdocstrings_handlers.python._internal.rendering", reason="the [docs] extra is not installed"
    )
    pytest.importorskip("black", reason="the [docs] extra is not installed")
    rendering._get_formatter.cache_clear()
    signature = "def run(self, out=None, *, seeds=None, variants=None, progress=True, workers=1, resume=False): pass"
    assert rendering._get_formatter()(signature, 60).count("\n") > 2  # laid out over lines, not left as it was


MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(page: Path) -> set[str]:
    """The anchors MkDocs gives the headings of ``page`` (Python-Markdown's toc slugify), fenced code left out."""
    import unicodedata

    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M):
        plain = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
        anchors.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", plain).strip().lower()))
    return anchors


def test_every_readme_link_resolves_to_a_page_the_docs_build_or_a_file_of_the_repository():
    """A README link to docs/ names a page in the navigation (so MkDocs builds it) and, with a fragment, one of
    its headings; any other link names a file of the repository (the examples)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    links = MARKDOWN_LINK.findall((ROOT / "README.md").read_text())
    assert len(links) >= 20 and any(link.startswith("examples/") for link in links)
    for link in links:
        assert not link.startswith(("http://", "https://", "/")), f"README links into the repository only: {link}"
        path, _, anchor = link.partition("#")
        assert (ROOT / path).is_file(), f"README links to {path}, which does not exist"
        if path.startswith("docs/"):
            assert path.endswith(".md") and str(Path(path).relative_to("docs")) in nav, (
                f"{path} is not in mkdocs.yml's nav"
            )
            assert not anchor or anchor in heading_anchors(ROOT / path), f"{link}: no such heading"


def test_the_readme_is_short_and_its_removed_sections_live_in_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    pages = {path: path.read_text() for path in DOCS.rglob("*.md")}
    for moved in (
        "## Conventions chosen where the papers are silent",
        "# Theoretical step sizes",
        "## Checkpoint and resume",
        "## Reading the results",
        "## Optional sinks",
        "## Sweeps",
        "## Plots and tables",
        "# Executors and devices",
        "# Flower: the same methods on real devices",
        "# Performance",
        "# Real data",
        "# Neural networks",
        "## Does the paper's claim hold here?",
        "# Which objective does my configuration minimize?",
    ):
        holders = [p for p, text in pages.items() if re.search(rf"^{re.escape(moved)}$", text, flags=re.M)]
        assert len(holders) == 1, f"{moved!r} is on {len(holders)} pages"
