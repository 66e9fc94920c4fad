"""What publication costs the trainer in one process (the time it is blocked before its next step), and
the bytes it serves: the previous path against the current one, in the same run, on the CPU.

A random Qwen2 model with Qwen2.5-0.5B's embedding (151,936 x 896, tied to `lm_head`, as the real one)
and `--layers` of its decoder layers, fp32 master weights, bf16 served:
- before: a host copy of the whole fp32 state (`to_host` as it was: one clone per name, so the tie broke
  and `lm_head.weight` was served as its own tensor), then the buffer casts it to bf16;
- now: `distributed.publication_state` (the live state, ties kept), then the buffer casts it.

    python tests/bench/publication_state.py [--layers 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from _smoke import parse
from transformers import Qwen2Config, Qwen2ForCausalLM

from astraflow.trainer import distributed
from astraflow.weights import layout
from astraflow.weights.buffer import DoubleBuffer

QWEN = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2
)
"""Qwen2.5-0.5B's dimensions."""
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)
"""`--smoke`: a tiny model of the same architecture."""


def clone_per_name(state: dict) -> dict:
    """The host copy publication took before: one fp32 clone per name (ties broken)."""
    return {k: v.detach().clone() for k, v in state.items()}


def blocked_s(model, take, root: Path, rounds: int) -> tuple[float, int]:
    """(median seconds from the state taken to the buffer written, served bytes)."""
    state = take(model)
    specs = layout.layout(state, "bfloat16")
    buffer = DoubleBuffer(root, specs)
    times = []
    try:
        for _ in range(rounds + 1):  # the first round warms the buffer's pages
            start = time.perf_counter()
            buffer.write_state(take(model))
            times.append(time.perf_counter() - start)
    finally:
        buffer.close()
    return statistics.median(times[1:]), layout.data_bytes(specs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parse(parser, layers=1, rounds=1)
    dims = TINY if args.smoke else QWEN
    config = Qwen2Config(**dims, num_hidden_layers=args.layers, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        before = blocked_s(model, lambda m: clone_per_name(m.state_dict()), Path(tmp) / "before", args.rounds)
        now = blocked_s(
            model, lambda m: distributed.publication_state(m, torch.bfloat16), Path(tmp) / "now", args.rounds
        )
    print(f"{'path':<8}{'blocked s':>11}{'served MiB':>12}")
    for name, (s, nbytes) in (("before", before), ("now", now)):
        print(f"{name:<8}{s:>11.3f}{nbytes / 2**20:>12.0f}")
    print(
        f"publication ({params / 1e6:.0f}M params, {args.layers} layers, one process, CPU):"
        f" trainer blocked {before[0] / now[0]:.2f}x shorter, {before[1] / now[1]:.2f}x fewer bytes served"
    )


if __name__ == "__main__":
    main()
