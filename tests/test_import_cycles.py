"""No import circles anywhere in the package, function-level and ``TYPE_CHECKING``
imports included (a lazy import that dodges a circle at import time is still one). A
module that needs only the shape of a class above it is typed by a Protocol of the
members it uses; a package's own modules import each other by module name, not through
the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__)."""
    out = {}
    for path in (SRC / "shardreplay").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_lazy_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_cycle_finder_counts_imports_through_a_package_init() -> None:
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "p.c": set()}
    assert cycles(graph) == [["p", "p.a", "p.b"]]


def test_the_graph_holds_every_module() -> None:
    graph = import_graph()
    assert len(graph) > 100, "the package moved?"
    assert "shardreplay.buffer.shard" in graph["shardreplay.buffer.replay_buffer"]


def test_no_import_circles_in_the_package() -> None:
    bad = cycles(import_graph())
    assert not bad, f"import circles (move the shared names into a module of their own): {bad}"
