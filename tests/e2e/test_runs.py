"""Two runs one after the other on one shared Redis: the second, a fresh run of the same name, is
refused (it would have started with the first one's trainer version and dropped every rollout as stale)
with a message saying how to resume or clear; so is a worker command joining the stopped run; after
`astraflow clear` the fresh run starts from version 0 and trains."""

import json
import subprocess
import sys

import pytest

from astraflow import redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 6


def astraflow(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "astraflow.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def train(run_dir, url: str) -> subprocess.CompletedProcess:
    sets = [f"run.dir={run_dir}", "engine.type=hf", "run.target_reward=null", f"run.max_steps={STEPS}"]
    args = ["run", "recipes/addition-tiny.yaml", "--run", "shared", "--redis", url]
    for s in sets:
        args += ["--set", s]
    return astraflow(*args)


def test_a_second_fresh_run_on_a_used_redis_is_refused_until_cleared(tmp_path):
    server = redis_server.start(tmp_path / "redis")
    try:
        first = train(tmp_path / "first", server.url)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

        second = train(tmp_path / "second", server.url)
        assert second.returncode == 1, second.stdout[-3000:]
        assert "run 'shared' already exists" in second.stderr, second.stderr
        assert "--resume" in second.stderr and "astraflow clear --run shared" in second.stderr
        assert not (tmp_path / "second" / "summary.json").exists()

        joining = astraflow("dataflow", "--run", "shared", "--redis", server.url)  # the run was stopped
        assert joining.returncode == 1 and "stopped" in joining.stderr, joining.stderr

        cleared = astraflow("clear", "--run", "shared", "--redis", server.url, "--yes")
        assert cleared.returncode == 0 and "deleted" in cleared.stdout, cleared.stderr

        third = train(tmp_path / "second", server.url)
        assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
        summary = json.loads((tmp_path / "second" / "summary.json").read_text())
        assert summary["stopped"] == f"{STEPS} steps", summary
        metrics = (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["version"] for x in metrics][:STEPS] == list(range(1, STEPS + 1))
    finally:
        server.stop()
