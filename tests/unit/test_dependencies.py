"""Every runtime dependency `pyproject.toml` declares is imported somewhere in `astraflow/`: a declared
dependency nothing uses is weight every installation carries for nothing."""

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def normalise(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def declared() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {normalise(re.match(r"[A-Za-z0-9._-]+", d).group()) for d in deps}


def imported_modules() -> set[str]:
    """Top-level names of every absolute import in the package, lazy ones inside functions included."""
    found = set()
    for path in (ROOT / "astraflow").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.partition(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
    return found


def test_every_declared_runtime_dependency_is_imported_by_the_package():
    # import name -> distributions, from the installed metadata (yaml -> PyYAML, zmq -> pyzmq, ...)
    dists = importlib.metadata.packages_distributions()
    used = {normalise(d) for m in imported_modules() for d in dists.get(m, [m])}
    unused = sorted(declared() - used)
    assert not unused, f"declared in pyproject.toml but never imported in astraflow/: {unused}"
