"""`astraflow peek` against a real Redis: an entry of a run decoded to JSON, from the command line."""

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from astraflow.messages import RolloutGroup, Trajectory, encode

pytestmark = pytest.mark.integration


def peek(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "astraflow.cli", "peek", *args], capture_output=True, text=True, timeout=60
    )


async def test_peek_prints_the_newest_rollout_as_json(bus, redis_url):
    traj = Trajectory(
        model="policy",
        token_ids=np.arange(4, dtype=np.int32),
        logprobs=np.zeros(4, np.float32),
        loss_mask=np.array([0, 0, 1, 1], np.uint8),
        versions=np.array([-1, -1, 3, 3], np.int32),
        reward=1.0,
    )
    for uid in ("g1", "g2"):
        group = RolloutGroup(uid=uid, raas="raas-0", version=3, trajectories=[traj])
        await bus.redis.xadd(bus.keys.rollouts, encode(group))
    done = await asyncio.to_thread(peek, ["rollouts", "--redis", redis_url, "--run", "it"])
    assert done.returncode == 0, done.stderr
    entry = json.loads(done.stdout)
    assert entry["message"]["uid"] == "g2" and entry["message"]["trajectories"][0]["versions"] == [
        -1,
        -1,
        3,
        3,
    ]
    missing = await asyncio.to_thread(peek, ["nothing", "--redis", redis_url, "--run", "it"])
    assert missing.returncode == 1 and "'nothing' is not a stream or hash of run 'it'" in missing.stdout
