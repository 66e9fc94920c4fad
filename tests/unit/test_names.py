"""One live process per consumer name: a second live holder is refused, a dead holder's name is taken over
at once, and a clean stop frees the name."""

import asyncio
import os
import subprocess
import sys

import pytest

from astraflow import processes
from astraflow.streams.names import NameInUse, hold_name, name_key


async def test_a_name_held_by_a_live_process_is_refused(bus):
    async with hold_name(bus, "raas-a", "raas.id", role="raas"):
        with pytest.raises(NameInUse, match=r"raas.id"):
            async with hold_name(bus, "raas-a", "raas.id", role="raas"):
                pass


async def test_a_live_holder_keeps_its_name_past_the_ttl(bus):
    async with hold_name(bus, "raas-a", role="raas"):
        await asyncio.sleep(3 * bus.settings.lease_ms / 1000)  # renewed meanwhile
        with pytest.raises(NameInUse):
            async with hold_name(bus, "raas-a", role="raas"):
                pass


async def test_the_name_of_a_killed_process_is_taken_over_at_once(bus):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key = name_key(bus, "trainer", "trainer-policy")
    await bus.redis.set(key, f"{processes.pid_space()} {dead.pid} feed", px=10**7)  # never expires here
    async with hold_name(bus, "trainer-policy", role="trainer"):
        holder = (await bus.redis.get(key)).decode()
        assert holder.split()[1] == str(os.getpid())


async def test_a_clean_stop_frees_the_name(bus):
    async with hold_name(bus, "dataflow-a", role="dataflow"):
        pass
    assert await bus.redis.get(name_key(bus, "dataflow", "dataflow-a")) is None
    async with hold_name(bus, "dataflow-a", role="dataflow"):
        pass


async def test_a_process_whose_name_was_taken_over_gives_way(bus):
    """Redis lost the name (an outage past its TTL) and another process took it: the first one stops
    instead of sharing the name."""
    with pytest.raises(NameInUse, match="taken over"):
        async with hold_name(bus, "raas-a", role="raas"):
            await bus.redis.set(name_key(bus, "raas", "raas-a"), "elsewhere~1 1 beef", px=10**7)
            await asyncio.sleep(3 * bus.settings.lease_ms / 1000)
