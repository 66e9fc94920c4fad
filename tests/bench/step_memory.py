"""Peak memory of a trainer step: the lm_head's logits a few thousand positions at a time (`trainer.head`)
against all of a micro-batch's at once.

A random-weight Qwen2 model of a small body and the real vocabulary (151,936) takes one `PolicyTrainer`
step on one micro-batch of `--tokens` tokens at the gsm8k recipe's trainer settings (bf16 compute through
autocast, gradient checkpointing, AdamW), in a fresh process per variant: `whole` sets the head's chunk to
the whole micro-batch (its logits and their gradient exist at once, as when the model returned them),
`chunked` keeps the default. Shown: the process's peak resident memory above what it held before the step
(getrusage's high-water mark; AdamW's state and the gradients are allocated in the step, alike in both),
the logits of the micro-batch in bf16 for scale, and the ratio whole / chunked. CPU only: on a GPU the
same step's peak is `torch.cuda.max_memory_allocated` (the step's `peak_memory_gib` metric).

    python tests/bench/step_memory.py [--tokens 8192] [--vocab 151936] [--hidden 128]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from _smoke import parse

GIB = 2**30


def child(variant: str, tokens: int, vocab: int, hidden: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from astraflow.trainer import head
    from astraflow.trainer.settings import TrainerSettings
    from astraflow.trainer.step import PolicyTrainer
    from tests.gpu.checks import rollout_batch

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant == "whole":
        head.HEAD_CHUNK_ROWS = tokens
    seq = min(512, tokens)  # sequences of the gsm8k shape: a quarter prompt, the rest trained
    batch = rollout_batch(1, tokens // seq, seq // 4, seq - seq // 4, vocab)
    settings = TrainerSettings(dtype="bfloat16", gradient_checkpointing=True, micro_batch_tokens=tokens)
    trainer = PolicyTrainer(model, settings)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    stats = trainer.step(batch)
    return {
        "extra_gib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / GIB,
        "s": time.perf_counter() - started,
        "loss": stats["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--child", metavar="VARIANT")
    args = parse(ap, tokens=1024, vocab=4096, hidden=64)
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden)))
        return
    logits = args.tokens * args.vocab * 2 / GIB
    print(f"one micro-batch of {args.tokens} tokens x {args.vocab} vocabulary: bf16 logits {logits:.2f} GiB")
    runs = {}
    for variant in ("whole", "chunked"):
        cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--vocab", str(args.vocab)]
        cmd += ["--hidden", str(args.hidden), "--child", variant]
        runs[variant] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    whole, chunked = runs["whole"], runs["chunked"]
    assert abs(whole["loss"] - chunked["loss"]) <= 1e-3 * max(abs(whole["loss"]), 1e-6), runs
    ratio = whole["extra_gib"] / max(chunked["extra_gib"], 1e-9)
    print(
        f"step peak above the model: whole logits {whole['extra_gib']:.2f} GiB, chunked"
        f" {chunked['extra_gib']:.2f} GiB ({ratio:.1f}x); step {whole['s']:.1f} s vs {chunked['s']:.1f} s"
    )


if __name__ == "__main__":
    main()
