"""A run of separately started workers (`astraflow dataflow`, `raas`, `trainer` against one Redis, no
launcher) stops by itself at `run.max_steps`, every worker exiting 0, and `astraflow record` then leaves
the record `astraflow run` would have: `metrics.jsonl`, `summary.json` and `reward.png`."""

import json
import subprocess
import sys

import pytest

from astraflow import redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 3


def test_separately_started_workers_stop_at_max_steps_and_record_leaves_the_report(tmp_path):
    server = redis_server.start(tmp_path / "redis")
    url_file = tmp_path / "url"
    url_file.write_text(server.url)
    common = ["recipes/addition-tiny.yaml", "--run", "apart", "--redis-file", str(url_file)]
    for s in (f"run.max_steps={STEPS}", "run.target_reward=null", f"run.dir={tmp_path / 'run'}"):
        common += ["--set", s]
    procs = {}
    try:
        for role in ("dataflow", "trainer", "raas"):
            log = (tmp_path / f"{role}.log").open("w")
            cmd = [sys.executable, "-m", "astraflow.cli", role, *common]
            procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        for role, p in procs.items():
            rc = p.wait(timeout=420)
            assert rc == 0, (role, (tmp_path / f"{role}.log").read_text()[-3000:])

        out = tmp_path / "record"
        cmd = [sys.executable, "-m", "astraflow.cli", "record", *common, "--dir", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"stopped: {STEPS} steps" in done.stdout, done.stdout
        versions = [json.loads(x)["version"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert versions[:STEPS] == list(range(1, STEPS + 1))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["stopped"] == f"{STEPS} steps" and summary["models"]["policy"]["versions"] >= STEPS
        assert summary["ledger"]["submitted"] > 0
        assert (out / "reward.png").stat().st_size > 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()
