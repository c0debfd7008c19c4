"""The packages import downward only, and never in a circle.

Floors, lowest first: the shared definitions (errors, config, sampling parameters, outputs and the small
top-level helpers), kernels, layers, models, the runtime (and the grammar engines beside it), the proposers,
the engine, then what users run (the server, training, benchmarks, the package's own `atlas` names) and the
command line. A module may import its own floor and the floors below it, at module level or inside a function
(a lazy import is still a dependency); imports under `if TYPE_CHECKING:` are annotations only and not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import atlas

ROOT = Path(atlas.__file__).parent
BASE = 0
FLOORS = {
    "kernels": 1, "layers": 2, "models": 3, "runtime": 4, "structured": 4, "speculative": 5, "engine": 6,
    "server": 7, "training": 7, "bench": 7, "__init__": 7, "cli": 8, "__main__": 8,
}


def _unit(module: str) -> str:
    """atlas.x.y -> x (a package, or a top-level module); atlas -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _floor(unit: str) -> int:
    return FLOORS.get(unit, BASE)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports() -> list[tuple[str, str, str, int]]:
    """(importing unit, imported unit, file, line) of every atlas import between units."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        unit = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "atlas":  # (from atlas import x: a sub-package or a top-level name)
                    names = [f"atlas.{a.name}" if (ROOT / a.name).exists() or (ROOT / f"{a.name}.py").exists()
                             else "atlas" for a in node.names]
                else:
                    names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == "atlas" or name.startswith("atlas."):
                    target = _unit(name)
                    if target != unit:
                        found.append((unit, target, str(rel), node.lineno))
    return found


def test_nothing_imports_upward():
    upward = [f"{file}:{line}: {unit} (floor {_floor(unit)}) imports {target} (floor {_floor(target)})"
              for unit, target, file, line in _imports() if _floor(target) > _floor(unit)]
    assert not upward, "\n".join(upward)


def test_no_import_circles_between_packages():
    graph: dict[str, set[str]] = {}
    for unit, target, _, _ in _imports():
        graph.setdefault(unit, set()).add(target)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not circles, circles


def test_the_check_sees_an_upward_import(tmp_path):
    """(The scan itself: a layer importing the engine is found, and one under TYPE_CHECKING is not.)"""
    source = ("from typing import TYPE_CHECKING\nfrom atlas.engine.core import EngineCore\n"
              "if TYPE_CHECKING:\n    from atlas.server.app import build_app\n")
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skip]
    assert modules == ["typing", "atlas.engine.core"]
    assert _floor(_unit("atlas.engine.core")) > _floor("layers")
