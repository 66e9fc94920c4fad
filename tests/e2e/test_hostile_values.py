"""The default recipe under hostile values (issue: a NaN, a forged heartbeat or one credential must not
ruin, stall or silently shrink a run). While `astraflow run` trains, this test makes a user reward return
NaN for a share of samples, forges a RaaS heartbeat advertising a huge capacity, creates a consumer group
the run does not know on `rollouts`, and holds 100 silent connections to the trainer's weight port. The
run must still finish its steps with the reward rising, every version's weights finite, the backlog and
`rollouts` bounded, and the ledger balanced with nothing stranded in flight."""

import dataclasses
import json
import math
import socket
import subprocess
import sys

import pytest
import redis
import torch

from astraflow import redis_server
from astraflow.messages import Heartbeat, WeightManifest, decode, encode
from tests.e2e.test_chaos import end_kept_run, steps_done, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 60
RUN = "hostile"


def nan_sometimes(prompt, completion, **sample):
    """The addition reward, but NaN for about one sample in ten (a user's reward with a bug)."""
    from astraflow.workflows.rewards import exact_match

    if hash((prompt, completion, sample.get("seed"))) % 10 == 0:
        return math.nan
    return exact_match(prompt, completion, **sample)


def test_nan_rewards_forged_heartbeats_foreign_groups_and_silent_peers_do_not_ruin_a_run(tmp_path):
    run_dir = tmp_path / "run"
    reward = "tests.e2e.test_hostile_values:nan_sometimes"
    sets = [
        f"run.dir={run_dir}",
        "engine.type=hf",
        "run.target_reward=null",
        f"run.max_steps={STEPS}",
        "eval.every=0",
        f"raas.workflow_options.reward={reward}",
        f"raas.allowed_code=[{reward}]",
    ]
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/addition-tiny.yaml", "--run", RUN]
    cmd += ["--keep-redis", *(x for s in sets for x in ("--set", s))]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server, silent = None, []
    try:
        wait_for(lambda: steps_done(run_dir) >= 3, 240, "the first steps")
        server = redis_server.load(run_dir / "redis")
        r = redis.Redis.from_url(server.url)
        key = f"af:{{{RUN}}}:"
        # A forged heartbeat: a worker name nobody holds, advertising a million slots.
        beat = decode(r.hgetall(next(iter(r.scan_iter(key + "raas:*")))), Heartbeat)
        forged = dataclasses.replace(beat, uid="forged", capacity=1_000_000, in_flight=0)
        r.hset(key + "raas:forged", mapping=encode(forged))
        r.xgroup_create(key + "rollouts", "evil", id="0")
        versions = [k for k in r.scan_iter(key + "weights:policy:*") if k.split(b":")[-1].isdigit()]
        manifest = decode(r.hgetall(max(versions, key=lambda k: int(k.split(b":")[-1]))), WeightManifest)
        host, _, port = manifest.endpoints[0].rpartition(":")
        silent = [socket.create_connection((host, int(port))) for _ in range(100)]
        before = steps_done(run_dir)
        wait_for(lambda: steps_done(run_dir) >= before + 10, 240, "steps while held")
        (group,) = r.xinfo_groups(key + "prompts")  # waiting to be read, and read but not done
        if group.get("lag") is None:  # Redis 6.2 reports no lag: count what the group has not read
            group["lag"] = len(r.xrange(key + "prompts", min=b"(" + group["last-delivered-id"]))
        assert group["lag"] + group["pending"] <= 100, f"a forged heartbeat inflated the backlog: {group}"
        try:
            out, _ = launcher.communicate(timeout=400)
        except subprocess.TimeoutExpired as e:  # say where it stood: the output's tail, the logs' complaints
            tail = (e.output or b"")[-2000:].decode(errors="replace")
            pytest.fail(f"the run did not end: {tail}\n{complaints(run_dir)}")
        assert launcher.returncode == 0, out[-3000:]
        # Trimmed every `streams.trim_interval_ms` (10 s): what arrived since the last trim stays.
        rollouts = r.xlen(key + "rollouts")
    finally:
        for s in silent:
            s.close()
        end_kept_run(launcher, server, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == f"{STEPS} steps" and summary["ledger"]["balanced"], summary
    collected = summary["ledger"]["collected"]  # every rollout entry the run made: untrimmed, all stay
    assert rollouts <= collected / 2, f"a foreign consumer group stopped trimming: {rollouts} of {collected}"
    policy = summary["models"]["policy"]
    assert policy["reward_last_window"] > policy["reward_first_window"], policy
    latest = sorted((run_dir / "checkpoints" / "policy").glob("v*"))[-1]
    weights = torch.load(latest / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights.values())


def complaints(run_dir):
    """The last warnings and errors the run's workers logged."""
    lines = [x for f in sorted((run_dir / "logs").glob("*.log")) for x in f.read_text().splitlines()]
    return "\n".join([x[:300] for x in lines if '"level": "warning"' in x or '"level": "error"' in x][-20:])
