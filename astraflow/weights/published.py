"""What any process of a run reads of its published weights from Redis: the secret that weight transfers
authenticate with (`run_secret`: configured, else the run's own, made once), and the newest published
version of each model (`newest_published`), recorded by the dataflow or not yet. The publisher
(`weights.publisher`) writes the versions; the RaaS, a restarted trainer and the launcher read them.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass

from astraflow.errors import DecodeError
from astraflow.messages import VersionPublished, decode
from astraflow.streams import Bus
from astraflow.streams.runstate import MAX_VERSION_STEP, recorded_versions
from astraflow.weights.settings import WeightsSettings


async def run_secret(bus: Bus, settings: WeightsSettings) -> bytes:
    """The secret that authenticates weight transfers: configured, else one per run kept in Redis."""
    if settings.secret is not None:
        return settings.secret.get_secret_value().encode()
    key = bus.keys.weights_secret
    found = await bus.call(lambda: bus.redis.get(key))  # a worker ACL user may only read it
    if found is None:
        await bus.call(lambda: bus.redis.set(key, secrets.token_hex(32), nx=True))
        found = await bus.call(lambda: bus.redis.get(key))
    return found


@dataclass(frozen=True)
class Published:
    """A model's newest published version and where its manifest is."""

    version: int
    manifest_key: str
    incarnation: str | None


async def newest_published(bus: Bus, models: Collection[str]) -> dict[str, Published]:
    """The newest published version of each of `models` that has one: as the dataflow recorded it (read
    through `streams.runstate`), or newer and not recorded yet, in `versions` (the dataflow trims the
    entries it has recorded), but no more than MAX_VERSION_STEP past the recorded one (as the dataflow
    records them). The stream is read first, so an entry recorded and trimmed in between is found in the
    state."""
    models = list(models)
    entries = await bus.call(lambda: bus.redis.xrevrange(bus.keys.versions, count=256))
    newest = {
        m: Published(v, bus.keys.weights(m, v), incarnation)
        for m, (v, incarnation) in (await recorded_versions(bus, models)).items()
    }
    ceiling = {m: p.version + MAX_VERSION_STEP for m, p in newest.items()}
    for _, fields in entries:
        try:
            msg = decode(fields, VersionPublished)
        except DecodeError:
            continue
        if msg.version > ceiling.get(msg.model, msg.version):
            continue
        if msg.model in models and (msg.model not in newest or msg.version > newest[msg.model].version):
            newest[msg.model] = Published(msg.version, msg.manifest_key, msg.incarnation)
    return newest
