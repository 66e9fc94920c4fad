"""A user-space TCP proxy standing for a long link between regions (these machines have no `netem`):
every chunk arrives `latency_s` after it was sent, each direction is capped at `bps` bytes/s shared by
all connections (one link), and the bytes crossing each way are counted. It runs its own event loop in a
thread, so a test or bench may block while it forwards."""

from __future__ import annotations

import asyncio
import threading
import time

CHUNK = 32 << 10


class LinkProxy:
    """Listens on 127.0.0.1:`port`, forwards to `target` (settable after start). `down` counts bytes from
    the target to the clients (into the far region), `up` the other way."""

    def __init__(
        self, target: tuple[str, int] | None = None, latency_s: float = 0.05, bps: float = 0
    ) -> None:
        self.target, self.latency_s, self.bps = target, latency_s, bps
        self.down = self.up = 0
        self._free = {"down": 0.0, "up": 0.0}  # when each direction's link is next free
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)  # type: ignore[misc]
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_writer, "up"), self._pump(up_reader, writer, "down"), return_exceptions=True
        )

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, way: str) -> None:
        """Forward src to dst: a chunk is read when the link is free, holds it for len/bps, and arrives
        `latency_s` after it left (so a connection has at most one chunk on the link ahead of others)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                dst.write(data)
                await dst.drain()
                if way == "down":
                    self.down += len(data)
                else:
                    self.up += len(data)

        delivering = asyncio.ensure_future(deliver())
        try:
            while data := await src.read(CHUNK):
                now = time.monotonic()
                self._free[way] = max(now, self._free[way]) + (len(data) / self.bps if self.bps else 0.0)
                await asyncio.sleep(self._free[way] - now)
                queue.put_nowait((time.monotonic() + self.latency_s, data))
            queue.put_nowait(None)
            await delivering
        finally:
            delivering.cancel()
            dst.close()

    def reset(self) -> None:
        self.down = self.up = 0

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
