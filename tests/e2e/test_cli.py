"""The `astraflow` command end to end: embedded Redis lifecycle, the bus demo, inspect on a live run."""

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.e2e
ASTRAFLOW = [sys.executable, "-m", "astraflow.cli"]


def astraflow(*args, check=True, **kw):
    return subprocess.run([*ASTRAFLOW, *args], capture_output=True, text=True, check=check, timeout=120, **kw)


def test_embedded_redis_start_status_stop(tmp_path):
    where = ["--set", f"run.dir={tmp_path}", "--run", "life"]
    assert astraflow("redis", "status", *where, check=False).returncode == 3
    started = astraflow("redis", "start", *where)
    assert "started redis://127.0.0.1:" in started.stdout
    secret_file = tmp_path / "redis" / "redis.json"
    assert oct(secret_file.stat().st_mode & 0o777) == "0o600"
    assert astraflow("redis", "status", *where).returncode == 0
    assert "dead letters: 0" in astraflow("inspect", *where).stdout
    assert "stopped pid" in astraflow("redis", "stop", *where).stdout
    assert astraflow("redis", "status", *where, check=False).returncode == 3
    assert (tmp_path / "redis" / "appendonlydir").exists() or (tmp_path / "redis" / "appendonly.aof").exists()


@pytest.mark.slow
def test_demo_runs_and_inspect_shows_its_live_streams(tmp_path):
    args = [
        "run",
        "recipes/bus-demo.yaml",
        "--set",
        f"run.dir={tmp_path}",
        "--run",
        "live",
        "--set",
        "demo.groups=120",
        "--set",
        "demo.episode_ms=250",
        "--set",
        "demo.workers=2",
        "--set",
        "streams.lease_ms=1000",
    ]
    demo = subprocess.Popen(
        [*ASTRAFLOW, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        seen_live = None
        deadline = time.monotonic() + 60
        while seen_live is None and time.monotonic() < deadline and demo.poll() is None:
            view = astraflow("inspect", "--set", f"run.dir={tmp_path}", "--run", "live", check=False).stdout
            streams = view.split("\n\n")[0]  # the streams table (memory by key family follows)
            rows = {line.split()[0]: line.split() for line in streams.splitlines()[1:] if line.strip()}
            if "prompts" in rows and int(rows["prompts"][4]) > 0 and int(rows["prompts"][3]) >= 1:
                seen_live = view
            time.sleep(0.3)
        out, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert seen_live is not None, "inspect never showed the live run's pending prompts"
    assert "rollouts" in seen_live and "dead letters: 0" in seen_live
    assert demo.returncode == 0, out
    assert "done: 120/120 groups" in out and "duplicates 0" in out
    assert "kill -9 raas-0" in out
    # started by the supervisor, as `astraflow run` starts its workers: recorded, logging in the run dir
    assert set(json.loads((tmp_path / "pids.json").read_text())) == {"raas-0", "raas-1"}
    assert (tmp_path / "logs" / "raas-1.log").exists()
