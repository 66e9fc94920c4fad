"""RaaS throughput: completion tokens/s through a RaaS worker (bus included) against one batched
`transformers` `generate` of the same requests on the same number of threads, in the same run.

Baseline: `model.generate` of all G x N sequences at once (left-padded prompts, sampling at temperature
1), in a fresh process with `--threads` torch threads. Raw: the astraflow engine generating the same
requests at once (hf, and vllm when installed). RaaS: a worker process with the same engine settings
and G slots takes G prompt groups of N samples from Redis, runs the rlvr workflow (reward in its
process pool) and hands the rollout groups back; timed from publishing the prompts to the last rollout
group, after the worker is up. A random-init tiny model, so completions mostly run to the token limit;
tokens are counted up to and including eos. Rounds alternate; medians are shown.

    python tests/bench/raas_throughput.py [--engines hf,vllm] [--groups 8] [--samples 8] [--tokens 32]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
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
from astraflow.engines import GenerateRequest, SamplingParams, make_engine
from astraflow.messages import PromptGroup, RolloutGroup, decode, encode
from astraflow.settings_load import to_env
from astraflow.streams import Bus, Out
from astraflow.workflows.tasks import rows


def settings_for(engine: str, model: str, url: str, run_dir: Path, args) -> Settings:
    s = Settings()
    s.run.name, s.run.dir = f"bench-{engine}", run_dir  # a run per engine: fresh streams and dedup keys
    s.redis.url = url
    s.engine.type, s.engine.model = engine, model
    s.engine.dtype = "bfloat16" if engine == "vllm" else "float32"
    s.engine.chunk_tokens = args.tokens  # chunked weight sync: one chunk per request (no loads here)
    s.raas.id, s.raas.slots = "bench-raas", args.groups
    s.raas.sampling.max_new_tokens = args.tokens
    s.engine.threads = args.threads
    s.engine.max_batch = max(s.engine.max_batch, args.groups * args.samples)
    return s


async def raw(settings: Settings, prompts: list[list[int]], rounds: int) -> list[float]:
    engine = make_engine(settings.engine, settings.run.path / "raw-engine.log")
    await engine.start()
    rates = []
    try:
        params = SamplingParams(max_new_tokens=settings.raas.sampling.max_new_tokens)
        for _ in range(rounds):
            started = time.perf_counter()
            out = await asyncio.gather(*[engine.generate(GenerateRequest(p, params)) for p in prompts])
            rates.append(sum(len(o.token_ids) for o in out) / (time.perf_counter() - started))
    finally:
        await engine.close()
    return rates


def generate_in_child(model: str, prompts: list[list[int]], args) -> list[float]:
    """The baseline: one batched `transformers` `generate` of every request, in a fresh process."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_generate, (model, prompts, args.tokens, args.threads, args.rounds))


def _generate(
    model_dir: str, prompts: list[list[int]], tokens: int, threads: int, rounds: int
) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=None, top_p=None,
                max_new_tokens=tokens, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        elapsed = time.perf_counter() - started
        eos = (out[:, width:] == tok.eos_token_id).int()
        rates.append(int(((eos.cumsum(1) - eos) == 0).sum()) / elapsed)
    return rates


def raw_in_child(settings: Settings, prompts: list[list[int]], rounds: int) -> list[float]:
    """`raw` in a fresh process, as the worker is: this one has run torch (the model build)."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_raw_sync, (settings, prompts, rounds))


def _raw_sync(settings: Settings, prompts: list[list[int]], rounds: int) -> list[float]:
    return asyncio.run(raw(settings, prompts, rounds))


async def through_raas(settings: Settings, args, rounds: int) -> list[float]:
    bus = Bus.connect(settings.redis.url or "", settings.run.name, settings.redis, settings.streams)
    await bus.bootstrap(["policy"])
    env = {**os.environ, **to_env(settings)}
    log = open(settings.run.path / "raas.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "workers.raas"], env=env, stdout=log, stderr=log)
    rates = []
    try:
        while not await bus.redis.exists(bus.keys.raas("bench-raas")):
            if worker.poll() is not None:
                raise RuntimeError(f"the RaaS worker exited with {worker.returncode}: see {log.name}")
            await asyncio.sleep(0.2)
        for r in range(rounds):
            groups = [
                PromptGroup(
                    uid=f"r{r}g{i}",
                    workflow="rlvr",
                    models=["policy"],
                    n_samples=args.samples,
                    version=0,
                    sample=row,
                )
                for i, row in enumerate(rows("addition", args.groups))
            ]
            before = await bus.redis.xlen(bus.keys.rollouts)
            started = time.perf_counter()
            await bus.publish_many([Out(bus.keys.prompts, encode(g), f"p:{g.uid}") for g in groups])
            deadline = time.monotonic() + 300
            while await bus.redis.xlen(bus.keys.rollouts) < before + len(groups):
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise RuntimeError(f"the RaaS worker made no progress: see {log.name}")
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - started
            done = [decode(f, RolloutGroup) for _, f in await bus.redis.xrange(bus.keys.rollouts)][before:]
            rates.append(sum(int(t.loss_mask.sum()) for g in done for t in g.trajectories) / elapsed)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        await bus.close()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="hf,vllm" if importlib.util.find_spec("vllm") else "hf")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every contender")
    args = parse(ap, engines="hf", groups=2, samples=2, tokens=4, rounds=1)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny.build(Path(tmp) / "model"))
        server = redis_server.start(Path(tmp) / "redis")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        prompts = [
            tok.encode(r["prompt"]) for r in rows("addition", args.groups) for _ in range(args.samples)
        ]
        results = {}
        try:
            baseline = statistics.median(generate_in_child(model, prompts, args))
            for engine in args.engines.split(","):
                s = settings_for(engine, model, server.url, Path(tmp) / engine, args)
                s.run.path.mkdir(parents=True, exist_ok=True)
                raw_rates = raw_in_child(s, prompts, args.rounds)
                raas_rates = asyncio.run(through_raas(s, args, args.rounds))
                results[engine] = (statistics.median(raw_rates), statistics.median(raas_rates))
        finally:
            server.stop()
    print(
        f"RaaS throughput: {args.groups} groups x {args.samples} samples x {args.tokens} tokens, "
        f"{args.threads} thread(s), median of {args.rounds} rounds"
    )
    print(f"transformers generate (baseline): {baseline:.0f} tok/s")
    print(f"{'engine':<8}{'raw engine tok/s':>18}{'through RaaS tok/s':>20}{'RaaS/baseline':>15}")
    for engine, (r, w) in results.items():
        print(f"{engine:<8}{r:>18.0f}{w:>20.0f}{w / baseline:>15.2f}")


if __name__ == "__main__":
    main()
