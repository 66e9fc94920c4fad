"""The bus demo: feeder and collector in this process, demo RaaS workers as child processes.

`python -m workers.demo raas NAME` is one demo worker (`worker_main`); `main` is what
`astraflow run recipes/bus-demo.yaml` runs. The workers stand in for real rollouts (a later issue): each
entry is decoded, held for `demo.episode_ms` and handed off as a rollout group.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import structlog

from astraflow import logs, redis_server
from astraflow.config import Settings, load_settings, redact_url, to_env
from astraflow.messages import PromptGroup, RolloutGroup, Trajectory, decode, encode
from astraflow.processes import STOP_SIGNALS, Stopped, die_with_parent, exit_status, raise_stopped
from astraflow.streams import Bus, Consumer, Entry, Out, Runner
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS

log = structlog.get_logger("demo")


def connect(settings: Settings, url: str) -> Bus:
    return Bus.connect(url, settings.run.name, settings.redis, settings.streams, wait_out=True)


def prompt(i: int) -> PromptGroup:
    return PromptGroup(
        uid=f"g{i:06d}",
        workflow="demo",
        models=["policy"],
        n_samples=2,
        version=0,
        sample={"prompt": f"{i}", "answer": f"{i}"[::-1]},
        submitted_at=time.time(),
    )


def rollout(group: PromptGroup, worker: str) -> RolloutGroup:
    tokens = np.frombuffer(group.sample["prompt"].encode() + group.sample["answer"].encode(), np.uint8)
    n = len(tokens)
    traj = Trajectory(
        model="policy",
        token_ids=tokens.astype(np.int32),
        logprobs=np.zeros(n, np.float32),
        loss_mask=np.ones(n, np.uint8),
        versions=np.zeros(n, np.int32),
        reward=1.0,
    )
    trajectories = [traj] * group.n_samples
    return RolloutGroup(uid=group.uid, raas=worker, version=group.version, trajectories=trajectories)


async def raas_worker(settings: Settings, name: str) -> None:
    """One demo RaaS: consume `prompts`, hand each group off to `rollouts`; SIGTERM drains and exits."""
    bus = connect(settings, settings.redis.url or "")
    await bus.bootstrap(settings.trained)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def handle(entry: Entry) -> list[Out]:
        group = decode(entry.fields, PromptGroup, settings.streams.max_entry_bytes)
        await asyncio.sleep(settings.demo.episode_ms / 1000)
        return [Out(bus.keys.rollouts, encode(rollout(group, name)), f"rollout:{group.uid}")]

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, name), handle, settings.raas.slots)
    await runner.run(stop)
    log.info("worker_stopped", **runner.stats)
    await bus.close()


def main(settings: Settings, keep_redis: bool = False) -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # until the demo's loop takes them over: stop here
        signal.signal(sig, raise_stopped)
    logs.configure(run=settings.run.name, worker="launcher")
    run_dir = settings.run.path
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    server = None
    try:
        if not settings.redis.url:
            server = redis_server.start(run_dir / "redis", with_parent=not keep_redis)
            settings.redis.url = server.url
        print(
            f"run {settings.run.name!r} on {redact_url(settings.redis.url)}; "
            f"watch it with: astraflow inspect --run {settings.run.name}",
            flush=True,
        )
        return asyncio.run(_orchestrate(settings))
    except Stopped as e:  # before the workers started
        print(f"stopping ({e})", flush=True)
        return exit_status(e.signum)
    finally:
        if server is not None and not keep_redis:
            server.stop()


async def _orchestrate(settings: Settings) -> int:
    d = settings.demo
    bus = connect(settings, settings.redis.url or "")
    await bus.bootstrap(settings.trained)
    env = {**os.environ, **to_env(settings)}
    workers = {f"raas-{i}": _spawn(f"raas-{i}", settings, env) for i in range(d.workers)}

    await bus.publish_many(
        [Out(bus.keys.prompts, encode(prompt(i)), f"prompt:{prompt(i).uid}") for i in range(d.groups)]
    )
    seen: Counter[str] = Counter()

    async def collect(entry: Entry) -> list[Out]:
        seen[decode(entry.fields, RolloutGroup).uid] += 1
        return []

    received: list[int] = []  # a stop signal: end like at the last group (workers first, then Redis)
    for sig in STOP_SIGNALS:
        asyncio.get_running_loop().add_signal_handler(sig, received.append, sig)
    stop = asyncio.Event()
    collector = Runner(Consumer(bus, bus.keys.rollouts, GROUP_DATAFLOW, "collector"), collect, 64)
    task = asyncio.create_task(collector.run(stop))
    started, killed = time.monotonic(), None
    while len(seen) < d.groups and not task.done() and not received:
        await asyncio.sleep(0.5)
        pending = (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"]
        print(
            f"  {time.monotonic() - started:5.1f}s  collected {len(seen)}/{d.groups}  "
            f"prompts pending {pending}  dead {await bus.redis.xlen(bus.keys.dead)}",
            flush=True,
        )
        if d.kill_one and killed is None and len(seen) >= d.groups // 2:
            killed = "raas-0"
            held = await bus.redis.xpending_range(bus.keys.prompts, GROUP_RAAS, "-", "+", 1000, killed)
            workers[killed].kill()
            print(
                f"  kill -9 {killed} (pid {workers[killed].pid}) holding {len(held)} entries; "
                f"they are reclaimed after the {settings.streams.lease_ms} ms lease",
                flush=True,
            )
    elapsed = time.monotonic() - started
    if received:
        print(f"stopping ({STOP_SIGNALS[received[0]]})", flush=True)
    stop.set()
    await task
    for proc in workers.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers.values():
        proc.wait(timeout=60)
    dupes = sum(1 for n in seen.values() if n > 1)
    print(
        f"done: {len(seen)}/{d.groups} groups in {elapsed:.1f}s ({len(seen) / elapsed:.0f}/s), "
        f"duplicates {dupes}, dead letters {await bus.redis.xlen(bus.keys.dead)}",
        flush=True,
    )
    await bus.close()
    if received:
        return exit_status(received[0])
    return 0 if len(seen) == d.groups and dupes == 0 else 1


def _spawn(name: str, settings: Settings, env: dict[str, str]) -> subprocess.Popen:
    logfile = open(settings.run.path / "logs" / f"{name}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "workers.demo", "raas", name],
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent(signal.SIGTERM),
    )


def worker_main(name: str) -> None:
    """`python -m workers.demo raas NAME`: one demo RaaS, its settings from the environment."""
    settings = load_settings()
    logs.configure(settings.log.level, run=settings.run.name, worker=name)
    asyncio.run(raas_worker(settings, name))
