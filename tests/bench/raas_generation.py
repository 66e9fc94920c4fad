"""RaaS generation as the pipeline does it, against one batched `generate` of the same requests.

The default recipe's RaaS (`addition-tiny`: its engine, `raas.slots`, sampling and tiny model, warm-started
as `astraflow run` builds it) runs as its own worker process on a real Redis. A feeder here keeps
`feeder.backlog_factor` x `raas.slots` prompt groups of `feeder.n_samples` samples outstanding (in flight
or waiting in `prompts`), as the dataflow's feeder does: a new group goes out as each rollout group comes
back, so groups reach the engine one by one as slots free up. Rows are the recipe's task rows, in order.
Timed from the first prompt group to the last rollout group (rewards and Redis included).

Baseline: in a fresh process on the same number of torch threads, `transformers` `model.generate` of the
same requests, `raas.slots` groups (slots x samples sequences, left-padded) per call: the plain loop's
batched generate, same max new tokens and temperature. Both processes start once; after a warm-up round
each, their rounds alternate (the machine's noise falls on both). Medians are shown, the ratio per torch
thread (both sides run `engine.threads` threads), and the engine's batching (mean requests and prompts
prefilled per batch).

    python tests/bench/raas_generation.py [--groups 160] [--rounds 8] [--set engine.max_batch=64] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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
from astraflow.launch.tiny_cache import build_tiny
from astraflow.messages import PromptGroup, RolloutGroup, decode, encode
from astraflow.settings_load import load_settings, to_env
from astraflow.streams import Bus, Out
from astraflow.workflows.tasks import rows

RECIPE = "addition-tiny"


def recipe(model: Path, url: str, run_dir: Path, overrides: list[str]) -> Settings:
    s = load_settings(RECIPE, overrides)
    s.run.name, s.run.dir, s.run.tiny = "bench-raas-generation", run_dir, None
    s.redis.url = url
    s.engine.model = str(model)
    s.raas.id = "bench-raas"
    return s


def model_dir(smoke: bool, tmp: Path) -> Path:
    """The recipe's tiny model: warm-started and cached as `astraflow run` builds it; random for --smoke."""
    t = load_settings(RECIPE).run.tiny
    assert t is not None
    if not smoke:
        return build_tiny(load_settings(RECIPE)) or t.path
    dims = dict(hidden=t.hidden, layers=t.layers, heads=t.heads, kv_heads=t.kv_heads)
    return tiny.build(tmp / "model", tokenizer_kind=t.tokenizer, intermediate=t.intermediate, **dims)


def task_rows(s: Settings, n: int) -> list[dict]:
    return rows(s.dataflow.dataset.task, n)


async def compare(s: Settings, model: Path, groups: int, rounds: int) -> tuple[list, list, dict]:
    """Samples/s of one RaaS worker process and of one baseline process, both started once, in
    alternating rounds (after a warm-up round each), and the worker's engine batching stats (from its
    last log line)."""
    bus = Bus.connect(s.redis.url or "", s.run.name, s.redis, s.streams)
    await bus.bootstrap(["policy"])
    log = open(s.run.path / "raas.log", "wb")
    env = {**os.environ, **to_env(s)}
    worker = subprocess.Popen([sys.executable, "-m", "workers.raas"], env=env, stdout=log, stderr=log)
    plain, piped = [], []
    try:
        with mp.get_context("spawn").Pool(1) as pool:
            while not await bus.redis.exists(bus.keys.raas(s.raas.id)):
                if worker.poll() is not None:
                    raise RuntimeError(f"the RaaS worker exited with {worker.returncode}: see {log.name}")
                await asyncio.sleep(0.2)
            await feed(bus, s, "warm", max(groups, 2 * s.raas.slots), worker)
            pool.apply(_generate, (str(model), s, groups))
            for r in range(rounds):
                plain.append(pool.apply(_generate, (str(model), s, groups)))
                piped.append(await feed(bus, s, f"r{r}", groups, worker))
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        await bus.close()
    stopped = [json.loads(line) for line in open(log.name) if '"raas_stopped"' in line]
    return plain, piped, stopped[-1]["engines"]["policy"] if stopped else {}


async def feed(bus: Bus, s: Settings, tag: str, n: int, worker: subprocess.Popen) -> float:
    """Publish `n` groups keeping as many outstanding as the dataflow's feeder would for this worker;
    samples/s from the first publish to the last rollout group back."""
    f = s.dataflow.feeder
    samples, outstanding = f.n_samples, max(f.min_backlog, math.ceil(f.backlog_factor * s.raas.slots))

    def group(i: int, row: dict) -> Out:
        g = PromptGroup(
            uid=f"{tag}g{i}", workflow="rlvr", models=["policy"], n_samples=samples, version=0, sample=row
        )
        return Out(bus.keys.prompts, encode(g), f"p:{g.uid}")

    pending = [group(i, row) for i, row in enumerate(task_rows(s, n))]
    last = (await bus.redis.xinfo_stream(bus.keys.rollouts))["last-generated-id"] or "0-0"
    started = time.perf_counter()
    await bus.publish_many(pending[:outstanding])
    sent, back, generated = min(outstanding, n), 0, 0
    while back < n:
        got = await bus.redis.xread({bus.keys.rollouts: last}, block=1000)
        if not got:
            if worker.poll() is not None:
                raise RuntimeError(f"the RaaS worker exited with {worker.returncode}")
            continue
        entries = got[0][1]
        last, back = entries[-1][0], back + len(entries)
        generated += sum(len(decode(f, RolloutGroup).trajectories) for _, f in entries)
        more = pending[sent : sent + len(entries)]
        if more:
            await bus.publish_many(more)
            sent += len(more)
    return generated / (time.perf_counter() - started)


_loaded: dict = {}
"""The baseline process's model and tokenizer, loaded at its first round."""


def _generate(model_dir: str, s: Settings, groups: int) -> float:
    """One round of the baseline, in its own process (the worker is one too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not _loaded:
        torch.set_num_threads(s.engine.threads)
        _loaded["tok"] = AutoTokenizer.from_pretrained(model_dir)
        _loaded["model"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok, model = _loaded["tok"], _loaded["model"]
    n, per_call = s.dataflow.feeder.n_samples, s.raas.slots
    prompts = [tok.encode(r["prompt"]) for r in task_rows(s, groups)]
    calls = [prompts[i : i + per_call] for i in range(0, len(prompts), per_call)]

    def run(batch: list[list[int]]) -> int:
        batch = [p for p in batch for _ in range(n)]
        width = max(map(len, batch))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=s.raas.sampling.temperature,
                top_k=None, top_p=None, max_new_tokens=s.raas.sampling.max_new_tokens,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        return len(batch)

    started = time.perf_counter()
    generated = sum(run(c) for c in calls)
    return generated / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=160, help="prompt groups per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], help="a recipe override, e.g. engine.max_batch=64")
    args = parse(ap, groups=32, rounds=1)  # and a random model
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.smoke, Path(tmp))
        server = redis_server.start(Path(tmp) / "redis")
        try:
            s = recipe(model, server.url, Path(tmp) / "run", args.set)
            s.run.path.mkdir(parents=True, exist_ok=True)
            plain, piped, stats = asyncio.run(compare(s, model, args.groups, args.rounds))
        finally:
            server.stop()
    threads, p, g = s.engine.threads, statistics.median(piped), statistics.median(plain)
    print(
        f"RaaS generation ({RECIPE}): {args.groups} groups x {s.dataflow.feeder.n_samples} samples x "
        f"<= {s.raas.sampling.max_new_tokens} tokens, {s.raas.slots} slots, {threads} torch thread(s), "
        f"median of {args.rounds} round(s)"
    )
    print(f"transformers generate ({s.raas.slots} groups/call): {g:.0f} samples/s, {g / threads:.0f}/thread")
    print(f"pipeline (RaaS worker, {s.engine.type} engine): {p:.0f} samples/s, {p / threads:.0f}/thread")
    if stats.get("batches"):
        per = stats["batches"]
        print(
            f"pipeline batches (all rounds): {stats['requests'] / per:.0f} requests "
            f"(max {stats['max_batch']}), {stats.get('prefilled', stats['requests']) / per:.1f} prompts "
            "prefilled"
        )
    print(f"raas generation: pipeline/generate {p / g:.2f} per thread")


if __name__ == "__main__":
    main()
