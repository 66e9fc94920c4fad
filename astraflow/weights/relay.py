"""The regional relay: per region, version and kind of bytes (full or delta), one receiver pulls over the
long link and the others of the region pull from it while it is still receiving.

Election is a key `weights:<model>:<v>:relay:<incarnation>:<region>:<what>` set NX with a TTL
(`lua/elect.lua`): the first receiver of the region to ask becomes the relay; the others are told its
endpoint. A receiver that finds the relay dead (refused, reset) or stalled (silent past `io_timeout_s`)
unseats it in the same script and asks again, so one of the survivors takes over; the TTL clears a relay
nobody asked about.
A delta in relay is spooled to an unlinked file so the weight server can `sendfile` what has arrived.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from pathlib import Path

from astraflow.messages import WeightManifest
from astraflow.streams import Bus
from astraflow.streams.connection import register_scripts
from astraflow.weights.buffer import reserve
from astraflow.weights.scripts import ELECT, RESIGN
from astraflow.weights.transport import Source


class Election:
    """Elects, per version and kind, the relay of `region` for `model` among the processes that ask."""

    def __init__(self, bus: Bus, model: str, region: str, endpoint: str, ttl_s: int) -> None:
        self.bus, self.model, self.region, self.endpoint, self.ttl_ms = (
            bus,
            model,
            region,
            endpoint,
            ttl_s * 1000,
        )
        scripts = register_scripts(bus.redis, "astraflow.weights", (ELECT.name, RESIGN.name))
        self._script, self._resign = scripts[ELECT.name], scripts[RESIGN.name]
        self.won: set[str] = set()
        """Relay keys this process was elected to (`resign` gives them up)."""

    async def elect(self, manifest: WeightManifest, what: str, failed: str = "") -> str:
        """The endpoint of the relay of the manifest's version (this process's when it won), after
        unseating `failed` if it still holds the seat. A republished version (another trainer
        incarnation, other bytes) has a seat of its own."""
        key = self.bus.keys.weight_relay(
            self.model, manifest.version, manifest.incarnation, self.region, what
        )
        keys, args = ELECT.call(relay=key, endpoint=self.endpoint, ttl_ms=self.ttl_ms, failed=failed)
        got = await self.bus.call(lambda: self._script(keys=keys, args=args))
        got = got.decode() if isinstance(got, bytes) else got
        if got == self.endpoint:
            self.won.add(key)
        return got

    async def resign(self) -> int:
        """Give up every seat this process still holds (a stopping RaaS: pullers would otherwise try it,
        fail, and unseat it one by one); one try, no reconnects. Returns how many it held."""
        seats, self.won = sorted(self.won), set()
        if not seats:
            return 0
        keys, args = RESIGN.call(seats=seats, endpoint=self.endpoint)
        return int(await self._resign(keys=keys, args=args))


class Spool:
    """`nbytes` being received into a private, unlinked file, and served (`source`) as they arrive."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        fd, path = tempfile.mkstemp(dir=directory, prefix="delta-")
        os.unlink(path)  # the open file is all there is: nothing to clean up after a crash
        reserve(fd, nbytes, directory)
        self._fd, self._map = fd, mmap.mmap(fd, nbytes)
        self.view = memoryview(self._map)
        self.source = Source(fd, 0, nbytes, complete=False)

    def data(self) -> bytes:
        return bytes(self.view)

    def close(self) -> None:
        self.source.fail()  # a transfer still waiting for bytes ends
        self.view.release()
        with contextlib.suppress(BufferError):  # a slice a finished pull left is dropped with it
            self._map.close()
        os.close(self._fd)
