"""Dataflow throughput: rollout groups through the collector and the batch former, vs raw redis-py.

N rollout groups (8 samples of 256 tokens each: ids, logprobs, mask, versions) wait in `rollouts`; then R
processes start together and the clock runs until every group is out:
- astraflow: R dataflow replicas (collector + batch former loops of `Dataflow`): decode, validate,
  normalise, the atomic collect step (group bytes stored, ack, staleness, ready set, ledger, lineage),
  and the batch script (EDF selection, a batch entry referring to 128 samples, ledger, lineage); done
  when the ledger counts N groups trained. (The trainer's one HMGET per batch is not part of it.)
- raw: R processes doing XREADGROUP COUNT 64, then one pipeline of an XADD per entry (same payload) and
  an XACK; done when N entries are out.
Paths alternate within each round; the median of the rounds is shown. Redis keeps AOF (everysec) with
automatic rewrites off.

    python tests/bench/dataflow_throughput.py [--groups 3000] [--rounds 3] [--deadline-s 120]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time

import numpy as np
import redis.asyncio as aioredis
from _smoke import parse

from astraflow import redis_server
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.messages import RolloutGroup, Trajectory, encode
from astraflow.settings_load import load_settings
from astraflow.streams import Bus, Keys
from astraflow.streams.connection import cancel_and_wait

SAMPLES, TOKENS, MODEL, READ = 8, 256, "policy", 64


def settings(url: str, run: str):
    return load_settings(
        None,
        [
            f"run.name={run}",
            f"redis.url={url}",
            "streams.block_ms=20",
            "dataflow.batch.size=128",
            "dataflow.batch.prefetch=1000000",  # no trainer here: nothing holds the former back
            # ... and nothing moves the version on: a group waiting behind more batches than this would
            # be dropped as stale (at the default 4, every group after the 5th batch: the bench stalled)
            "dataflow.max_staleness_steps=1000000",
            f"dataflow.collector.read_count={READ}",
        ],
    )


def rollout(i: int) -> dict[str, bytes]:
    rng = np.random.default_rng(i)
    mask = np.zeros(TOKENS, np.uint8)
    mask[32:] = 1
    trajs = [
        Trajectory(
            model=MODEL,
            token_ids=rng.integers(0, 32_000, TOKENS, dtype=np.int32),
            logprobs=-np.abs(rng.normal(1, 0.5, TOKENS)).astype(np.float32),  # log p <= 0
            loss_mask=mask,
            versions=np.where(mask == 1, 0, -1).astype(np.int32),
            reward=s / SAMPLES,  # all different: no group is dropped for zero variance
        )
        for s in range(SAMPLES)
    ]
    return encode(RolloutGroup(uid=f"g{i}", raas="bench", version=0, trajectories=trajs, models=[MODEL]))


async def prefill(url: str, path: str, run: str, n: int) -> None:
    """The groups in the input stream. astraflow: the run bootstrapped first, as its launcher does (its
    identity, streams and groups: the batch former refuses to form a batch of a run without identity)."""
    r = aioredis.Redis.from_url(url, protocol=2)
    keys = Keys(run)
    if path == "astraflow":
        s = settings(url, run)
        bus = Bus.connect(url, run, s.redis, s.streams)
        await bus.bootstrap([MODEL])
        await bus.close()
        stream = keys.rollouts
    else:
        stream = f"{run}:in"
        await r.xgroup_create(stream, "dataflow", id="0", mkstream=True)
    for start in range(0, n, 200):
        pipe = r.pipeline(transaction=False)
        ids = range(start, min(n, start + 200))
        for i in ids:
            pipe.xadd(stream, rollout(i))
        if path == "astraflow":  # the groups were submitted: they are in flight
            pipe.sadd(keys.in_flight, *[f"g{i}" for i in ids]).hincrby(keys.ledger, "submitted", len(ids))
        await pipe.execute()
    await r.aclose()


async def raw_worker(url: str, run: str, name: str, n: int) -> None:
    await gate(url, run)
    r = aioredis.Redis.from_url(url, protocol=2)
    while await r.xlen(f"{run}:out") < n:
        reply = await r.xreadgroup("dataflow", name, {f"{run}:in": ">"}, count=READ, block=20)
        for _, entries in reply or []:
            pipe = r.pipeline(transaction=False)
            for _, fields in entries:
                pipe.xadd(f"{run}:out", fields)
            pipe.xack(f"{run}:in", "dataflow", *[i for i, _ in entries])
            await pipe.execute()
    await r.aclose()


async def dataflow_worker(url: str, run: str, name: str, n: int) -> None:
    s = settings(url, run)
    bus = Bus.connect(url, run, s.redis, s.streams)
    df = Dataflow(dataflow_setup(s), bus, name, rows=[{"prompt": "unused"}])
    await gate(url, run)
    # The loops bare, not under `Dataflow._forever` (which logs an error and restarts the loop, as a
    # replica should): here an error ends the worker, and `finish` reports it instead of waiting.
    tasks = [asyncio.create_task(loop()) for loop in (df._collect, df._form)]
    try:
        while int(await bus.redis.hget(bus.keys.ledger, f"{MODEL}:trained") or 0) < n:
            if failed := [t for t in tasks if t.done()]:
                await failed[0]  # raises the loop's error
            await asyncio.sleep(0.005)
    finally:
        await cancel_and_wait(tasks)
        await bus.close()


def _proc(fn, *args) -> None:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    asyncio.run(fn(*args))


async def gate(url: str, run: str) -> None:
    r = aioredis.Redis.from_url(url, protocol=2)
    while not await r.exists(f"{run}:go"):
        await asyncio.sleep(0.002)
    await r.aclose()


async def finish(url: str, path: str, run: str, n: int, procs: list, deadline_s: float) -> float:
    """Seconds from the start signal until all `n` groups are out. Raises when a worker exits first or
    `deadline_s` passes: a bench that stalls says so instead of waiting forever."""
    r = aioredis.Redis.from_url(url, protocol=2)
    await r.set(f"{run}:go", 1)
    started = time.perf_counter()
    try:
        while (done := await _done(r, path, run)) < n:
            if dead := [p.exitcode for p in procs if p.exitcode is not None]:
                raise RuntimeError(f"{path}: a worker exited with {dead[0]} after {done} of {n} groups")
            if path == "astraflow" and (lost := await _lost(r, run)):
                raise RuntimeError(f"{path}: {lost} (see the log above)")
            if time.perf_counter() - started > deadline_s:
                raise RuntimeError(f"{path}: {done} of {n} groups out after {deadline_s:.0f} s: stalled")
            await asyncio.sleep(0.002)
        return time.perf_counter() - started
    finally:
        await r.aclose()


async def _lost(r: aioredis.Redis, run: str) -> str:
    """What of the groups will never count as trained ('' when nothing): dead letters, or groups the
    dataflow dropped (`ledger` counters `policy:dropped:<reason>`), so a bench that loses groups says
    why at once instead of running into its deadline."""
    keys = Keys(run)
    dead = await r.xlen(keys.dead)
    dropped = {
        k.decode().rpartition(":")[2]: int(v)
        for k, v in (await r.hgetall(keys.ledger)).items()
        if k.decode().startswith(f"{MODEL}:dropped:")
    }
    lost = [f"{dead} rollout groups dead-lettered"] if dead else []
    return ", ".join(lost + [f"{n} dropped as {reason}" for reason, n in dropped.items() if n])


async def _done(r: aioredis.Redis, path: str, run: str) -> int:
    if path == "raw":
        return await r.xlen(f"{run}:out")
    return int(await r.hget(Keys(run).ledger, f"{MODEL}:trained") or 0)


def measure(url: str, path: str, run: str, n: int, replicas: int, deadline_s: float) -> float:
    asyncio.run(prefill(url, path, run, n))
    worker = dataflow_worker if path == "astraflow" else raw_worker
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_proc, args=(worker, url, run, f"w{i}", n)) for i in range(replicas)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # started, imported, connected
    try:
        took = asyncio.run(finish(url, path, run, n, procs, deadline_s))
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    finally:
        for p in procs:
            p.join(timeout=60)
    return n / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=120.0, help="fail when a measurement takes longer")
    # Smoke: 96 groups, 6 batches, past the 5 batches after which the bench once stalled.
    args = parse(ap, groups=96, rounds=1)
    args.groups -= args.groups % (128 // SAMPLES)  # whole batches: every group ends in one
    results: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = redis_server.start(tmp)
        try:
            asyncio.run(_no_rewrites(server.url))
            for r in range(args.rounds):
                for replicas in (1, 2):
                    for path in ("raw", "astraflow"):
                        run = f"{path}{r}r{replicas}"
                        rate = measure(server.url, path, run, args.groups, replicas, args.deadline_s)
                        results.setdefault((replicas, path), []).append(rate)
                        asyncio.run(_flush(server.url))
        finally:
            server.stop()
    print(
        f"dataflow throughput: {args.groups} groups x {SAMPLES} samples x {TOKENS} tokens, "
        f"median of {args.rounds} rounds"
    )
    print(f"{'replicas':<10}{'raw groups/s':>14}{'astraflow groups/s':>20}{'samples/s':>11}{'ratio':>8}")
    for replicas in (1, 2):
        raw = statistics.median(results[(replicas, "raw")])
        ours = statistics.median(results[(replicas, "astraflow")])
        print(f"{replicas:<10}{raw:>14.0f}{ours:>20.0f}{ours * SAMPLES:>11.0f}{ours / raw:>8.2f}")


async def _no_rewrites(url: str) -> None:
    """AOF stays on, but no automatic rewrite: its forked child would compete for the two cores at
    random moments and skew whichever path it lands in."""
    r = aioredis.Redis.from_url(url, protocol=2)
    await r.config_set("auto-aof-rewrite-percentage", 0)
    await r.aclose()


async def _flush(url: str) -> None:
    r = aioredis.Redis.from_url(url, protocol=2)
    await r.flushall()
    await r.aclose()


if __name__ == "__main__":
    main()
