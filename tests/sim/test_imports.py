"""The simulator's modules import one another without a cycle, TYPE_CHECKING blocks included.

A cycle hidden under ``if TYPE_CHECKING:`` still means two modules each need the
other's types to be understood: the split into files would be in name only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvproto_tools.sim

PACKAGE = "kvproto_tools.sim"
ROOT = Path(kvproto_tools.sim.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PACKAGE, *parts])


def _imported(tree: ast.Module, modules: set[str]) -> set[str]:
    """The package's modules named by every import statement, at any depth."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from pkg import mod`` names a module; ``from pkg.mod import x`` names pkg.mod.
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the package's ``__init__`` excluded)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths) - {PACKAGE}
    return {
        name: _imported(ast.parse(paths[name].read_text(encoding="utf-8")), modules) - {name}
        for name in sorted(modules)
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as the path that closes it), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            cycle = visit(nxt)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in graph:
        cycle = visit(start)
        if cycle is not None:
            return cycle
    return None


def test_the_import_graph_is_read() -> None:
    graph = import_graph()
    assert f"{PACKAGE}.flows" in graph[f"{PACKAGE}.engine"]
    assert f"{PACKAGE}.context" in graph[f"{PACKAGE}.flows"]  # a TYPE_CHECKING import


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_simulator_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])
