"""Peak memory of the trainer's logprobs: the whole-vocabulary float32 log-softmax against the chunked one.

For logits of `--tokens` positions over a `--vocab`-token vocabulary (151,936: the Qwen2.5 vocabulary) in
bf16 and in float32, each variant runs in a fresh process: logprobs of the targets and the entropy
(forward), then the backward of an advantage-weighted sum, as a training step does. Shown: the peak
resident memory above what the process held once the logits existed (getrusage's high-water mark), of
which the logits' gradient (as large as the logits, in their dtype) is needed by any path; the
transient rest is the second pair of columns; then the time of forward + backward. Ratios: old / new.

    python tests/bench/logprob_memory.py [--tokens 2048] [--vocab 151936] [--chunk-rows 512]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from _smoke import parse

from astraflow.trainer.batching import LOGPROB_CHUNK_ROWS

GB = 1e9


def child(variant: str, tokens: int, vocab: int, dtype_name: str, chunk_rows: int) -> dict:
    import torch

    from astraflow.trainer.batching import target_logprobs

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    logits = torch.empty(tokens, vocab, dtype=dtype)
    for a in range(0, tokens, 64):  # filled in slices: no transient float32 copy of the whole
        logits[a : a + 64] = 3 * torch.randn(min(64, tokens - a), vocab)
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    adv = torch.randn(tokens)
    before = _peak_bytes()
    started = time.perf_counter()
    if variant == "old":  # the trainer's path before: the whole micro-batch in float32
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    else:
        logp, entropy = target_logprobs(logits, targets, with_entropy=True, chunk_rows=chunk_rows)
    (logp * adv).sum().backward()
    elapsed = time.perf_counter() - started
    return {
        "extra_gb": (_peak_bytes() - before) / GB,
        "logits_gb": logits.numel() * logits.element_size() / GB,
        "s": elapsed,
        "check": float(logp.detach().sum() + entropy.sum() + logits.grad.float().abs().sum()),
    }


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--chunk-rows", type=int, default=LOGPROB_CHUNK_ROWS)
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "DTYPE"))
    args = parse(ap, tokens=64, vocab=1024, chunk_rows=16)
    if args.child:
        print(json.dumps(child(*args.child[:1], args.tokens, args.vocab, args.child[1], args.chunk_rows)))
        return
    print(f"{args.tokens} positions x {args.vocab} vocabulary, chunks of {args.chunk_rows} positions")
    print(
        f"{'logits':>8} {'GB':>5} | {'old +GB':>7} {'new +GB':>7} | {'old transient':>13}"
        f" {'new transient':>13} {'ratio':>6} | {'old s':>5} {'new s':>5}"
    )
    for dtype in ("bfloat16", "float32"):
        runs = {}
        for variant in ("old", "new"):
            cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--vocab", str(args.vocab)]
            cmd += ["--chunk-rows", str(args.chunk_rows), "--child", variant, dtype]
            runs[variant] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        old, new = runs["old"], runs["new"]
        assert abs(old["check"] - new["check"]) <= 1e-3 * abs(old["check"]), (old, new)
        grad = old["logits_gb"]
        t_old, t_new = old["extra_gb"] - grad, new["extra_gb"] - grad
        print(
            f"{dtype:>8} {grad:5.2f} | {old['extra_gb']:7.2f} {new['extra_gb']:7.2f} | {t_old:13.2f}"
            f" {t_new:13.2f} {t_old / max(t_new, 1e-9):5.1f}x | {old['s']:5.2f} {new['s']:5.2f}"
        )


if __name__ == "__main__":
    main()
