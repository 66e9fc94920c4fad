"""The benchmark scripts. Each runs as `python tests/bench/NAME.py` and imports its siblings by their bare
names (`from _smoke import parse`); imported as `tests.bench.NAME` (by the GPU checks and the tests), this
directory goes on `sys.path` so that those imports find the same modules."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)
