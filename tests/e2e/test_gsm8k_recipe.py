"""`recipes/gsm8k-qwen.yaml` on the CPU, the tiny model standing in for the real one: its settings load
and validate, its data path (GSM8K jsonl, chat template, the `gsm8k` reward) runs end to end through
`astraflow run`, and the trainer's bf16 and gradient-checkpointing settings train on the CPU."""

import json
from pathlib import Path

import pytest

from astraflow.config import load_settings
from tests.e2e.test_launcher import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
RECIPE = "recipes/gsm8k-qwen.yaml"
PROBLEMS = [  # GSM8K's format: a question, and a worked solution ending in "#### <number>"
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
    ("A box holds 6 eggs. How many eggs are in 5 boxes?", "6 * 5 = 30\n#### 30"),
    (
        "Sara read 12 pages on Monday and twice as many on Tuesday. How many pages in all?",
        "12+24=36\n#### 36",
    ),
    ("A pen costs 2 dollars. How much do 9 pens cost?", "2 * 9 = 18\n#### 18"),
]


def test_the_recipe_targets_two_gpus_and_loads_without_one(tmp_path, monkeypatch):
    recipe = Path(RECIPE).resolve()
    monkeypatch.chdir(tmp_path)  # where its user put the weights and data it names
    (tmp_path / "models" / "Qwen2.5-1.5B-Instruct").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k" / "train.jsonl").touch()
    s = load_settings(recipe)
    policy = s.policy("policy")
    assert (policy.engine.type, policy.engine.device, policy.engine.devices) == ("vllm", "cuda", "1")
    assert (policy.trainer.device, policy.trainer.devices, policy.trainer.dtype) == ("cuda", "0", "bfloat16")
    assert s.raas.workflow_options["reward"] == "gsm8k"


def test_the_recipe_data_path_trains_on_the_cpu_with_the_tiny_model(tmp_path, tiny_model):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS * 4))
    summary = run(
        tmp_path / "run",
        "gsm8k",
        f"engine.model={tiny_model}",
        "engine.device=cpu",
        "engine.devices=",
        "engine.max_model_len=256",
        "trainer.device=cpu",
        "trainer.devices=",
        f"dataflow.dataset.path={data}",
        "dataflow.collector.dynamic_sampling=false",  # the random tiny model scores 0 everywhere
        "dataflow.batch.size=16",
        "raas.slots=8",
        "raas.sampling.max_new_tokens=8",
        "trainer.micro_batch_tokens=2048",
        "run.max_steps=2",
        recipe=RECIPE,
    )
    assert summary["stopped"] == "2 steps" and summary["ledger"]["balanced"], summary
