"""`recipes/calculator-tiny.yaml`, shortened: RL raises the share of episodes that call the calculator
(and with it the reward) above the warm start's, and the run reports that rate per step in metrics.jsonl
and summary.json."""

import json

import pytest

from tests.e2e.test_launcher import rewards, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
# A smaller tiny model than the recipe's (its 300-step warm start alone takes about a minute): the same
# tokenizer and warm-start mix, 25% of the demonstrations calling the tool.
SMALL = [
    "run.tiny.hidden=64",
    "run.tiny.intermediate=256",
    "run.tiny.layers=2",
    "run.tiny.warm_start_steps=150",
]


def test_rl_raises_the_tool_call_rate(tmp_path):
    run_dir = tmp_path / "run"
    summary = run(run_dir, "e2e-calc", *SMALL, "run.max_steps=25", recipe="recipes/calculator-tiny.yaml")
    assert summary["stopped"] == "25 steps" and summary["ledger"]["balanced"], summary
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    calls = [s["rollout_tool_call"] for s in steps]
    first, last = sum(calls[:3]) / 3, sum(calls[-5:]) / 5
    assert last >= first + 0.25, f"tool-call rate did not rise: steps 1-3 {first:.2f}, last 5 {last:.2f}"
    r = rewards(run_dir)
    assert sum(r[-5:]) / 5 > sum(r[:3]) / 3, r
    policy = summary["models"]["policy"]
    assert policy["tool_call_last_window"] > policy["tool_call_first_window"]
    assert (run_dir / "reward.png").stat().st_size > 10_000
