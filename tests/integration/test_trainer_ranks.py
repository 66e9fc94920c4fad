"""A trainer's ranks (gloo, two processes): the follower waits for rank 0's next command outside any
collective, so rank 0 may wait on Redis for a batch longer than the collective timeout; a dead rank 0
ends the follower with an error that says so instead of leaving it hanging (or killed by NCCL's
watchdog). The ranks run `tests/follow_commands.py`."""

import os
import subprocess
import sys

import pytest

from astraflow.redis_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
torch = pytest.importorskip("torch")
TIMEOUT_S = 2.0
"""`trainer.collective_timeout_s` of the ranks: rank 0 waits three times this before each command."""


def spawn(mode: str, tmp_path, port: int, **env) -> list[subprocess.Popen]:
    (tmp_path / "ready").mkdir()
    cmd = [sys.executable, "-m", "tests.follow_commands", mode, str(TIMEOUT_S)]
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env}
    common["READY_DIR"] = str(tmp_path / "ready")
    return [
        subprocess.Popen(
            cmd,
            env={**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_rank0_waiting_longer_than_the_collective_timeout_fails_nothing(tmp_path):
    leader, follower = (finish(p) for p in spawn("slow", tmp_path, free_port()))
    assert leader[0] == 0, leader[2][-3000:]
    assert follower[0] == 0, follower[2][-3000:]
    assert follower[1].splitlines() == ["received train [1, 2] 3", "received train [3] 3"]


@pytest.mark.parametrize("store_host", ["rank 0", "torchrun agent"])
def test_a_killed_rank0_ends_its_follower_with_the_reason(tmp_path, store_host):
    """The job's store lives in rank 0 (the follower loses it) or in torchrun's agent, which outlives
    rank 0 (the follower misses rank 0's heartbeat for a timeout)."""
    port, env, agent_store = free_port(), {}, None
    if store_host == "torchrun agent":
        agent_store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    leader, follower = spawn("kill", tmp_path, port, **env)
    assert finish(leader)[0] == -9
    code, out, err = finish(follower)
    assert out.splitlines() == ["received train [1, 2] 3"]
    assert code != 0 and "RankLostError: rank 0" in err, err[-3000:]
    del agent_store
