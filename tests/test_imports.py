"""The import graph of the package: no cycles, and no module below the experiments imports upwards.

Read from the source with ``ast`` (nothing is imported): an edge A → B for every ``import`` of B in A,
at the top of A or inside a function (an import inside a function only postpones a cycle, it does not
remove it). Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
#: the layers that run experiments and talk to users; nothing below them may import them
UPPER = (
    "fedshuffle.experiments",
    "fedshuffle.integrations",
    "fedshuffle.cli",
    "fedshuffle.api",
    "fedshuffle.testing",
    "fedshuffle.__main__",
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "fedshuffle").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imported(module: str, node: ast.Import | ast.ImportFrom, package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module.split(".") if package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" for alias in node.names] + [source]


def import_graph() -> dict[str, set[str]]:
    """module → the package's modules it imports (the longest importable prefix of each name)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skipped:
                continue
            for name in _imported(module, node, path.name == "__init__.py"):
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if (
                    name and name != module and not module.startswith(name + ".")
                ):  # a module's own package runs first anyway
                    graph[module].add(name)
    return graph


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["fedshuffle.experiments.runner"] >= {
        "fedshuffle.simulation"
    }  # the graph is read, not empty
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' → '.join(exc.args[1])}") from None


def test_nothing_below_the_experiments_imports_them():
    upward = sorted(
        f"{a} → {b}"
        for a, targets in import_graph().items()
        if not a.startswith(UPPER)
        for b in targets
        if b.startswith(UPPER)
    )
    assert not upward, f"upward imports: {', '.join(upward)}"


def test_imports_inside_functions_are_edges_too():
    graph = import_graph()
    assert "fedshuffle.executors.ray" in graph["fedshuffle.executors.choice"]  # imported where Ray is asked for


def test_the_subpackages_form_layers_without_a_cycle():
    """Grouped by top-level unit (fedshuffle.methods.*, fedshuffle.metrics, ...), the graph is still acyclic:
    each unit sits on the ones below it (analysis above methods above metrics above problems ...)."""
    units: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        unit = ".".join(module.split(".")[:2])
        units.setdefault(unit, set()).update(
            ".".join(t.split(".")[:2]) for t in targets if ".".join(t.split(".")[:2]) != unit
        )
    units.pop("fedshuffle", None)
    for targets in units.values():
        targets.discard("fedshuffle")  # the package's __init__ re-exports; it is not a layer
    try:
        tuple(graphlib.TopologicalSorter(units).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"a cycle between subpackages: {' → '.join(exc.args[1])}") from None
