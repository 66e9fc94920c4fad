"""The hf engine's generation against a plain `model.generate` of the same requests, same device and threads.

A random Qwen2-shaped model is built locally (`--vocab`: 512 like the tiny recipe, or the Qwen2.5
vocabulary of 151,936, where sampling over the vocabulary matters). `--requests` prompts of
`--prompt-tokens` tokens each generate `--new-tokens` tokens at temperature 1 (and optionally top-k 50 /
top-p 0.9): once as concurrent `HFEngine.generate` calls (one batch), once as one left-padded
`model.generate(do_sample=True)`. Rounds alternate; medians of generated tokens per second are shown.

    python tests/bench/hf_generate.py [--vocab 151936] [--requests 32] [--rounds 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch
from _smoke import parse

from astraflow import tiny
from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.hf import HFEngine
from astraflow.engines.settings import EngineSettings


async def engine_round(
    engine: HFEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[int, float]:
    started = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(GenerateRequest(p, params)) for p in prompts])
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - started


def plain_round(
    model, prompts: list[list[int]], params: SamplingParams, pad: int, eos: int
) -> tuple[int, float]:
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=params.temperature,
            top_k=params.top_k or None,
            top_p=params.top_p,
            max_new_tokens=params.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    elapsed = time.perf_counter() - started
    new = out[:, width:].tolist()
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in new), elapsed


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = parse(ap, vocab=512, requests=4, prompt_tokens=8, new_tokens=8, rounds=1)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(tiny.build(tmp, vocab_size=args.vocab))
        settings = EngineSettings(
            type="hf", model=path, device=args.device, max_batch=args.requests, max_model_len=512
        )
        engine = HFEngine(settings)
        await engine.start()
        model, eos = engine.model, next(iter(engine.eos_ids))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, args.vocab, (args.prompt_tokens,), generator=g).tolist()]
        prompts += [torch.randint(10, args.vocab, (args.prompt_tokens,), generator=g).tolist()
                    for _ in range(args.requests - 1)]  # fmt: skip
        print(
            f"vocab {args.vocab}, {args.requests} requests x {args.prompt_tokens} prompt + {args.new_tokens}"
            f" new tokens, {args.device}, {args.threads} threads, median of {args.rounds} rounds"
        )
        print(f"{'sampling':>22} | {'engine tok/s':>12} {'generate tok/s':>14} {'ratio':>6}")
        for name, params in (
            ("temperature 1", SamplingParams(max_new_tokens=args.new_tokens)),
            ("top-k 50, top-p 0.9", SamplingParams(max_new_tokens=args.new_tokens, top_k=50, top_p=0.9)),
        ):
            rates: dict[str, list[float]] = {"engine": [], "plain": []}
            await engine_round(engine, prompts[:2], params)  # warm-up
            for _ in range(args.rounds):
                n, s = await engine_round(engine, prompts, params)
                rates["engine"].append(n / s)
                n, s = plain_round(model, prompts, params, engine.pad_id, eos)
                rates["plain"].append(n / s)
            e, p = statistics.median(rates["engine"]), statistics.median(rates["plain"])
            print(f"{name:>22} | {e:12.1f} {p:14.1f} {e / p:5.2f}x")
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
