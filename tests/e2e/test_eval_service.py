"""Evaluation as a service in a real run (`astraflow run`, default recipe shortened, on a Redis the test
owns so it can look inside afterwards): eval results for several versions reach `summary.json`, each
scored on the version it names, and no eval group is ever in a batch a trainer got."""

import json
import subprocess
import sys

import pytest
import redis

from astraflow import redis_server
from astraflow.streams import Keys

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
ROWS = 16


def test_eval_versions_are_scored_on_their_version_and_never_trained_on(tmp_path):
    server = redis_server.start(tmp_path / "redis")
    try:
        sets = [
            f"run.dir={tmp_path / 'run'}",
            "engine.type=hf",
            "run.target_reward=null",
            "run.max_steps=6",
            "eval.every=2",
            f"eval.datasets=[{{name: sums, dataset: {{type: task, size: {ROWS}}}, n: {ROWS}}}]",
            "eval.metrics=[pass@1, mean_reward]",
            "streams.trim_interval_ms=1000000000",  # keep the batch streams whole, for the check below
        ]
        cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/addition-tiny.yaml", "--run", "evals"]
        cmd += ["--redis", server.url]
        for s in sets:
            cmd += ["--set", s]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())

        evals = {e["version"]: e for e in summary["evals"]}
        assert {0, 2} <= set(evals), summary["evals"]
        for version in (0, 2):
            e = evals[version]
            assert (e["model"], e["dataset"], e["rows"]) == ("policy", "sums", ROWS), e
            assert 0 <= e["pass@1"] <= e["mean_reward"] <= 1, e
        assert (tmp_path / "run" / "reward.png").stat().st_size > 10_000  # with the eval curve
        ledger = summary["ledger"]
        assert ledger["balanced"], ledger
        assert ledger["eval"] >= 2 * ROWS and ledger["eval_dropped"] == {}, ledger  # all on their version

        client = redis.Redis.from_url(server.url)
        batches = client.xrange(Keys("evals").batches("policy"))
        trained = [uid for _, fields in batches for uid in fields[b"groups"].decode().split()]
        assert len(batches) >= 6 and trained
        assert not [uid for uid in trained if uid.startswith("eval:")]
        client.close()
    finally:
        server.stop()
