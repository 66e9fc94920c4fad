"""Rank 0's commands to a follower while rank 0 waits (as on Redis) past the collective timeout: one rank
of `python -m tests.follow_commands MODE TIMEOUT_S` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by
the test; both ranks join once both are up, READY_DIR), run as a trainer rank is
(`launch.services.run_trainer`: setup, follow or lead, teardown).

`slow`: rank 0 waits three timeouts before each of two commands, then stops; the follower prints each
command with its payload and the sum of an all-reduce both ranks run for it. `kill`: rank 0 sends one
command, then dies by SIGKILL while the follower waits for the next one."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from astraflow.trainer import commands, distributed


def main(mode: str, timeout_s: float) -> None:
    ready = Path(os.environ["READY_DIR"])
    (ready / os.environ["RANK"]).touch()
    while len(list(ready.iterdir())) < 2:  # join together: the short timeout bounds the rendezvous too
        time.sleep(0.01)
    rank, size = distributed.setup(torch.device("cpu"), timeout_s)
    assert size == 2
    try:
        if rank > 0:
            follower = commands.Follower(timeout_s)
            while not isinstance(cmd := follower.receive(), commands.Stop):
                print("received", cmd.NAME, cmd.batch, execute(), flush=True)
            return
        leader = commands.Leader()
        for payload in ([1, 2], [3]):
            time.sleep(3 * timeout_s)  # rank 0 waits for a batch, the follower must not be in a collective
            leader.send(commands.Train(payload, 0))  # type: ignore[arg-type]  # (a list for a Batch)
            execute()
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        leader.send(commands.Stop())
    finally:
        distributed.teardown()


def execute() -> int:
    """A command's collective: every rank adds its rank + 1."""
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return int(t.item())


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
