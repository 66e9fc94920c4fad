"""TRL's `GRPOTrainer` on the default recipe's settings: the library a user would reach for instead.

Same warm-started tiny model, tokenizer, task rows and seed as `plain_loop.py`, on every core, fp32:
16 prompts x 8 samples per step (temperature 1.0, 4 new tokens), exact-match reward, group-normalised
advantages, one PPO-clip step per generation (clip 0.2/0.2, token mean), no KL, AdamW (lr 2e-4, betas
(0.9, 0.99)), grad-norm clip 1.0. It stops when the 10-step moving average of the batch reward (TRL's
logged `reward`, the on-policy reward) reaches the target. Needs the `bench` extra
(`pip install -e ".[bench]"`).

    python tests/bench/trl_loop.py [--recipe recipes/addition-tiny.yaml] [--seed 0] [--json OUT]
                                   [--max-steps N] [--max-time S]

Prints one line per 100 steps and a summary; `--json` writes the per-step record for e2e.py.
"""

from __future__ import annotations

import tempfile
import time

STARTED = time.time()  # time to target counts from here: imports and model load included

from _smoke import parse  # noqa: E402
from plain_loop import load, loop_parser, save  # noqa: E402


def main() -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from astraflow.workflows.datasets import load_rows

    s, tok, model, _ = load(args.recipe, args.seed, args.threads)
    rows = load_rows(s.dataflow.dataset, s.run.seed)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    n, t = s.dataflow.feeder.n_samples, s.trainer

    def exact_match(prompts, completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    steps, rewards = [], []

    class Stop(TrainerCallback):
        """Records each step's reward and wall time; stops at the target or the limits."""

        def on_log(self, _args, state, control, logs=None, **_):
            if not logs or "reward" not in logs:
                return
            rewards.append(float(logs["reward"]))
            steps.append({"wall_s": time.time() - STARTED, "reward": rewards[-1]})
            window = rewards[-s.run.reward_window :]
            ma = sum(window) / len(window)
            if len(steps) % 100 == 0:
                print(f"step {len(steps)} {steps[-1]['wall_s']:.1f}s reward(ma) {ma:.3f}", flush=True)
            reached = len(rewards) >= s.run.reward_window and ma >= s.run.target_reward
            late = time.time() - STARTED >= args.max_time
            control.should_training_stop = reached or late or len(steps) >= (args.max_steps or 10**9)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="astraflow-bench-trl-"),
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        num_generations=n,
        per_device_train_batch_size=s.dataflow.batch.size,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=s.raas.sampling.max_new_tokens,
        temperature=s.raas.sampling.temperature,
        beta=0.0,
        epsilon=t.loss.clip_low,
        epsilon_high=t.loss.clip_high,
        loss_type="dapo",  # token mean over the batch's trained tokens, as astraflow's loss
        scale_rewards="group",
        learning_rate=t.lr,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=10**6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Stop()],
    )
    trainer.train()
    window = rewards[-s.run.reward_window :]
    reached = steps[-1]["wall_s"] if window and sum(window) / len(window) >= s.run.target_reward else None
    span = steps[-1]["wall_s"] - steps[0]["wall_s"] if len(steps) > 1 else 0.0
    print(
        f"trl GRPOTrainer: {len(steps)} steps, time to {s.run.target_reward}: "
        f"{'not reached' if reached is None else f'{reached:.1f}s'}; "
        f"{1000 * span / max(len(steps) - 1, 1):.1f} ms per step ({args.threads} threads)"
    )
    save(args, reached, steps)


if __name__ == "__main__":
    args = parse(loop_parser(), max_steps=2)
    main()
