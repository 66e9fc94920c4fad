"""`make test` on a machine without a system redis-server (the README's quick start assumes none): the
tests that need Redis 7 are skipped with one line naming what to install, none fails for the missing
binary; with `CI` set (CI installs it) the missing binary fails them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis7 import INSTALL, NO_REDIS7

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
NEEDS_REDIS7 = ["tests/integration/test_acl.py", "tests/integration/test_tls.py"]


def path_without_redis(tmp_path: Path) -> str:
    """A PATH with every program of this one but `redis-*` (links in one directory)."""
    farm = tmp_path / "bin"
    farm.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not Path(d).is_dir():
            continue
        for exe in Path(d).iterdir():
            if not exe.name.startswith("redis-") and not (farm / exe.name).exists():
                (farm / exe.name).symlink_to(exe)
    return str(farm)


def pytest_run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = path_without_redis(tmp_path)
    if ci:
        env["CI"] = "1"
    cmd = [sys.executable, "-m", "pytest", *NEEDS_REDIS7, "-p", "no:cacheprovider", "-q"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_without_redis_server_the_tests_skip_with_one_line_naming_what_to_install(tmp_path):
    done = pytest_run(tmp_path, ci=False)
    assert done.returncode == 0, done.stdout[-3000:]
    lines = [x for x in done.stdout.splitlines() if NO_REDIS7 in x]
    assert len(lines) == 1 and lines[0].endswith(f"tests skipped: {NO_REDIS7} ({INSTALL})"), lines
    assert "SKIPPED" not in done.stdout  # not one line each
    assert "failed" not in done.stdout.splitlines()[-1]


def test_in_ci_a_missing_redis_server_fails(tmp_path):
    done = pytest_run(tmp_path, ci=True)
    assert done.returncode == 1 and "no redis-server 7 on PATH in CI" in done.stdout, done.stdout[-3000:]
