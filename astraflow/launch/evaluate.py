"""Held-out greedy accuracy of a checkpoint on a built-in task (the launcher's eval)."""

from __future__ import annotations

from pathlib import Path

from astraflow.workflows.tasks import get_task, rows

HELD_OUT_SEED = 1_000_003
"""Seed of the held-out rows: apart from the training rows (seeded by run.seed)."""


class Evaluator:
    def __init__(self, model_dir: str, task: str, n: int = 200) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the launcher's terminal shows the run's progress only
        torch.set_num_threads(1)  # the launcher's process: leave the cores to the run
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
        self.task = get_task(task)
        self.rows = rows(task, n, seed=HELD_OUT_SEED)

    def accuracy(self, checkpoint: Path | None = None) -> float:
        """Share of held-out prompts whose greedy completion is exactly the answer."""
        import torch

        if checkpoint is not None:
            state = torch.load(checkpoint / "model.pt", weights_only=True)
            self.model.load_state_dict(state)
        tok = self.tokenizer
        batch = tok(
            [r["prompt"] for r in self.rows], return_tensors="pt", padding=True, add_special_tokens=False
        )
        with torch.no_grad():
            out = self.model.generate(
                **batch,
                do_sample=False,
                max_new_tokens=self.task.max_new_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        completions = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        right = sum(c.strip() == r["answer"] for c, r in zip(completions, self.rows, strict=True))
        return right / len(self.rows)
