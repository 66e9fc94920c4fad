"""Helpers to run real demo RaaS worker processes against a test Redis and to feed and collect entries."""

import asyncio
import os
import subprocess
import sys
import time

from astraflow.config import Settings
from astraflow.launch.demo import prompt
from astraflow.messages import RolloutGroup, decode, encode
from astraflow.settings_load import to_env
from astraflow.streams import Bus, Out
from astraflow.streams.keys import GROUP_RAAS


def settings_for(url: str, **demo) -> Settings:
    s = Settings()
    s.run.name = "it"
    s.redis.url = url
    s.redis.reconnect_max_s = 30
    s.streams.lease_ms = 500
    s.streams.block_ms = 200
    s.raas.slots = 4
    for k, v in demo.items():
        setattr(s.demo, k, v)
    return s


def spawn_worker(settings: Settings, name: str) -> subprocess.Popen:
    env = {**os.environ, **to_env(settings)}
    return subprocess.Popen(
        [sys.executable, "-m", "workers.demo", "raas", name],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def feed(bus: Bus, n: int, start: int = 0) -> list[str]:
    groups = [prompt(i) for i in range(start, start + n)]
    await bus.publish_many([Out(bus.keys.prompts, encode(g), f"prompt:{g.uid}") for g in groups])
    return [g.uid for g in groups]


async def wait_pending(bus: Bus, consumer: str, n: int, timeout_s: float = 30) -> list[dict]:
    """Wait until `consumer` holds `n` entries of `prompts`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = await bus.redis.xpending_range(bus.keys.prompts, GROUP_RAAS, "-", "+", 100, consumer)
        if len(held) >= n:
            return held
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{consumer} never held {n} entries")


async def rollout_uids(bus: Bus) -> list[str]:
    return [decode(f, RolloutGroup).uid for _, f in await bus.redis.xrange(bus.keys.rollouts)]
