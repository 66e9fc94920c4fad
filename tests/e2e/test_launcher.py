"""`astraflow run` on the default recipe, shortened: every process starts, trains, publishes and stops
at the step target; the run directory holds the report and the ledger balances."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_default_recipe_runs_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "astraflow.cli",
            "run",
            "recipes/addition-tiny.yaml",
            "--run",
            "e2e",
            "--set",
            f"run.dir={run_dir}",
            "--set",
            "engine.type=hf",
            "--set",
            "run.max_steps=30",
            "--set",
            "run.target_reward=null",
            "--set",
            "run.eval_every_s=5",
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == "30 steps"
    assert summary["models"]["policy"]["versions"] >= 30
    assert summary["ledger"]["balanced"], summary["ledger"]
    assert summary["evals"], "no held-out evaluation ran"
    assert (run_dir / "reward.png").stat().st_size > 10_000
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 30 and "rollout_reward" in json.loads(lines[-1])
    for name in ("dataflow", "raas-0", "trainer-policy"):
        assert (run_dir / "logs" / f"{name}.log").exists()
