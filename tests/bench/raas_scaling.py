"""RaaS scaling: prompt groups per second with 1, 2, 4 RaaS worker processes against linear scaling.

Each worker is a real `RaasWorker` process (bus, runner, leases, rlvr workflow, reward process pool,
heartbeats) whose engine is a fake of fixed latency per token (`FakeEngine`, known only to this bench):
every request sleeps `tokens x token_ms` and returns that many tokens, so the engine, not these machines'
two cores, bounds a worker, as a GPU would. For each pool size the bench starts the workers against a
redis-server of its own, waits for their heartbeats, then a feeder publishes `per_worker x N` prompt
groups at once and the clock runs until the last rollout group is handed back. Baseline: the single
worker's rate in the same run; linear is N times it. The last column is a worker's rate while generating
as `astraflow scale` reads it from the heartbeats (groups per generating second), for comparison.

    PYTHONPATH=. python tests/bench/raas_scaling.py [--sizes 1,2,4] [--per-worker 48] [--slots 4]
        [--samples 4] [--tokens 16] [--token-ms 20] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _smoke import parse

from astraflow import redis_server, tiny
from astraflow.config import Settings
from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse
from astraflow.launch.progress import read_heartbeats
from astraflow.messages import PromptGroup, encode
from astraflow.ops.scale_plan import pool_rates
from astraflow.settings_load import load_settings, to_env
from astraflow.streams import Bus, Out
from astraflow.workflows.tasks import rows

ROOT = Path(__file__).resolve().parents[2]


class FakeEngine(Engine):
    """Generates `max_new_tokens` copies of one token, taking `token_ms` per token; any number of
    requests at once (a batching engine far from its limit)."""

    def __init__(self, token_ms: float, token_id: int) -> None:
        self.token_s, self.token_id = token_ms / 1000, token_id

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        n = request.params.max_new_tokens
        await asyncio.sleep(n * self.token_s)
        return GenerateResponse([self.token_id] * n, [-1.0] * n, [self.version] * n, "length")

    async def pause(self) -> None: ...

    async def load_weights(self, path: str, version: int) -> None:
        self.version = version

    async def resume(self) -> None: ...

    async def healthy(self) -> bool:
        return True


def worker_main(token_ms: float) -> None:
    """One RaaS worker process (settings from the env), as `astraflow raas` runs it but with the fake
    engine."""
    from transformers import AutoTokenizer

    from astraflow.launch.build import raas_setup
    from astraflow.launch.worker_loop import run_until_signalled
    from astraflow.raas.worker import RaasWorker

    s = load_settings()
    tokenizer = AutoTokenizer.from_pretrained(s.engine.model)
    token = tokenizer.encode("7", add_special_tokens=False)[0]

    async def body(bus, stop) -> None:
        engines = {"policy": FakeEngine(token_ms, token)}
        await RaasWorker(raas_setup(s), bus, engines, s.raas.id, {"policy": tokenizer}).run(stop)

    asyncio.run(run_until_signalled(s, s.redis.url or "", s.raas.id, body, "raas.id", "raas"))


def settings_for(url: str, model: str, run: str, run_dir: Path, worker: str, args) -> Settings:
    s = Settings()
    s.run.name, s.run.dir = run, run_dir
    s.redis.url = url
    s.engine.model = model
    s.raas.id, s.raas.slots, s.raas.reward_processes = worker, args.slots, 1
    s.raas.sampling.max_new_tokens = args.tokens
    return s


async def measure(url: str, model: str, n: int, round_: int, tmp: Path, args) -> tuple[float, float]:
    """Prompt groups per second of `n` fresh workers on `per_worker x n` groups, and each worker's rate
    while generating as `astraflow scale` reads it from their heartbeats."""
    run = f"scaling-{n}-{round_}"
    run_dir = tmp / run
    run_dir.mkdir(parents=True)
    workers = []
    base = settings_for(url, model, run, run_dir, "raas-0", args)
    bus = Bus.connect(url, run, base.redis, base.streams)
    try:
        await bus.bootstrap(["policy"])
        for i in range(n):
            s = settings_for(url, model, run, run_dir, f"raas-{i}", args)
            env = {**os.environ, **to_env(s), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            log = open(run_dir / f"raas-{i}.log", "wb")
            cmd = [sys.executable, __file__, "--worker", "--token-ms", str(args.token_ms)]
            workers.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        while len([k async for k in bus.redis.scan_iter(match=bus.keys.raas("*"))]) < n:
            if any(w.poll() is not None for w in workers):
                raise RuntimeError(f"a worker exited: see {run_dir}")
            await asyncio.sleep(0.2)
        total = args.per_worker * n
        groups = [
            PromptGroup(
                uid=f"g{i}", workflow="rlvr", models=["policy"], n_samples=args.samples, version=0, sample=row
            )
            for i, row in enumerate(rows("addition", total, seed=round_))
        ]
        started = time.perf_counter()
        await bus.publish_many([Out(bus.keys.prompts, encode(g), f"p:{g.uid}") for g in groups])
        deadline = time.monotonic() + 600
        while await bus.redis.xlen(bus.keys.rollouts) < total:
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                raise RuntimeError(f"the workers made no progress: see {run_dir}")
            await asyncio.sleep(0.01)
        rate = total / (time.perf_counter() - started)
        beats: list = []
        while sum(hb.groups for hb in beats) < total:  # what `astraflow scale` sees of the same work
            await asyncio.sleep(0.2)
            beats = await read_heartbeats(bus)
        return rate, pool_rates(beats).per_worker_groups_per_s
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(timeout=60)
        await bus.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--per-worker", type=int, default=48, help="prompt groups per worker and measurement")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parse(ap, sizes="1", per_worker=4, samples=2, tokens=4, token_ms=5)
    if args.worker:
        worker_main(args.token_ms)
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = str(tiny.build(tmp / "model"))
        server = redis_server.start(tmp / "redis")
        rates: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
        try:
            for r in range(args.rounds):  # sizes interleaved across rounds: drift hits them alike
                for n in sizes:
                    rates[n].append(asyncio.run(measure(server.url, model, n, r, tmp, args)))
        finally:
            server.stop()
    ideal = args.slots / (args.tokens * args.token_ms / 1000)
    print(
        f"RaaS scaling: {args.per_worker} groups per worker x {args.samples} samples x {args.tokens} tokens"
        f" at {args.token_ms:g} ms/token, {args.slots} slots (engine bound: {ideal:.1f} groups/s per"
        f" worker), median of {args.rounds} round(s)"
    )
    one = statistics.median(r for r, _ in rates[sizes[0]]) / sizes[0]
    print(f"{'workers':>8}{'groups/s':>12}{'linear':>12}{'of linear':>12}{'scale: per worker':>20}")
    for n in sizes:
        rate = statistics.median(r for r, _ in rates[n])
        seen = statistics.median(w for _, w in rates[n])
        print(f"{n:>8}{rate:>12.2f}{one * n:>12.2f}{rate / (one * n):>12.2f}{seen:>20.2f}")


if __name__ == "__main__":
    main()
