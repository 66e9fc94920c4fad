"""`recipes/calculator-agent.yaml`, shortened: an ordinary OpenAI-API agent (the official `openai`
client, `astraflow.workflows.calculator_agent`) trained through the RaaS's OpenAI-compatible endpoint;
RL raises its tool-call rate and its reward."""

import json

import pytest

from tests.e2e.test_launcher import rewards, run

# The recipe's tiny model is built and warm-started once per checkout (runs/.cache, shared with
# `astraflow run recipes/calculator-agent.yaml`): several minutes on the shared 2-core machine.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 20


def test_rl_through_the_endpoint_raises_the_tool_call_rate_and_the_reward(tmp_path):
    run_dir = tmp_path / "run"
    summary = run(run_dir, "e2e-agent", f"run.max_steps={STEPS}", recipe="recipes/calculator-agent.yaml")
    assert summary["stopped"] == f"{STEPS} steps" and summary["ledger"]["balanced"], summary
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    calls = [s["rollout_tool_call"] for s in steps if "rollout_tool_call" in s]
    assert len(calls) >= len(steps) - 3, steps
    first, last = sum(calls[:3]) / 3, sum(calls[-5:]) / 5
    assert last >= first + 0.25, f"tool-call rate did not rise: steps 1-3 {first:.2f}, last 5 {last:.2f}"
    r = rewards(run_dir)
    assert sum(r[-5:]) / 5 >= sum(r[:3]) / 3 + 0.2, r
