"""Held-out greedy accuracy of a checkpoint on a built-in task (the launcher's eval)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from astraflow.config import Settings
from astraflow.launch.progress import Progress
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


class PeriodicEval:
    """Held-out greedy accuracy of the latest checkpoint, in a thread, every `run.eval_every_s`."""

    def __init__(self, settings: Settings, progress: Progress) -> None:
        self.settings, self.progress = settings, progress
        ds = settings.dataflow.dataset
        # Greedy single-turn decoding cannot measure an episode that calls a tool.
        single_turn = settings.dataflow.feeder.workflow != "multi_turn"
        self.task = ds.task if ds.type == "task" and single_turn else None
        self._thread: threading.Thread | None = None
        self._last = 0.0
        self._evaluator = None

    def _checkpoint(self) -> Path | None:
        from astraflow.trainer import checkpoint

        model = self.settings.trained[0]
        root = (
            self.settings.policy(model).trainer.checkpoint_dir
            or self.settings.run.path / "checkpoints" / model
        )
        return checkpoint.latest(root)

    def _run(self) -> None:
        path = self._checkpoint()
        if self.task is None or (path is None and self.progress.evals):
            return
        if self._evaluator is None:
            self._evaluator = Evaluator(
                self.settings.policy(self.settings.trained[0]).trainer.model, self.task
            )
        try:  # no checkpoint yet: the starting weights, as version 0
            version = int(json.loads((path / "meta.json").read_text())["version"]) if path else 0
            accuracy = self._evaluator.accuracy(path)
        except FileNotFoundError:  # the trainer rotated that checkpoint away meanwhile: next time
            return
        self.progress.evals.append((version, time.time() - self.progress.started, accuracy))

    def maybe_start(self) -> None:
        busy = self._thread is not None and self._thread.is_alive()
        if busy or self.task is None or time.monotonic() - self._last < self.settings.run.eval_every_s:
            return
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def final(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.task is not None:
            self._run()
