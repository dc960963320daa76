"""Method knowledge stays on the methods: no module outside ``fedshuffle/methods/`` imports a method class, names one,
or compares a method's name; what the rest of the package needs to know about a method is an attribute or a method
of :class:`~fedshuffle.methods.base.Method` or a declaration of its registry entry."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import numpy as np
import pytest

import fedshuffle
from fedshuffle.methods import METHODS, Method

PACKAGE = Path(fedshuffle.__file__).parent


def _method_classes() -> set[str]:
    """The names of every class of ``fedshuffle.methods`` that is a method (a subclass of :class:`Method`)."""
    names = set()
    for path in (PACKAGE / "methods").glob("*.py"):
        module = importlib.import_module(
            f"fedshuffle.methods.{path.stem}" if path.stem != "__init__" else "fedshuffle.methods"
        )
        names |= {
            name
            for name, value in vars(module).items()
            if isinstance(value, type) and issubclass(value, Method) and value is not Method
        }
    return names


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def _offences(path: Path, classes: set[str], names: set[str]) -> list[str]:
    """What ``path`` knows of a method: an import or a mention of a method class, a comparison of something named like a
    method or a name (``spec.method.name``, ``name``) with a registered method's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        what: list[str] = []
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedshuffle.methods"):
            what = [f"imports {a.name}" for a in node.names if a.name in classes]
        elif isinstance(node, ast.Name) and node.id in classes:
            what = [f"names {node.id}"]
        elif isinstance(node, ast.Attribute) and node.attr in classes:
            what = [f"names {node.attr}"]
        elif isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if any("method" in ast.unparse(side) or "name" in ast.unparse(side) for side in sides):
                what = [f"compares with {s!r}" for side in sides for s in _strings(side) if s in names]
        found += [f"line {node.lineno}: {w}" for w in what]
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "methods" not in p.relative_to(PACKAGE).parts[:1])


def test_the_walk_sees_the_method_classes_and_a_known_offence():
    classes = _method_classes()
    assert {"FedCDR", "FedDyn", "Scaffold", "GlobalMomentum"} <= classes
    names = set(METHODS.names())
    strategy = PACKAGE / "integrations/flower/strategy.py"
    if strategy.exists() and "FedCDR" in strategy.read_text(encoding="utf-8"):  # the check finds what it looks for
        assert _offences(strategy, classes, names)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_module_outside_the_methods_knows_a_method(path):
    assert not _offences(path, _method_classes(), set(METHODS.names())), path.relative_to(PACKAGE).as_posix()


def test_the_closed_form_fixed_point_asks_the_method_whether_its_local_steps_are_plain():
    """What :func:`unit_quadratic_fixed_point` needs of a method is ``Method.plain_local_steps``: false for global
    momentum's drift and for methods with a term of their own in the local steps, kept through the wrappers."""
    from fedshuffle import FullParticipation, build_algorithm, unit_quadratic_fixed_point

    sizes, means = [1, 2, 3], np.eye(3)
    weights = np.array(sizes) / 6
    plain = build_algorithm("fedavg", {"local": {"lr": 0.1}})
    assert plain.method.plain_local_steps
    x = unit_quadratic_fixed_point(plain, FullParticipation(3), sizes, weights, means)
    # FedAvg, one epoch of single-sample steps: x̂ = Σ w_i s_i c_i / Σ w_i s_i, s_i = 1 − 0.9^|D_i|
    s = 1 - 0.9 ** np.array(sizes)
    np.testing.assert_allclose(x, np.array(sizes) * s / (np.array(sizes) @ s), rtol=1e-12)
    for name, settings in (("fedavg", {"server": {"global_momentum": 0.9}}), ("scaffold", {}), ("feddyn", {})):
        algorithm = build_algorithm(name, {"local": {"lr": 0.1}, **settings})
        assert not algorithm.method.plain_local_steps, name
        with pytest.raises(ValueError, match="plain local SGD only"):
            unit_quadratic_fixed_point(algorithm, FullParticipation(3), sizes, weights, means)
    private = build_algorithm("fedavg", {"local": {"lr": 0.1}, "privacy": {"mode": "local", "clip": 1.0}})
    assert private.method.plain_local_steps
