"""The dataflow's CPU per unit of its work: a rollout group judged, a Redis round trip made (and what a
RaaS spends encoding the group).

- Per group: what the collector does with one rollout entry before settling it - decode, the value checks
  (of a read of READ groups together, as the collector reads them in a default run) and the verdict (a
  packed SampleGroup) - for a group of the default recipe's shape (8 samples of 14 tokens); baseline:
  msgpack's unpack of the same bytes, the least any reader of the entry does.
- Per group encoded (the RaaS's side, `encode`); baseline: msgpack's pack of the same plain values.
- Per round trip: one GET as the dataflow makes its calls (`Bus.call` on the run's redis-py asyncio
  client); baseline: the same GET written by hand on an asyncio stream (no client library).
CPU is the process's user + system time (`getrusage`), so it counts the socket calls too. Each round
measures both sides of each pair back to back; shown: the median over the rounds.

    python tests/bench/dataflow_cpu.py [--groups 2000] [--calls 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
from collections.abc import Awaitable, Callable

import msgpack
import numpy as np
from _smoke import parse

from astraflow import redis_server
from astraflow.dataflow.checks import check_groups
from astraflow.dataflow.verdicts import Judge
from astraflow.messages import RolloutGroup, Trajectory, decode, encode
from astraflow.packing import _pack_array, _unpack_array
from astraflow.settings_load import load_settings
from astraflow.streams import Bus
from astraflow.streams.settings import RedisSettings, StreamsSettings

SAMPLES, PROMPT, COMPLETION = 8, 10, 4
READ = 10
"""Rollout groups per collector read (a default run: ~115 groups a second in ~10 reads)."""


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def groups_of(n: int) -> list[RolloutGroup]:
    """`n` rollout groups of the default recipe's shape."""
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        trajs = []
        for k in range(SAMPLES):
            mask = np.r_[np.zeros(PROMPT, np.uint8), np.ones(COMPLETION, np.uint8)]
            trajs.append(
                Trajectory(
                    model="policy",
                    token_ids=rng.integers(0, 50, len(mask)).astype(np.int32),
                    logprobs=-rng.random(len(mask)).astype(np.float32),
                    loss_mask=mask,
                    versions=np.where(mask == 1, 5, -1).astype(np.int32),
                    reward=float(k % 2),
                    finish_reason="stop",
                )
            )
        out.append(
            RolloutGroup(uid=f"e0r{i}", raas="raas-0", version=5, trajectories=trajs, models=["policy"])
        )
    return out


def per_encode(groups: list[RolloutGroup]) -> tuple[float, float]:
    """(CPU seconds per group encoded as a RaaS does, per msgpack pack of the same plain values)."""
    start = cpu_s()
    encoded = [encode(g)["data"] for g in groups]
    astraflow = (cpu_s() - start) / len(groups)
    plain = [msgpack.unpackb(data, ext_hook=_unpack_array, raw=False) for data in encoded]
    start = cpu_s()
    for values in plain:
        msgpack.packb(values, default=_pack_array, use_bin_type=True)
    return astraflow, (cpu_s() - start) / len(groups)


def per_group(groups: list[dict[bytes, bytes]]) -> tuple[float, float]:
    """(CPU seconds per group judged as the collector does, per bare msgpack unpack)."""
    judge = Judge(load_settings(None, []).dataflow.collector, ["policy"])
    start = cpu_s()
    for at in range(0, len(groups), READ):
        read = [decode(fields, RolloutGroup, 1 << 20) for fields in groups[at : at + READ]]
        checked = check_groups(read, {"policy": 5}, {"policy": 64})
        for i, (group, owned) in enumerate(zip(read, checked, strict=True)):
            judge(str(at + i), group, groups[at + i][b"data"], owned)
    judged = (cpu_s() - start) / len(groups)
    start = cpu_s()
    for fields in groups:
        msgpack.unpackb(fields[b"data"], ext_hook=_unpack_array, raw=False)
    return judged, (cpu_s() - start) / len(groups)


async def per_call(server: redis_server.RedisServer, calls: int) -> tuple[float, float]:
    """(CPU seconds per GET through `Bus.call`, per GET by hand on an asyncio stream)."""
    bus = Bus.connect(server.url, "bench", RedisSettings(), StreamsSettings())
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    auth = f"*2\r\n$4\r\nAUTH\r\n${len(server.password)}\r\n{server.password}\r\n".encode()
    writer.write(auth)
    await reader.readuntil(b"\r\n")
    await bus.redis.set("k", "v")

    async def by_hand() -> None:
        writer.write(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")
        await reader.readuntil(b"v\r\n")

    async def timed(call: Callable[[], Awaitable]) -> float:
        start = cpu_s()
        for _ in range(calls):
            await call()
        return (cpu_s() - start) / calls

    try:
        return await timed(lambda: bus.call(lambda: bus.redis.get("k"))), await timed(by_hand)
    finally:
        writer.close()
        await bus.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = parse(ap, groups=50, calls=100, rounds=1)
    made = groups_of(args.groups)
    groups = [{k.encode(): v for k, v in encode(g).items()} for g in made]  # as the collector reads them
    rows: dict[str, list[tuple[float, float]]] = {"group": [], "encode": [], "call": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = redis_server.start(tmp)
        try:
            for _ in range(args.rounds):
                rows["group"].append(per_group(groups))
                rows["encode"].append(per_encode(made))
                rows["call"].append(asyncio.run(per_call(server, args.calls)))
        finally:
            server.stop()
    us = {k: [statistics.median(x[i] for x in v) * 1e6 for i in (0, 1)] for k, v in rows.items()}
    print(f"dataflow CPU per unit, median of {args.rounds} rounds (user + system)")
    print(f"{'':<34}{'astraflow us':>14}{'baseline us':>13}{'ratio':>8}")
    labels = {
        "group": "rollout group judged / unpacked",
        "encode": "rollout group encoded / packed",
        "call": "round trip Bus.call / by hand",
    }
    for key, label in labels.items():
        ours, base = us[key]
        print(f"{label:<34}{ours:>14.1f}{base:>13.1f}{ours / base:>8.1f}")
    print(
        f"dataflow cpu: group {us['group'][0]:.0f} us, round trip {us['call'][0]:.0f} us"
        f" (encoded in {us['encode'][0]:.0f} us)"
    )


if __name__ == "__main__":
    main()
