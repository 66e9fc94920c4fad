"""The import graph of the astraflow package, read from its source (nothing is imported).

Every edge is one module importing another: at module level (what runs on import), or inside a function
(what runs when the function does; an import under `if TYPE_CHECKING:` never runs and is left out).
`cli.py` names its handlers as `"module:function"` strings that it imports when a command runs: those are
function-level edges too. Importing `a.b.c` from outside package `a.b` also runs `a/b/__init__.py`, an
edge to that package.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import astraflow

ROOT = Path(astraflow.__file__).parent
HANDLER = re.compile(r"^(astraflow(?:\.\w+)+):\w+$")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool
    """Inside a function: it runs when the function does, not on import."""

    def __str__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target}{' (in a function)' if self.lazy else ''}"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> source file of every module of the package (a package by its `__init__.py`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module, module: str, is_package: bool):
    """(dotted name, line, lazy) of every import in `tree`, TYPE_CHECKING blocks left out."""

    def visit(node: ast.AST, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                yield from (x for orelse in child.orelse for x in visit(orelse, lazy))
                continue
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                yield from ((a.name, child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the module's package
                    package = module.split(".")[: len(module.split(".")) - child.level + is_package]
                    base = ".".join([*package, *([base] if base else [])])
                yield (base, child.lineno, lazy)
                yield from ((f"{base}.{a.name}", child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                if (m := HANDLER.match(child.value)) is not None:
                    yield (m[1], child.lineno, True)
            yield from visit(child, inner)

    yield from visit(tree, False)


def edges(root: Path = ROOT) -> list[Edge]:
    """Every import of one astraflow module by another (deduplicated per source, target and kind)."""
    known = modules(root)
    out: dict[tuple[str, str, bool], Edge] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        for name, line, lazy in _imports(tree, module, path.name == "__init__.py"):
            target = name
            while target and target not in known:  # `from a.b import Name`: module a.b
                target = target.rpartition(".")[0]
            if not target:
                continue
            parts = target.split(".")
            for depth in range(2, len(parts) + 1):  # the packages on the way run first
                hop = ".".join(parts[:depth])
                if hop != module and not module.startswith(hop + "."):
                    out.setdefault((module, hop, lazy), Edge(module, hop, line, lazy))
    return list(out.values())


def cycles(graph_edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a cycle or several), sorted."""
    graph: dict[str, list[str]] = {}
    for e in graph_edges:
        graph.setdefault(e.source, []).append(e.target)
        graph.setdefault(e.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def room(module: str) -> str:
    """The part of the package a module belongs to: its subpackage (`streams`, `ops`, ...), else itself
    (`config`, `messages`, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]
