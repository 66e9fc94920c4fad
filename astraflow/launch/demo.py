"""The bus demo: feeder and collector in this process, demo RaaS workers as child processes.

`main` is what `astraflow run recipes/bus-demo.yaml` runs, on the machinery of `astraflow run`
(`local_run.LocalRun`): the embedded Redis unless one is configured, the workers started, restarted and
stopped by the `Supervisor`, the same stop signals. `python -m workers.demo raas NAME` is one demo worker
(`worker_main`), run like every worker (`worker_loop.run_until_signalled`). The workers stand in for real
rollouts: each entry is decoded, held for `demo.episode_ms` and handed off as a rollout group.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np
import structlog

from astraflow import logs
from astraflow.config import Settings, redact_url
from astraflow.errors import WorkerFailed
from astraflow.launch.local_run import LocalRun
from astraflow.launch.worker_loop import run_until_signalled
from astraflow.messages import PromptGroup, RolloutGroup, Trajectory, decode, encode
from astraflow.processes import STOP_SIGNALS, Stopped, exit_status
from astraflow.settings_load import load_settings, to_env
from astraflow.streams import Bus, Consumer, Delivery, Out, Runner
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS
from astraflow.streams.reap import Reaper

log = structlog.get_logger("demo")
EXIT_FAILED = 1
"""The groups were not all collected once each, or a worker kept dying."""


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


async def raas_worker(settings: Settings, name: str, bus: Bus, stop: asyncio.Event) -> None:
    """One demo RaaS: consume `prompts`, hand each group off to `rollouts`, until `stop` (SIGTERM)."""
    await bus.bootstrap(settings.trained)

    async def handle(entry: Delivery) -> list[Out]:
        group = decode(entry.fields, PromptGroup, settings.streams.max_entry_bytes)
        await asyncio.sleep(settings.demo.episode_ms / 1000)
        return [Out(bus.keys.rollouts, encode(rollout(group, name)), f"rollout:{group.uid}")]

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, name), handle, settings.raas.slots)
    await runner.run(stop)
    log.info("worker_stopped", **runner.stats)


def main(settings: Settings, keep_redis: bool = False) -> int:
    local = LocalRun(settings, keep_redis)
    logs.configure("warning", run=settings.run.name, worker="launcher")  # the terminal shows progress
    try:
        url = local.start_redis()
        print(
            f"run {settings.run.name!r} on {redact_url(url)}; "
            f"watch it with: astraflow inspect --run {settings.run.name}",
            flush=True,
        )
        return asyncio.run(_orchestrate(settings, local))
    except Stopped as e:  # before the workers started
        print(f"stopping ({e})", flush=True)
        return exit_status(e.signum)
    finally:
        local.close()


def _start_workers(settings: Settings, local: LocalRun) -> None:
    supervised = settings.model_copy(deep=True)
    supervised.run.supervised = True  # this process stops them
    env = to_env(supervised)
    for i in range(settings.demo.workers):
        local.supervisor.start(local.worker(f"raas-{i}", "workers.demo", env, "raas", f"raas-{i}"))


async def _orchestrate(settings: Settings, local: LocalRun) -> int:
    d = settings.demo
    bus = connect(settings, settings.redis.url or "")
    await bus.bootstrap(settings.trained)
    _start_workers(settings, local)
    await bus.publish_many(
        [Out(bus.keys.prompts, encode(prompt(i)), f"prompt:{prompt(i).uid}") for i in range(d.groups)]
    )
    seen: Counter[str] = Counter()

    async def collect(entry: Delivery) -> list[Out]:
        seen[decode(entry.fields, RolloutGroup).uid] += 1
        return []

    received: list[int] = []  # a stop signal: end like at the last group (workers first, then Redis)
    for sig in STOP_SIGNALS:
        asyncio.get_running_loop().add_signal_handler(sig, received.append, sig)
    stop = asyncio.Event()
    collector = Runner(Consumer(bus, bus.keys.rollouts, GROUP_DATAFLOW, "collector"), collect, 64)
    task = asyncio.create_task(collector.run(stop))
    started, killed, failed = time.monotonic(), None, None
    reaper = Reaper(bus)  # (the dataflow's part: prompts no RaaS could ever hand off go to `dead`)
    while len(seen) < d.groups and not task.done() and not received:
        await asyncio.sleep(0.5)
        await reaper.sweep(bus.keys.prompts)
        try:
            restarted = local.supervisor.check()
        except WorkerFailed as e:  # a worker that keeps dying: the demo cannot finish
            print(f"stopping: {e}", flush=True)
            failed = e
            break
        for name in restarted:
            print(f"  restarted {name}", flush=True)
        pending = (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"]
        print(
            f"  {time.monotonic() - started:5.1f}s  collected {len(seen)}/{d.groups}  "
            f"prompts pending {pending}  dead {await bus.redis.xlen(bus.keys.dead)}",
            flush=True,
        )
        if d.kill_one and killed is None and len(seen) >= d.groups // 2:
            killed = "raas-0"
            held = await bus.redis.xpending_range(bus.keys.prompts, GROUP_RAAS, "-", "+", 1000, killed)
            proc = local.supervisor.workers[killed].proc
            proc.kill()
            print(
                f"  kill -9 {killed} (pid {proc.pid}) holding {len(held)} entries; the supervisor restarts"
                f" it, and they are reclaimed after the {settings.streams.lease_ms} ms lease",
                flush=True,
            )
    elapsed = time.monotonic() - started
    if received:
        print(f"stopping ({STOP_SIGNALS[received[0]]})", flush=True)
    stop.set()
    await task
    await asyncio.to_thread(local.supervisor.stop)  # drained before the dead letters are counted
    dupes = sum(1 for n in seen.values() if n > 1)
    print(
        f"done: {len(seen)}/{d.groups} groups in {elapsed:.1f}s ({len(seen) / elapsed:.0f}/s), "
        f"duplicates {dupes}, dead letters {await bus.redis.xlen(bus.keys.dead)}",
        flush=True,
    )
    await bus.close()
    if received:
        return exit_status(received[0])
    return 0 if failed is None and len(seen) == d.groups and dupes == 0 else EXIT_FAILED


def worker_main(name: str) -> None:
    """`python -m workers.demo raas NAME`: one demo RaaS, its settings from the environment."""
    settings = load_settings()
    body = lambda bus, stop: raas_worker(settings, name, bus, stop)  # noqa: E731
    asyncio.run(run_until_signalled(settings, settings.redis.url or "", name, body, "its NAME", "raas"))
