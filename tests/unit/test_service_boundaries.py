"""Each service gets only its own sections and a few run facts from the assembly (`launch.build`): no
module of the dataflow, trainer or RaaS packages imports the root settings model, and importing a
service does not load it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import astraflow

pytestmark = pytest.mark.timeout(60)
ROOT = Path(astraflow.__file__).parent
SERVICES = ("astraflow.dataflow.service", "astraflow.trainer.service", "astraflow.raas.worker")


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
