"""`recipes/calculator-tiny.yaml`, shortened: RL raises the share of episodes that call the calculator
(and with it the reward) above the warm start's, and the run reports that rate per step in metrics.jsonl
and summary.json."""

import json

import pytest

from tests.e2e.test_launcher import rewards, run

# The recipe's own tiny model: built and warm-started once per checkout (runs/.cache, shared with
# `astraflow run recipes/calculator-tiny.yaml`; 2.5-5.5 minutes on the shared 2-core machine), then 20
# steps (43 s). A smaller model or a shorter warm start copies the expression too badly for RL to start
# (150 steps of the same model: 5% reward at the start against 16%; a 2-layer 64-wide one: no group with
# any reward at all).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_rl_raises_the_tool_call_rate(tmp_path):
    run_dir = tmp_path / "run"
    summary = run(run_dir, "e2e-calc", "run.max_steps=20", recipe="recipes/calculator-tiny.yaml")
    assert summary["stopped"] == "20 steps" and summary["ledger"]["balanced"], summary
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # (A step trained on groups counted before the previous step has no rollouts of its own to report.)
    calls = [s["rollout_tool_call"] for s in steps if "rollout_tool_call" in s]
    assert len(calls) >= len(steps) - 3, steps
    first, last = sum(calls[:3]) / 3, sum(calls[-5:]) / 5
    # In the calibration run (README) steps 1-3 called the tool 17-25% of the time, steps 16-20 over 80%.
    assert last >= first + 0.25, f"tool-call rate did not rise: steps 1-3 {first:.2f}, last 5 {last:.2f}"
    r = rewards(run_dir)
    assert sum(r[-5:]) / 5 >= sum(r[:3]) / 3 + 0.15, r
    policy = summary["models"]["policy"]
    assert policy["tool_call_last_window"] > policy["tool_call_first_window"]
    assert (run_dir / "reward.png").stat().st_size > 10_000
