"""The package's modules import each other in one direction: no cycle at import time, none through an
import inside a function (which hides a cycle until the function runs, and is how one is dodged), and
none between the package's parts (`streams`, `launch`, `ops`, `config`, ...). Imports of heavy
third-party modules inside functions (torch, vllm, transformers) stay allowed: only astraflow's own
modules make the graph (`tests/import_graph.py`)."""

from pathlib import Path

import pytest

from tests.import_graph import ROOT, Edge, cycles, edges, room

pytestmark = pytest.mark.timeout(60)


def explain(components: list[list[str]], graph: list[Edge], part=lambda name: name) -> str:
    """Each cycle's members and the imports between them (`part`: what a member is of a module)."""
    lines = []
    for component in components:
        inside = set(component)
        lines.append("cycle among " + ", ".join(component) + ":")
        lines += [f"  {e}" for e in graph if part(e.source) in inside and part(e.target) in inside]
    return "\n".join(lines)


def rooms(graph: list[Edge]) -> list[Edge]:
    return [
        Edge(room(e.source), room(e.target), e.line, e.lazy)
        for e in graph
        if room(e.source) != room(e.target)
    ]


def test_no_cycle_among_the_modules_at_import_time():
    graph = [e for e in edges() if not e.lazy]
    assert cycles(graph) == [], explain(cycles(graph), graph)


def test_no_import_inside_a_function_closes_a_cycle():
    graph = edges()
    assert cycles(graph) == [], explain(cycles(graph), graph)


def test_no_cycle_between_the_parts_of_the_package():
    graph = edges()
    found = cycles(rooms(graph))
    assert found == [], explain(found, [e for e in graph if room(e.source) != room(e.target)], room)


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "astraflow"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path):
    """What the checks above would report: `b` imports `a` inside a function, `a` imports `b`."""
    root = package(
        tmp_path,
        {
            "a.py": "from astraflow.b import g\n",
            "b.py": "import torch\n\ndef g():\n    from astraflow import a\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from astraflow.d import x\n",
            "d.py": "from astraflow.c import y\n",
        },
    )
    graph = edges(root)
    assert cycles([e for e in graph if not e.lazy]) == []
    assert cycles(graph) == [["astraflow.a", "astraflow.b"]]  # c -> d is type-only: no cycle
    assert "astraflow.b:4 -> astraflow.a (in a function)" in explain(cycles(graph), graph)


def test_a_cycle_between_parts_and_a_handler_named_in_a_string_are_found(tmp_path):
    root = package(
        tmp_path,
        {
            "cli.py": 'HANDLERS = ["astraflow.ops.top:cmd_top"]\n',
            "ops/__init__.py": "",
            "ops/top.py": "from astraflow.launch import progress\n",
            "launch/__init__.py": "",
            "launch/progress.py": "def f():\n    from astraflow.ops.top import cmd_top\n",
        },
    )
    graph = edges(root)
    assert Edge("astraflow.cli", "astraflow.ops.top", 1, True) in graph
    assert cycles(rooms(graph)) == [["launch", "ops"]]


def test_the_package_is_read_whole():
    graph = edges()
    assert {"astraflow.cli", "astraflow.ops.scale", "astraflow.trainer.distributed"} <= {
        e.source for e in graph
    }
    handlers = {e.target for e in graph if e.source == "astraflow.cli" and e.lazy}
    assert {"astraflow.ops.top", "astraflow.ops.start", "astraflow.ops.scale"} <= handlers
    assert (ROOT / "ops" / "__init__.py").exists()
