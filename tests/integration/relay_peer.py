"""A weight receiver of region b in its own process, for kill -9 / SIGSTOP: prints its endpoint, syncs
one version of "policy" (becoming the region's relay when it asks first), prints "synced", then serves.

    python -m tests.integration.relay_peer REDIS_URL RUN MANIFEST_KEY VERSION ROOT"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from astraflow.streams import Bus
from astraflow.streams.settings import RedisSettings, StreamsSettings
from astraflow.weights.published import run_secret
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings


async def main(url: str, run: str, key: str, version: int, root: Path) -> None:
    bus = Bus.connect(url, run, RedisSettings(), StreamsSettings())
    settings = WeightsSettings(io_timeout_s=1.0, same_host=False)
    secret = await run_secret(bus, settings)
    server = WeightServer(secret)
    print(server.endpoint, flush=True)
    rx = WeightReceiver(bus, settings, "policy", root, secret, server, region="b")
    await rx.sync(key, version)
    print("synced", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    url, run, key, version, root = sys.argv[1:]
    asyncio.run(main(url, run, key, int(version), Path(root)))
