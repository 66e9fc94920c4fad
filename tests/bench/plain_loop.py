"""The honest baseline: a plain in-process synchronous GRPO loop on the default recipe's settings.

What a user would write instead of astraflow: one batched `transformers` `generate` of 16 prompts x 8
samples (temperature 1.0, 4 new tokens), exact-match reward, group-normalised advantages, one PPO-clip
AdamW step (clip 0.2, no KL, lr 2e-4, betas (0.9, 0.99), grad-norm clip 1.0), on the recipe's cached
tiny model, its dataset (same rows, same shuffle) and seed, on every core. It stops when the 10-step
moving average of the batch reward (the on-policy reward) reaches the target. No astraflow engine,
trainer, Redis or process: only the recipe's settings and its cached model are taken from astraflow.

    python tests/bench/plain_loop.py [--recipe recipes/addition-tiny.yaml] [--seed 0] [--json OUT]
                                     [--max-steps N] [--dynamic-sampling]

With `--dynamic-sampling` it is the same algorithm as astraflow's default: it samples batches of 16
prompt groups until it holds 16 informative ones (rewards not all equal; the collector drops the others),
trains on those and drops the surplus, so each step stays on-policy.

Prints one line per 100 steps and a summary; `--json` writes the per-step record for e2e.py.
"""

from __future__ import annotations

import argparse
import json
import random
import time

STARTED = time.time()  # time to target counts from here: imports and model load included

import torch  # noqa: E402
from _smoke import parse  # noqa: E402


def generate(model, tok, prompts: list[str], n: int, temperature: float, max_new_tokens: int):
    """One batched `generate` of `n` samples per prompt: (sequences, prompt width, attention mask of the
    sequences, completion tokens, mask of the trained completion tokens: up to and including eos)."""
    prompt = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(
            **prompt,
            do_sample=True,
            temperature=temperature,
            top_k=None,
            top_p=None,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            pad_token_id=tok.pad_token_id,
        )
    width = prompt["input_ids"].shape[1]
    completion = out[:, width:]
    eos = (completion == tok.eos_token_id).int()
    mask = (eos.cumsum(1) - eos) == 0
    attention = torch.cat([prompt["attention_mask"].repeat_interleave(n, 0), mask.long()], 1)
    return out, width, attention, completion, mask


def collate(tok, prompts: list[str], completion, mask, n: int):
    """The batch `generate` returns, for `prompts` and their completions gathered from several
    `generate` calls (completions padded to one width): (sequences, prompt width, attention)."""
    prompt = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    ids = prompt["input_ids"].repeat_interleave(n, 0)
    attention = torch.cat([prompt["attention_mask"].repeat_interleave(n, 0), mask.long()], 1)
    return torch.cat([ids, completion], 1), ids.shape[1], attention


def sample(model, tok, rows: list[dict], n: int, sampling) -> tuple:
    """`n` samples of each row's prompt and their exact-match rewards: (completion ids padded to
    `max_new_tokens`, trained-token mask, rewards as [rows, n]), with the sequences of this one call."""
    prompts = [r["prompt"] for r in rows]
    out, width, attention, completion, mask = generate(
        model, tok, prompts, n, sampling.temperature, sampling.max_new_tokens
    )
    texts = tok.batch_decode(completion, skip_special_tokens=True)
    answers = [r["answer"] for r in rows for _ in range(n)]
    reward = torch.tensor([float(c.strip() == a) for c, a in zip(texts, answers, strict=True)])
    return out, width, attention, completion, mask, reward.view(-1, n)


def train_step(model, optim, out, width, attention, completion, mask, adv, clip_low, clip_high, grad_clip):
    """One PPO-clip step on the sampled batch (token mean over the trained tokens)."""
    logits = model(input_ids=out, attention_mask=attention).logits[:, width - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())  # on-policy: the sampling weights are these weights
    a = adv[:, None]
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))
    loss = (loss * mask).sum() / mask.sum()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optim.step()


def load(recipe: str, seed: int, threads: int):
    """(settings, tokenizer, model, optimizer) of the recipe, on its cached tiny model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow.launch.tiny_cache import build_tiny
    from astraflow.settings_load import load_settings

    s = load_settings(recipe, [f"run.seed={seed}"])
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    build_tiny(s)
    path = s.policy(s.trained[0]).trainer.model
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    t = s.trainer
    optim = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    return s, tok, model, optim


def main() -> None:
    from astraflow.workflows.datasets import load_rows

    s, tok, model, optim = load(args.recipe, args.seed, args.threads)
    rows = load_rows(s.dataflow.dataset, s.run.seed)
    order = list(range(len(rows)))
    random.Random(f"{s.run.seed}:0").shuffle(order)  # the feeder's first epoch
    n, prompts_per_step = s.dataflow.feeder.n_samples, s.dataflow.batch.size // s.dataflow.feeder.n_samples
    t, sampling = s.trainer, s.raas.sampling
    steps, rewards, cursor, ma = [], [], 0, 0.0
    while time.time() - STARTED < args.max_time and len(steps) < (args.max_steps or float("inf")):
        t0 = time.perf_counter()
        kept, generated, step_rewards = [], 0, []
        while len(kept) < prompts_per_step and time.time() - STARTED < args.max_time:  # once, or until
            # the batch holds `prompts_per_step` informative groups (`--dynamic-sampling`)
            batch = [rows[order[(cursor + i) % len(rows)]] for i in range(prompts_per_step)]
            cursor += prompts_per_step
            out, width, attention, completion, mask, g = sample(model, tok, batch, n, sampling)
            generated += g.numel()
            step_rewards.append(g)
            if not args.dynamic_sampling:
                break
            pad = sampling.max_new_tokens - completion.shape[1]  # generate stops at the longest
            completion = torch.nn.functional.pad(completion, (0, pad), value=tok.pad_token_id)
            mask = torch.nn.functional.pad(mask, (0, pad), value=False)
            for i in torch.nonzero(g.std(1) > 0).flatten().tolist():
                rows_i = slice(i * n, (i + 1) * n)
                kept.append((batch[i]["prompt"], completion[rows_i], mask[rows_i], g[i]))
        if args.dynamic_sampling:  # the first `prompts_per_step` informative groups; the rest are dropped
            if len(kept) < prompts_per_step:
                break  # out of time
            kept = kept[:prompts_per_step]
            completion, mask = (torch.cat([k[j] for k in kept]) for j in (1, 2))
            out, width, attention = collate(tok, [k[0] for k in kept], completion, mask, n)
            g = torch.stack([k[3] for k in kept])
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)
        t1 = time.perf_counter()
        train_step(
            model, optim, out, width, attention, completion, mask, adv,
            t.loss.clip_low, t.loss.clip_high, t.grad_clip,
        )  # fmt: skip
        t2 = time.perf_counter()
        rewards.append(float(torch.cat(step_rewards).mean()))  # every sample generated: on-policy
        window = rewards[-s.run.reward_window :]
        ma = sum(window) / len(window)
        steps.append(
            {
                "wall_s": time.time() - STARTED,
                "reward": rewards[-1],
                "gen_s": t1 - t0,
                "train_s": t2 - t1,
                "generated": generated,
                "trained": adv.numel(),
            }
        )
        if len(steps) % 100 == 0:
            print(f"step {len(steps)} {steps[-1]['wall_s']:.1f}s reward(ma) {ma:.3f}", flush=True)
        if len(rewards) >= s.run.reward_window and ma >= s.run.target_reward:
            break
    reached = steps[-1]["wall_s"] if ma >= s.run.target_reward else None
    gen, train = (sum(x[k] for x in steps) / len(steps) for k in ("gen_s", "train_s"))
    waste = sum(x["generated"] for x in steps) / sum(x["trained"] for x in steps)
    name = "plain loop + dynamic sampling" if args.dynamic_sampling else "plain loop"
    print(
        f"{name}: {len(steps)} steps, time to {s.run.target_reward}: "
        f"{'not reached' if reached is None else f'{reached:.1f}s'}; per step generate {1000 * gen:.1f} ms,"
        f" train {1000 * train:.1f} ms; {waste:.2f} samples generated per trained ({args.threads} threads)"
    )
    save(args, reached, steps)


def save(args: argparse.Namespace, reached: float | None, steps: list[dict]) -> None:
    """The per-step record e2e.py reads, to `--json` if given."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"time_to_target_s": reached, "threads": args.threads, "steps": steps}, f)


def loop_parser() -> argparse.ArgumentParser:
    """The flags every in-process contender takes (this loop and trl_loop.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/addition-tiny.yaml")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-time", type=float, default=1200.0)
    parser.add_argument("--json", help="write the per-step record here")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps (default: no limit)")
    return parser


if __name__ == "__main__":
    parser = loop_parser()
    parser.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="sample until the batch holds its groups' count of informative (not all-equal) groups",
    )
    args = parse(parser, max_steps=2)
    main()
