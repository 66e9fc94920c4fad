"""The version barrier: trainers' `versions` in, `notices` to the RaaS pool out.

Recording a published version is atomic with its XACK (version.lua). Announcing is reconciliation, not a
reaction to one entry: any replica, at any time, announces what is due - every model has reached v and v
was not announced yet - with a compare-and-set on the last announced version (announce.lua). So a
replica killed between recording and announcing leaves nothing undone: the next pass announces it.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import structlog

from astraflow.dataflow.store import Store
from astraflow.errors import DecodeError
from astraflow.messages import VersionNotice, VersionPublished, decode, encode
from astraflow.streams import Consumer, Delivery
from astraflow.streams.keys import GROUP_DATAFLOW
from astraflow.streams.runstate import MAX_VERSION_STEP, RunState

if TYPE_CHECKING:
    from astraflow.dataflow.evaluation import Evals

log = structlog.get_logger(__name__)
KEEP_VERSIONS = 64
"""Versions whose manifest keys are remembered (older ones are forgotten as new ones are announced)."""
HOLD_POLL_MS = 50
"""Longest wait for a published version while an eval holds the notices back: its last row may be
collected while no trainer publishes (every batch of the held version gone stale), and each poll is one
state read, so the next notice goes out within this much of the eval's end."""


class Barrier:
    def __init__(
        self, store: Store, name: str, synchronous: bool = False, evals: Evals | None = None
    ) -> None:
        self.store, self.synchronous, self.evals = store, synchronous, evals
        """`synchronous`: every notice synchronous (sync mode): a RaaS loads it before generating anything
        else. `evals`: an announced eval version's groups are submitted, and hold later notices back
        until they are collected (or time out), so every RaaS runs them on exactly that version."""
        self.consumer = Consumer(store.bus, store.keys.versions, GROUP_DATAFLOW, name)
        self.holding = False
        """The last announce stopped at an eval still running."""

    async def step(self, block_ms: int | None) -> int:
        """Record the versions published since the last step, then announce what is due."""
        if self.holding:
            block_ms = min(block_ms or self.store.bus.settings.block_ms, HOLD_POLL_MS)
        entries = await self.consumer.read(64, block_ms)
        for i, entry in enumerate(entries):
            try:
                await self._record(entry)
            except Exception as e:  # the next read takes back this entry and the rest
                await self.consumer.give_back([x.id for x in entries[i:]], e)
                raise
        await self.announce()
        return len(entries)

    async def _record(self, entry: Delivery) -> None:
        try:
            msg = decode(entry.fields, VersionPublished)
            if msg.model not in self.store.models:
                raise DecodeError(f"model: {msg.model!r} is not trained in this run")
        except DecodeError as e:
            log.error("version_dead_lettered", id=entry.id, error=str(e))
            await self.consumer.dead_letter(entry, f"DecodeError: {e}")
            return
        status = await self.store.record_version(self.consumer.name, entry.id, msg)
        if status == "far":
            reason = f"version {msg.version} of {msg.model} is over {MAX_VERSION_STEP} past the recorded one"
            log.error("version_dead_lettered", id=entry.id, error=reason)
            await self.consumer.dead_letter(entry, reason)
            return
        self.consumer.settled([entry.id])
        log.debug("version_recorded", model=msg.model, version=msg.version, status=status)

    async def announce(self) -> int:
        """Announce the versions every model has reached; returns how many notices went out."""
        sent, self.holding = 0, False
        while True:
            state = await self.store.state()
            recorded = [state.version(m) for m in self.store.models]
            versions = [v for v in recorded if v is not None]
            if len(versions) < len(self.store.models):
                return sent  # some model has no version yet
            notice = state.notice
            last, ready, rollback = -1 if notice is None else notice, min(versions), state.rollback
            if ready <= last and not rollback:
                return sent
            if not rollback and self.evals is not None and self.evals.holds(state, last):
                log.debug("notices_held_for_eval", version=last)
                self.holding = True
                return sent
            # Every eval version in between is announced (they are synchronous); other ones only matter
            # as the newest, which a RaaS loads anyway. A rollback goes straight to the older version.
            due = [] if rollback else [v for v in range(last + 1, ready) if state.is_eval(v)]
            version = due[0] if due else ready
            fields, forget = self._notice(state, version), _forget(state, version)
            status, _ = await self.store.announce(last, version, fields, forget)
            if status == "ok":
                sent += 1
                submitted = state.eval_submitted(last) if state.is_eval(last) else None
                held = {} if submitted is None else {"eval_held_s": round(time.time() - submitted, 3)}
                log.info("version_announced", version=version, eval=state.is_eval(version), **held)
                if self.evals is not None and state.is_eval(version):
                    await self.evals.submit(self.store, version)
                if version == ready:  # nothing else was due: the next step reads the state again
                    return sent

    def _notice(self, state: RunState, version: int) -> dict[str, bytes]:
        """The notice of `version`. An eval (or sync-mode) notice loads `version` itself; otherwise each
        model loads its newest version, but none past the next eval version: a trainer ahead of the
        slowest one serves `version` no longer once it has published the next one (a double buffer),
        and an eval version until the barrier has passed it."""
        models = self.store.models
        synchronous = self.synchronous or state.is_eval(version)
        loads = {m: version for m in models}
        if not synchronous:
            evals = [v for v in state.eval_versions() if v > version]
            newest = {m: state.version(m) or 0 for m in models}
            loads = {m: min(v, min(evals)) if evals else v for m, v in newest.items()}
        manifests = {m: state.manifest(m, v) for m, v in loads.items()}
        checkpoints = {m: state.checkpoint(m, v) for m, v in loads.items()}
        notice = VersionNotice(
            uid=f"notice:{version}:{uuid.uuid4().hex[:8]}",
            version=version,
            models=loads,
            manifests={m: k for m, k in manifests.items() if k},
            checkpoints={m: c for m, c in checkpoints.items() if c},
            eval=synchronous,
            incarnations={m: i for m in models if (i := state.incarnation(m)) is not None},
        )
        return encode(notice)


def _forget(state: RunState, version: int) -> list[str]:
    """State fields of versions more than KEEP_VERSIONS older than `version`."""
    return state.versioned_before(version - KEEP_VERSIONS)
