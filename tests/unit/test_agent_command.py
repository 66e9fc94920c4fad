"""The `agent` workflow's external command form: the example agent run as `python -m ...`, told the
endpoint and its key through its environment, the sample on stdin, its reward printed last."""

import sys
from pathlib import Path

import pytest

from astraflow.workflows import isolation
from tests.unit.test_agent_endpoint import CALL, assert_calculator_episode, flow, served, tokenizer  # noqa: F401 (fixtures)

pytest.importorskip("openai")

SAMPLE = {"prompt": "12*34=", "answer": "408"}
# Calls the endpoint with the standard library only, then prints whether the worker's secrets reached it.
PROBE = (
    "import json, os, sys, urllib.request; sys.stdin.read(); "
    "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/completions', "
    "json.dumps({'model': 'policy', 'prompt': '1'}).encode(), "
    "{'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'}); "
    "urllib.request.urlopen(req).read(); "
    "print(float(not any(k.startswith('ASTRAFLOW_') for k in os.environ)))"
)


async def test_the_calculator_agent_runs_as_a_command(served, tokenizer):  # noqa: F811
    endpoint, engine = served
    engine.replies = [CALL, "408"]
    f = flow(endpoint, tokenizer, command="python -m astraflow.workflows.calculator_agent", timeout_s=60)
    [traj] = (await f.run_episode({"policy": engine}, dict(SAMPLE))).trajectories
    assert_calculator_episode(traj, engine, tokenizer)


async def test_a_command_sees_no_secret_of_the_worker(served, tokenizer, monkeypatch):  # noqa: F811
    endpoint, engine = served
    engine.replies = ["1"]
    monkeypatch.setenv("ASTRAFLOW_RAAS__PUSH_KEY", "secret")
    f = flow(endpoint, tokenizer, command=[sys.executable, "-c", PROBE], timeout_s=30)
    [traj] = (await f.run_episode({"policy": engine}, dict(SAMPLE))).trajectories
    assert traj.error is None and traj.reward == 1.0


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        ("python -c 'import sys; sys.exit(3)'", "exited with 3"),
        ("python -c 'print(1.0)'", "made no call"),
        ("python -c 'import time; time.sleep(30)'", "timeout_s"),
    ],
)
async def test_a_failing_command_is_a_scored_failure(served, tokenizer, command, reason):  # noqa: F811
    endpoint, _ = served
    f = flow(endpoint, tokenizer, command=command, timeout_s=2)
    [traj] = (await f.run_episode({"policy": endpoint.engines["policy"]}, dict(SAMPLE))).trajectories
    assert reason in traj.error and traj.reward == 0.0


REPO = str(Path(__file__).resolve().parents[2])
# In the sandbox: one call through the relay, then whether the endpoint's own port on the host is out of
# reach (its network namespace has nothing but loopback).
CONFINED = (
    "import json, os, socket, sys, urllib.request; sys.stdin.read(); "
    "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/completions', "
    "json.dumps({'model': 'policy', 'prompt': '1'}).encode(), "
    "{'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'}); "
    "urllib.request.urlopen(req).read(); "
    "s = socket.socket(); s.settimeout(2); "
    "print(float(s.connect_ex(('127.0.0.1', int(os.environ['HOST_PORT']))) != 0))"
)


@pytest.mark.slow
@pytest.mark.skipif(isolation.available() is not None, reason="no namespaces for the tool sandbox here")
async def test_a_sandboxed_command_reaches_the_endpoint_and_nothing_else(served, tokenizer):  # noqa: F811
    endpoint, engine = served
    engine.replies = [CALL, "408", "1"]
    f = flow(
        endpoint,
        tokenizer,
        command="python -m astraflow.workflows.calculator_agent",
        sandbox=True,
        sandbox_dirs=[REPO],
        command_env={"PYTHONPATH": REPO},
        timeout_s=60,
    )
    [traj] = (await f.run_episode({"policy": engine}, dict(SAMPLE))).trajectories
    assert_calculator_episode(traj, engine, tokenizer)
    env = {"HOST_PORT": str(endpoint.port)}
    f = flow(
        endpoint, tokenizer, command=["python", "-c", CONFINED], sandbox=True, command_env=env, timeout_s=30
    )
    [traj] = (await f.run_episode({"policy": engine}, dict(SAMPLE))).trajectories
    assert traj.error is None and traj.reward == 1.0
