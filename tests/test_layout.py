"""The package's shape: no import cycle (imports inside functions included) and short functions."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "dflash_build"
MAX_FUNCTION_LINES = 60


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trees() -> dict[str, ast.Module]:
    return {_module(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports, wherever the import statement is."""
    trees = _trees()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash_build"):
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{node.module}.{alias.name}"
                    graph[module].add(sub if sub in trees else node.module)
            elif isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names if a.name.startswith("dflash_build")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "dflash_build.spec" in graph["dflash_build.config"]  # the graph is read at all
    assert _cycle(graph) is None, " → ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_function_reaches_sixty_lines() -> None:
    long = [
        f"{module}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for module, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 >= MAX_FUNCTION_LINES
    ]
    assert not long, long
