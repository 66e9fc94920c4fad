"""What a settle's group bytes cost each way into Redis: passed to its script as arguments (one command,
the script writes them) or written by a plain HSET in one MULTI with the script (`Store.collect` passes
them up to `INLINE_BYTES` a settle). Per settle of GROUPS groups of each size: Redis's CPU (its process's
user + system time) and the client's (a `Bus` on the run's asyncio client, as the collector calls it),
the MULTI the baseline. The scripts write the bytes and remove them again, so nothing piles up.

    python tests/bench/settle_bytes.py [--sizes 2,4,8,32] [--groups 8] [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile

from _smoke import parse

from astraflow import redis_server
from astraflow.launch.supervisor import cpu_seconds
from astraflow.streams import Bus
from astraflow.streams.connection import queue_script, with_script
from astraflow.streams.functions import Script
from astraflow.streams.settings import RedisSettings, StreamsSettings

PASSED = """redis.call('HSET', KEYS[1], unpack(ARGV))
for i = 1, #ARGV, 2 do redis.call('HDEL', KEYS[1], ARGV[i]) end"""
WRITTEN = "redis.call('HDEL', KEYS[1], unpack(ARGV))"


def client_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def per_settle(server, size: int, groups: int, calls: int) -> dict[str, tuple[float, float]]:
    """Way -> (Redis CPU s, client CPU s) per settle."""
    bus = Bus.connect(server.url, "bench", RedisSettings(), StreamsSettings())
    passed, written = Script(bus.redis, PASSED), Script(bus.redis, WRITTEN)
    payloads = {f"1796000000000-{i}": os.urandom(size) for i in range(groups)}
    pairs = [x for kv in payloads.items() for x in kv]

    def fill(pipe) -> None:
        pipe.hset("samples", mapping=payloads)
        queue_script(pipe, written, ["samples"], list(payloads))

    ways = {
        "passed": lambda: bus.call(lambda: passed(keys=["samples"], args=pairs)),
        "multi": lambda: bus.call(lambda: with_script(bus.redis, written, fill, transaction=True)),
    }
    out = {}
    try:
        for name, settle in ways.items():
            await settle()
            redis0, client0 = cpu_seconds(server.pid), client_cpu_s()
            for _ in range(calls):
                await settle()
            out[name] = ((cpu_seconds(server.pid) - redis0) / calls, (client_cpu_s() - client0) / calls)
    finally:
        await bus.close()
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")  # (at the smoke size a clock tick may not pass)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,4,8,32", help="KiB per group")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000)
    args = parse(ap, sizes="2,32", calls=50)
    print(f"per settle of {args.groups} groups, {args.calls} settles each way (CPU per settle, us)")
    print(
        f"{'KiB/group':>9} {'KiB/settle':>10} {'redis passed':>13} {'multi':>7} {'ratio':>6}"
        f" {'client passed':>14} {'multi':>7} {'ratio':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        server = redis_server.start(tmp)
        try:
            for kib in (int(x) for x in args.sizes.split(",")):
                got = asyncio.run(per_settle(server, kib << 10, args.groups, args.calls))
                (rp, cp), (rm, cm) = got["passed"], got["multi"]
                print(
                    f"{kib:>9} {kib * args.groups:>10} {rp * 1e6:>13.0f} {rm * 1e6:>7.0f}"
                    f" {ratio(rp, rm):>6.2f} {cp * 1e6:>14.0f} {cm * 1e6:>7.0f} {ratio(cp, cm):>6.2f}"
                )
        finally:
            server.stop()
    print(
        f"settle bytes: passed/multi redis cpu {ratio(rp, rm):.2f}, client cpu {ratio(cp, cm):.2f}"
        f" at {kib * args.groups} KiB a settle"
    )


if __name__ == "__main__":
    main()
