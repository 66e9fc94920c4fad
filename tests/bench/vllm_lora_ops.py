"""vLLM-CPU's LoRA ops: `astraflow.engines.vllm_lora_ops` against vLLM's own torch ops, same inputs.

One forward pass's worth of LoRA work at a model's shape: for every layer and each adapted projection
(q, k, v, o, gate, up, down), the shrink (hidden -> rank) and the expand (rank -> out) of `--tokens`
tokens, their adapters drawn from `--adapters` slots (1: every token on the newest, as in a run between
versions; 2: a batch straddling a version). Rounds alternate between the two implementations; the median
time of a pass each, and vLLM's over ours.

    python tests/bench/vllm_lora_ops.py [--shape tiny|qwen2.5-0.5b] [--tokens 128 1280] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _smoke import parse
from vllm.lora.ops.torch_ops import lora_ops

from astraflow.engines import vllm_lora_ops

SHAPES = {  # hidden, intermediate, q out, kv out, layers, vLLM's rank slot
    "tiny": (128, 512, 128, 128, 4, 8),  # the LoRA recipe's model and rank 4 (vLLM takes 8)
    "qwen2.5-0.5b": (896, 4864, 896, 128, 24, 16),
}


def projections(shape: str) -> list[tuple[int, int]]:
    hidden, inter, q, kv, layers, _ = SHAPES[shape]
    return [
        (hidden, q),
        (hidden, kv),
        (hidden, kv),
        (q, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ] * layers


def one_pass(ops: dict, work: list, indices: torch.Tensor) -> float:
    start = time.perf_counter()
    for x, a, b, low, out in work:
        ops["bgmv_shrink"](x, a, low, indices, 1.0)
        ops["bgmv_expand"](low, b, out, indices, True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1280])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parse(parser, rounds=1, tokens=[32])
    torch.set_num_threads(args.threads)
    rank, slots = SHAPES[args.shape][-1], 4
    theirs = {name: getattr(lora_ops, name) for name in vllm_lora_ops.OPS}
    print(f"shape {args.shape}, rank slot {rank}, {args.threads} thread(s), median of {args.rounds} rounds")
    print(f"{'tokens':>7} {'adapters':>8} | {'vllm ms':>9} {'ours ms':>9} {'vllm/ours':>9}")
    for tokens in args.tokens:
        work = [
            (
                torch.randn(tokens, fan_in),
                torch.randn(slots, 1, rank, fan_in) / fan_in**0.5,
                torch.randn(slots, 1, fan_out, rank),
                torch.zeros(tokens, rank),
                torch.zeros(tokens, fan_out),
            )
            for fan_in, fan_out in projections(args.shape)
        ]
        for adapters in args.adapters:
            indices = torch.arange(tokens) * adapters // tokens  # contiguous runs, as requests are laid out
            times: dict[str, list[float]] = {"vllm": [], "ours": []}
            for _ in range(args.rounds):
                times["vllm"].append(one_pass(theirs, work, indices))
                times["ours"].append(one_pass(vllm_lora_ops.OPS, work, indices))
            v, o = (statistics.median(times[k]) * 1e3 for k in ("vllm", "ours"))
            print(f"{tokens:>7} {adapters:>8} | {v:>9.2f} {o:>9.2f} {v / o:>8.2f}x")


if __name__ == "__main__":
    main()
