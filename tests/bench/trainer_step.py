"""A trainer step against the plain loop's step, on the same batch and the same threads.

The batch is what the default recipe trains: 16 prompts of its dataset x 8 samples from its cached model,
random advantages (they change the numbers, not the work). Plain: `plain_loop.train_step` (one forward, the
PPO-clip loss, backward, grad clip, AdamW). astraflow: `PolicyTrainer.step` on the same sequences as a
`Batch` (unpacking, micro-batching, the loss family, statistics). Rounds alternate; medians are shown.

    python tests/bench/trainer_step.py [--threads 1,2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _smoke import parse
from plain_loop import generate, load, train_step

from astraflow.messages import Batch, RolloutGroup, SampleGroup, Trajectory, pack
from astraflow.trainer.step import PolicyTrainer
from astraflow.workflows.datasets import load_rows


def as_batch(out, width: int, completion, mask, adv, n: int) -> Batch:
    """The sampled sequences as the dataflow hands them to a trainer (behaviour logprobs: zeros; they
    only move the ratio, not the work)."""
    groups = []
    for g in range(len(out) // n):
        trajs = []
        for i in range(g * n, (g + 1) * n):
            c = int(mask[i].sum())
            tokens = out[i, : width + c].numpy().astype(np.int32)
            loss = np.concatenate([np.zeros(width, np.uint8), np.ones(c, np.uint8)])
            versions = np.where(loss == 1, 0, -1).astype(np.int32)
            trajs.append(Trajectory("policy", tokens, np.zeros(len(tokens), np.float32), loss, versions, 0.0))
        rollout = pack(RolloutGroup(uid=f"g{g}", raas="bench", version=0, trajectories=trajs))
        a = adv[g * n : (g + 1) * n].numpy().astype(np.float32)
        groups.append(SampleGroup(f"g{g}", "policy", 0, 0, rollout, list(range(n)), a))
    return Batch(uid="policy:1", model="policy", version=0, groups=groups)


def main() -> None:
    print(f"{'threads':>7} {'plain ms':>9} {'astraflow ms':>13} {'astraflow/plain':>16}")
    for threads in [int(t) for t in args.threads.split(",")]:
        s, tok, model, optim = load(args.recipe, 0, threads)
        n, prompts = s.dataflow.feeder.n_samples, s.dataflow.batch.size // s.dataflow.feeder.n_samples
        sampling, t = s.raas.sampling, s.trainer
        rows = load_rows(s.dataflow.dataset, 0)[:prompts]  # the dataset's prompts: 16 different ones
        out, width, attention, completion, mask = generate(
            model, tok, [r["prompt"] for r in rows], n, sampling.temperature, sampling.max_new_tokens
        )
        adv = torch.randn(len(out))
        batch = as_batch(out, width, completion, mask, adv, n)
        plain_model, plain_optim = model, optim
        trainer = PolicyTrainer(copy.deepcopy(model), t, pad_id=tok.pad_token_id)
        plain, ours = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            train_step(
                plain_model, plain_optim, out, width, attention, completion, mask, adv,
                t.loss.clip_low, t.loss.clip_high, t.grad_clip,
            )  # fmt: skip
            plain.append(time.perf_counter() - started)
            started = time.perf_counter()
            trainer.step(batch)
            ours.append(time.perf_counter() - started)
        p, o = statistics.median(plain[2:]), statistics.median(ours[2:])  # the first rounds warm up
        print(f"{threads:7d} {1000 * p:9.1f} {1000 * o:13.1f} {o / p:16.2f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/addition-tiny.yaml")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=30)
    args = parse(parser, threads="1", rounds=3)
    main()
