"""Each service gets only its own sections and a few run facts from the assembly (`launch.build`): no
module of the dataflow, trainer or RaaS packages imports the root settings model, and importing a
service does not load it. And the package's parts stand on floors: a module imports only from its own
floor or those below (`FLOORS`), so the operator's commands (`ops`) may use every service's modules,
and no service, nor the launch machinery, depends on a command."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import astraflow
from tests.import_graph import edges, room

pytestmark = pytest.mark.timeout(60)
ROOT = Path(astraflow.__file__).parent
SERVICES = ("astraflow.dataflow.service", "astraflow.trainer.service", "astraflow.raas.worker")
FLOORS = {
    4: {"cli"},  # the `astraflow` command: parses arguments, names its handlers
    3: {"ops"},  # the operator's commands
    2: {"launch", "settings_doc"},  # assembly and processes: builds services from the settings
    # 1: every other part - config, policies, the services and their libraries (dataflow, raas, trainer,
    #    weights, engines, workflows, tracking, ...)
    0: {
        "streams",
        "messages",
        "packing",
        "decoding",
        "columnar",
        "errors",
        "logs",
        "processes",
        "redis_server",
        "metrics_server",
        "metrics_http",
        "astraflow",
    },
}
"""The floor of each part of the package (`tests.import_graph.room`); parts not named are on floor 1."""


def floor(part: str) -> int:
    return next((n for n, parts in FLOORS.items() if part in parts), 1)


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_no_service_module_imports_the_root_settings():
    offenders = [
        str(path.relative_to(ROOT.parent))
        for package in ("dataflow", "trainer", "raas")
        for path in sorted((ROOT / package).rglob("*.py"))
        if "astraflow.config" in imported(path)
    ]
    assert offenders == []


def test_importing_the_services_does_not_load_the_root_settings():
    code = f"import sys; import {', '.join(SERVICES)}; print('astraflow.config' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_import_goes_to_the_same_floor_or_down():
    upward = [
        f"{e} (floor {floor(room(e.source))} -> {floor(room(e.target))})"
        for e in edges()
        if floor(room(e.target)) > floor(room(e.source))
    ]
    assert upward == []


def test_only_the_command_imports_the_operator_commands():
    users = {e.source for e in edges() if room(e.target) == "ops" and room(e.source) != "ops"}
    assert users == {"astraflow.cli"}


def test_the_library_imports_no_entry_point():
    """`workers/*.py` are thin `python -m` shells over the library; nothing in it imports them."""
    offenders = [
        str(path.relative_to(ROOT.parent))
        for path in sorted(ROOT.rglob("*.py"))
        if any(name == "workers" or name.startswith("workers.") for name in imported(path))
    ]
    assert offenders == []
