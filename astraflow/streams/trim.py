"""Trimming, the housekeeping that keeps a run's streams short: called every `streams.trim_interval_ms` by
a `Runner` (its input stream and `dead`), the trainer's batch reader and the dataflow (beside `repair`
and `reap`).

A grouped stream keeps what the run's own consumer group has not acknowledged (`Keys.group_of`: a group
created by anyone else cannot hold trimming back); a capped stream keeps its newest
`streams.capped_maxlen` entries.
"""

from __future__ import annotations

from astraflow.streams.bus import Bus
from astraflow.streams.keys import CONSUMER_FORGET_MS
from astraflow.streams.scripts import TRIM


async def trim(bus: Bus, stream: str) -> int:
    """Drop entries the run's group has acknowledged (grouped streams: other groups are not waited for,
    see `Keys.group_of`) or old ones (capped streams); forget consumers of the run's group that hold
    nothing and were not seen for CONSUMER_FORGET_MS. Returns how many entries were dropped."""
    if stream in bus.keys.capped_streams():
        maxlen = bus.settings.capped_maxlen
        return await bus.call(lambda: bus.redis.xtrim(stream, maxlen=maxlen, approximate=True))
    group = bus.keys.group_of(stream)
    if group is None:
        raise ValueError(f"{stream} is not a stream of run {bus.keys.run!r} that can be trimmed")
    return int(await bus.run_script(TRIM, stream=stream, forget_idle_ms=CONSUMER_FORGET_MS, run_group=group))
