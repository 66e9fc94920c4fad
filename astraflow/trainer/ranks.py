"""What every rank of one trainer executes, and how a command reaches them all.

Rank 0 decides each command (`commands`) and runs it on every rank with `Ranks.all`: posted to the
others first, then executed itself, so that the ranks enter the same collectives together. The other
ranks `follow`: they execute rank 0's commands until it says stop. Each kind of command has exactly one
handler here (`Ranks.execute`); a kind without one is refused.
"""

from __future__ import annotations

import functools

import torch

from astraflow.trainer import checkpoint, commands, distributed
from astraflow.trainer.step import PolicyTrainer


class Ranks:
    """The ranks of one trainer, seen from one of them (`rank` of `size`)."""

    def __init__(
        self,
        policy: PolicyTrainer,
        device: torch.device,
        rank: int,
        size: int,
        served_dtype: str,
        collective_timeout_s: float,
    ) -> None:
        self.policy, self.device, self.rank = policy, device, rank
        self._served_dtype = getattr(torch, served_dtype)
        self._collective_timeout_s = collective_timeout_s
        self._leader = commands.Leader() if rank == 0 and size > 1 else None

    @functools.singledispatchmethod
    def execute(self, cmd: commands.Command):
        """Execute `cmd` on this rank; ValueError for a kind with no handler."""
        raise ValueError(f"unknown trainer command {cmd!r}")

    @execute.register(commands.Restore)
    def _restore(self, cmd: commands.Restore) -> None:
        p = self.policy
        distributed.load_full_state(p.model, p.optimizer, cmd.model_state, cmd.optim_state)
        if cmd.sched_state:
            p.scheduler.load_state_dict(cmd.sched_state)
        checkpoint.restore_rng(cmd.rngs, self.rank, self.device)

    @execute.register(commands.Train)
    def _step(self, cmd: commands.Train) -> dict[str, float]:
        return self.policy.step(cmd.batch, cmd.version)

    @execute.register(commands.PublicationState)
    def _publication_state(self, cmd: commands.PublicationState):
        """To publish: live or gathered in the served dtype, awaited before a step."""
        return distributed.publication_state(self.policy.model, self._served_dtype)

    @execute.register(commands.RngState)
    def _rng_state(self, cmd: commands.RngState):
        return distributed.gather(checkpoint.rng_state(self.device))

    @execute.register(commands.FullState)
    def _full_state(self, cmd: commands.FullState):
        """To checkpoint (and publish meanwhile): float32 host copies of the model and optimizer."""
        p = self.policy
        return distributed.full_model_state(p.model), distributed.full_optimizer_state(p.model, p.optimizer)

    def all(self, cmd: commands.Command):
        """Run a command on every rank (rank 0 only; blocking); what this rank's handler returns."""
        if self._leader is not None:
            self._leader.send(cmd)
        return self.execute(cmd)

    def follow(self) -> None:
        """Ranks > 0: execute rank 0's commands until it says stop (RankLostError when rank 0 is gone)."""
        follower = commands.Follower(self._collective_timeout_s)
        while not isinstance(cmd := follower.receive(), commands.Stop):
            self.execute(cmd)

    def stop(self) -> None:
        """Rank 0: tell the other ranks to stop following (nothing to tell when it runs alone)."""
        if self._leader is not None:
            self._leader.send(commands.Stop())
