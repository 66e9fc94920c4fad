"""Streams whose ids were pushed past the present, repaired by the role that consumes them.

Whoever may XADD to a stream may give an entry an id of its choosing (a function writes with its caller's
rights, so the grants cannot refuse it: docs/security.md). One with the largest id exhausts the stream:
every later hand-off into it fails, and is waited out (`connection.EXHAUSTED`). The dataflow, which
consumes `rollouts` and `versions` and keeps `dead`, repairs them every trim interval (`repair.lua`): the
entries past `HORIZON_MS` ahead of Redis's clock are deleted, the stream's last id and its group's last
delivered id are set back, and the waiting hand-offs go through.
"""

from __future__ import annotations

import structlog

from astraflow.streams.bus import Bus
from astraflow.streams.connection import register_scripts
from astraflow.streams.scripts import REPAIR

log = structlog.get_logger(__name__)
HORIZON_MS = 3_600_000
"""How far past Redis's clock an id may lie before it is taken for forged (`*` ids never do: they come
from that clock, and a clock set back by less than this is still served)."""


async def repair(bus: Bus, stream: str) -> int:
    """Repair `stream` if its last id lies past the horizon; returns the entries deleted (0 when there was
    nothing to repair)."""
    script = register_scripts(bus.redis, names=(REPAIR.name,))[REPAIR.name]
    keys, args = REPAIR.call(stream=stream, group=bus.keys.group_of(stream) or "", horizon_ms=HORIZON_MS)
    deleted = int(await bus.call(lambda: script(keys=keys, args=args)))
    if deleted >= 0:
        log.warning("stream_repaired", stream=bus.keys.short(stream), deleted=deleted)
    return max(deleted, 0)
