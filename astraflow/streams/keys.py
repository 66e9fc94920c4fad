"""Every Redis key name of a run, every consumer group, and the bus's default durations.

All keys of run R share the prefix ``af:{R}:``; the braces are a Redis Cluster hash tag, so every key of
a run lives in one slot and one Lua script may touch any of them.
"""

from __future__ import annotations

import inspect
import re

# Default durations (milliseconds). Settings fields take their defaults from here.
LEASE_MS = 30_000
"""An entry idle longer than this (its owner stopped renewing) may be reclaimed by another consumer."""
BLOCK_MS = 2_000
"""How long one XREADGROUP waits for new entries."""
CONSUMER_FORGET_MS = 3600 * 1000
"""A consumer holding nothing and unseen this long is removed from its group when its stream is trimmed."""
DEDUP_TTL_MS = 24 * 3600 * 1000
"""Longest an idempotency key remembers that its entry was published; it lives the lease budget of its
group (`Bus.dedup_ttl_ms`), at most this."""
STRAY_GRACE_MS = 30_000
"""How long past the lease a prompt group may stay in flight with no prompt or rollout entry behind it
(stranded) before the dataflow dead-letters it; the ledger is not balanced while one is stranded."""

# Consumer groups, by the stream they read.
GROUP_RAAS = "raas"
GROUP_DATAFLOW = "dataflow"
GROUP_TRAINER = "trainer"


def run_prefix(run: str) -> str:
    return f"af:{{{run}}}:"


class Keys:
    """Key names of one run."""

    def __init__(self, run: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", run):
            raise ValueError(f"invalid run name: {run!r} (letters, digits, '.', '_' and '-' only)")
        self.run = run
        self.prefix = run_prefix(run)

    def _k(self, name: str) -> str:
        return self.prefix + name

    @property
    def identity(self) -> str:
        """Hash `run`: the run's identity - `nonce`, `created` (unix s) - written when the run is
        bootstrapped (see `streams.identity`)."""
        return self._k("run")

    @property
    def stop(self) -> str:
        """Hash `run:stop`: the run's stop notice - `stopped` (unix s, once the run was ended), `stop_reason`,
        `stopped_by` - apart from the identity, which no worker may write, so that the workers that judge
        the run's stop conditions may."""
        return self._k("run:stop")

    @property
    def prompts(self) -> str:
        return self._k("prompts")

    @property
    def rollouts(self) -> str:
        return self._k("rollouts")

    @property
    def versions(self) -> str:
        return self._k("versions")

    @property
    def notices(self) -> str:
        return self._k("notices")

    @property
    def dead(self) -> str:
        return self._k("dead")

    @property
    def metrics(self) -> str:
        return self._k("metrics")

    @property
    def ledger(self) -> str:
        return self._k("ledger")

    @property
    def errors(self) -> str:
        """Hash: ``<stream>|<id>`` -> last processing error of an entry that was released for retry."""
        return self._k("errors")

    @property
    def in_flight(self) -> str:
        """Set: uids of prompt groups submitted and not yet collected or dead-lettered."""
        return self._k("in_flight")

    @property
    def state(self) -> str:
        """Hash: the dataflow's small shared state (feeder cursor, trainer versions, last notice, ...)."""
        return self._k("state")

    @property
    def completed(self) -> str:
        """Hash: rollout groups the dataflow collected from each RaaS (`<worker>`) and when it first
        counted one (`<worker>:since`): the measure of a worker's capacity (`dataflow.completions`)."""
        return self._k("completed")

    @property
    def scale(self) -> str:
        """Hash: the RaaS workers the run needs and its inputs (`needed`, `workers`, `demand_groups_per_s`,
        `per_worker_groups_per_s`, `headroom`, `reason`, `updated_at`), written by `astraflow scale`."""
        return self._k("scale")

    def curator(self, name: str) -> str:
        """Hash of per-prompt curator state (`ewma`, `streak`) or the GRESO probabilities (`greso`)."""
        return self._k(f"curator:{name}")

    def ready(self, model: str) -> str:
        """Sorted set of accepted groups waiting for a batch; member `uid min_version n_samples ref`."""
        return self._k(f"ready:{model}")

    def replay(self, model: str) -> str:
        """Sorted set of recently trained groups (score: order trained), same members as `ready`."""
        return self._k(f"replay:{model}")

    def samples(self, model: str) -> str:
        """Hash: ref (the id of the rollout entry a group came from) -> its packed SampleGroup, while the
        ready set, the replay set or an unacknowledged batch holds it."""
        return self._k(f"samples:{model}")

    def refs(self, model: str) -> str:
        """Hash: ref -> how many holders (ready set, replay set, unacknowledged batches) it has."""
        return self._k(f"refs:{model}")

    def formed(self, model: str) -> str:
        """Sorted set (by id): batch entries of `model` not yet acknowledged by its trainer, with refs."""
        return self._k(f"formed:{model}")

    def trace(self, uid: str) -> str:
        """Hash with a TTL: the lineage of one prompt group."""
        return self.trace_prefix + uid

    @property
    def trace_prefix(self) -> str:
        """What every trace key starts with (the scripts that write traces are given it)."""
        return self._k("trace:")

    @property
    def traces(self) -> str:
        """Sorted set (score: dataset position): uids whose trace is kept, for `trace_max_groups`."""
        return self._k("traces")

    def batches(self, model: str) -> str:
        return self._k(f"batches:{model}")

    def weights(self, model: str, version: int) -> str:
        return self._k(f"weights:{model}:{version}")

    def weights_shared(self, model: str, version: int) -> str:
        """String: where engines on the trainer's host map that version (`weights.share.SharedVersion`)."""
        return self._k(f"weights:{model}:{version}:shared")

    def weight_peers(self, model: str, version: int) -> str:
        """Sorted set (score: when it joined): `region|endpoint` of processes serving that version."""
        return self._k(f"weights:{model}:{version}:peers")

    def weight_relay(self, model: str, version: int, incarnation: str, region: str, what: str) -> str:
        """String with a TTL: endpoint of the one process of `region` that pulls `what` (full or delta) of
        that version, as that trainer incarnation published it, over the long link and relays it to the
        region (`weights/lua/elect.lua`)."""
        return self._k(f"weights:{model}:{version}:relay:{incarnation}:{region}:{what}")

    @property
    def weights_secret(self) -> str:
        """String: the run's secret for weight transfers (when `weights.secret` is not set)."""
        return self._k("weights:secret")

    @property
    def workflows(self) -> str:
        """Hash: workflow name -> a pushed workflow (`astraflow workflow push`), signed for this run."""
        return self._k("workflows")

    def consumer_name(self, name: str) -> str:
        """String with a TTL: `host pid token` of the live process running under consumer name `name`."""
        return self._k(f"name:{name}")

    def raas(self, worker_id: str) -> str:
        return self._k(f"raas:{worker_id}")

    def dedup(self, key: str) -> str:
        """String: idempotency key of a published entry -> the entry id it got."""
        return self._k(f"dedup:{key}")

    def grouped_streams(self, models: list[str]) -> dict[str, str]:
        """Stream -> the consumer group that reads it, for a run training `models`."""
        streams = [self.prompts, self.rollouts, self.versions, *(self.batches(m) for m in models)]
        return {s: group for s in streams if (group := self.group_of(s))}

    def group_of(self, stream: str) -> str | None:
        """The one consumer group of the run that reads `stream` (None: not a grouped stream of the run).

        The run's groups are part of its data model, not something Redis tells: trimming waits only for
        these, and any other group on a run's stream (an operator's `XGROUP CREATE`, a stray worker) is
        unknown - reported by `astraflow inspect`, removed by `astraflow clear --unknown-groups`."""
        if stream.startswith(self._k("batches:")):
            return GROUP_TRAINER
        return {self.prompts: GROUP_RAAS, self.rollouts: GROUP_DATAFLOW, self.versions: GROUP_DATAFLOW}.get(
            stream
        )

    def tracked_streams(self) -> list[str]:
        """Streams whose entries each carry one in-flight prompt group (header `uid`)."""
        return [self.prompts, self.rollouts]

    def reaped_streams(self) -> list[str]:
        """Streams whose consumers never dead-letter (the RaaS's user may write neither `dead`, the ledger
        nor the in-flight set): an entry delivered max_deliveries times stays pending until the dataflow
        dead-letters it (`streams.reap`)."""
        return [self.prompts]

    def capped_streams(self) -> list[str]:
        """Streams without a consumer group, trimmed by length (readers use plain XREAD)."""
        return [self.notices, self.dead, self.metrics]

    def family(self, name: str, each: str = "*") -> str:
        """The names of key family `name` (a key or key-building method of this class) without the run
        prefix, `each` for every argument, or `<argument name>` when `each` is None: `ready:*`,
        `ready:<model>` (the ACL's key patterns, the data model's table)."""
        attr = getattr(self, name)
        if not callable(attr):
            return self.short(attr)
        params = inspect.signature(attr).parameters
        return self.short(attr(*(f"<{p}>" if each is None else each for p in params)))

    def short(self, key: str) -> str:
        """`key` without the run prefix, for display."""
        return key.removeprefix(self.prefix)
