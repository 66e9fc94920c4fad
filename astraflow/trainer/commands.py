"""Rank 0's commands to the other ranks of one trainer: decided first, then every rank enters the
collectives.

Rank 0 alone talks to Redis and may wait there for a batch as long as the dataflow takes. The other
ranks (followers) wait for its next command on the job's c10d store (one key per command, `store.wait`
in slices), never inside a collective: a collective waiting past `trainer.collective_timeout_s` raises
(and NCCL's watchdog kills the process). Once a command is posted every rank is about to execute it, so
its payload (a batch; a restored checkpoint's scheduler and RNG states) follows as a broadcast and its
collectives start together. While it is in the job rank 0 bumps a heartbeat counter on the store; a
follower that sees no bump for the timeout (rank 0 died, and the store lives on in torchrun's agent) or
loses the store (it lived in rank 0) raises RankLostError instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist

from astraflow.errors import AstraflowError

if TYPE_CHECKING:
    from astraflow.messages import Batch
    from astraflow.trainer.checkpoint import TrainerState

PREFIX = "astraflow/trainer/"
"""Keys of this module on the job's store: `cmd/<n>` (command n), `cmd/<n>/read` (followers that read
it; the last deletes both), `alive` (rank 0's heartbeat)."""
BEATS_PER_TIMEOUT = 4
"""Heartbeats rank 0 gives per timeout: a follower checks twice per timeout, so it sees at least one."""


class RankLostError(AstraflowError):
    """Rank 0 of a trainer is gone (dead, or stuck past the collective timeout): the follower exits."""


@dataclass(frozen=True)
class Command:
    """What every rank of a trainer executes, rank 0 having decided it; its fields are its payload. Each
    kind has one handler (`ranks.Ranks.execute`)."""

    NAME: ClassVar[str] = ""

    def for_followers(self) -> Command | None:
        """What the other ranks receive of it (None: its name alone)."""
        return self if dataclasses.fields(self) else None


@dataclass(frozen=True)
class Restore(Command):
    # rank 0 -> every rank: a checkpoint to resume from (`checkpoint.load`'s parts)
    NAME: ClassVar[str] = "restore"
    state: TrainerState | None
    model_state: dict[str, Any]
    """Full (unsharded) tensors: rank 0 loads them and sends every rank its shards."""
    optim_state: dict[str, Any]
    sched_state: dict[str, Any]
    rngs: list[dict[str, Any]]

    def for_followers(self) -> Restore:
        """The scheduler and RNG states; the state and tensors stay on rank 0 (it sends the shards)."""
        return dataclasses.replace(self, state=None, model_state={}, optim_state={})


@dataclass(frozen=True)
class Train(Command):
    # rank 0 -> every rank: one step on a batch
    NAME: ClassVar[str] = "train"
    batch: Batch
    version: int
    """The version of the weights trained."""


@dataclass(frozen=True)
class PublicationState(Command):
    # rank 0 -> every rank: the weights to publish, live or gathered in the served dtype
    NAME: ClassVar[str] = "model_state"


@dataclass(frozen=True)
class RngState(Command):
    # rank 0 -> every rank: gather the ranks' RNG states (for a checkpoint)
    NAME: ClassVar[str] = "rng"


@dataclass(frozen=True)
class FullState(Command):
    # rank 0 -> every rank: float32 host copies of the model and optimizer (to checkpoint and publish)
    NAME: ClassVar[str] = "full_state"


@dataclass(frozen=True)
class Stop(Command):
    # rank 0 -> every rank: leave the loop
    NAME: ClassVar[str] = "stop"


COMMANDS: dict[str, type[Command]] = {
    cls.NAME: cls for cls in (Restore, Train, PublicationState, RngState, FullState, Stop)
}


def _store():
    return dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())


def _own_client(store):
    """A client of `store` for another thread: its own connection (`Store.clone`) where torch has it;
    before (torch 2.7), the same one, whose TCPStore client serialises the threads' operations."""
    return store.clone() if hasattr(store, "clone") else store


class RankHeartbeat:
    """Rank 0's sign of life on the job's store, from a thread, from joining the job (`distributed.setup`)
    to leaving it: it beats while rank 0 still connects to Redis, waits for a batch, or executes."""

    def __init__(self, timeout_s: float) -> None:
        self._stopped = threading.Event()
        beat_args = (_own_client(_store()), timeout_s / BEATS_PER_TIMEOUT)
        self._thread = threading.Thread(target=self._loop, args=beat_args, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _loop(self, store, interval_s: float) -> None:
        while not self._stopped.wait(interval_s):
            try:
                store.add("alive", 1)
            except dist.DistError:  # the store is gone (the job is ending): followers find out themselves
                return


class Leader:
    """Rank 0's end: `send` each command before executing it, `stop` last."""

    def __init__(self) -> None:
        self._store, self._next = _store(), 0

    def send(self, cmd: Command) -> None:
        """Post `cmd`'s name to every follower, then broadcast what followers get of it (if more than its
        name: pickled by torch between our own ranks only). Collective once posted."""
        payload = cmd.for_followers()
        self._store.set(f"cmd/{self._next}", f"{cmd.NAME} {int(payload is not None)}")
        self._next += 1
        if payload is not None:
            dist.broadcast_object_list([payload], src=0)


class Follower:
    """A rank > 0's end: `receive` the next command and its payload."""

    def __init__(self, timeout_s: float) -> None:
        self._store, self._next = _store(), 0
        self._timeout_s = timeout_s
        self._others = dist.get_world_size() - 1

    def receive(self) -> Command:
        """Wait (outside any collective) for rank 0's next command; then its payload (a collective).
        Raises RankLostError when rank 0 gives no heartbeat for the timeout or the store is lost."""
        key = f"cmd/{self._next}"
        self._wait(key)
        name, has_payload = self._store.get(key).decode().split()
        if self._store.add(f"{key}/read", 1) == self._others:  # the last reader: nobody needs them now
            self._store.delete_key(key)
            self._store.delete_key(f"{key}/read")
        self._next += 1
        if has_payload != "1":
            return COMMANDS[name]()
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _wait(self, key: str) -> None:
        beats, slice_ = self._beats(), timedelta(seconds=self._timeout_s / 2)
        silent = 0
        while True:
            try:
                self._store.wait([key], slice_)
                return
            except dist.DistStoreError:  # the slice passed: is rank 0 still there?
                pass
            except dist.DistError as e:  # the connection to the store broke
                raise self._lost(f"is gone with the job's store ({e})") from e
            now = self._beats()
            silent = silent + 1 if now == beats else 0
            beats = now
            if silent >= 2:  # a whole timeout without a heartbeat
                raise self._lost(
                    f"gave no sign of life for {self._timeout_s:g} s (trainer.collective_timeout_s)"
                )

    def _beats(self) -> int:
        try:
            return self._store.add("alive", 0)
        except dist.DistError as e:
            raise self._lost(f"is gone with the job's store ({e})") from e

    def _lost(self, why) -> RankLostError:
        """The error to end this rank with; the group is left first (no barrier: nobody would come)."""
        dist.destroy_process_group()
        return RankLostError(f"rank 0 {why} while this rank waited for command {self._next}")
