"""The trainer package's modules import each other in one direction: no cycle, not even through an
import inside a function (which hides it until that function runs)."""

from pathlib import Path

import astraflow
from tests.unit.test_service_boundaries import imported

PACKAGE = Path(astraflow.__file__).parent / "trainer"


def imports(path: Path) -> set[str]:
    """The trainer modules `path` imports, anywhere in it."""
    prefix = "astraflow.trainer."
    modules = {n.removeprefix(prefix).split(".")[0] for n in imported(path) if n.startswith(prefix)}
    return modules - {path.stem}


def test_no_trainer_module_imports_one_that_imports_it_back():
    graph = {p.stem: imports(p) for p in PACKAGE.glob("*.py")}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    assert sorted(m for m in graph if reaches(m, m, set())) == []
