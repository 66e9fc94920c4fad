"""`recipes/gsm8k-qwen.yaml` on the CPU, the tiny model standing in for the real one: its settings load
and validate, its data path (GSM8K jsonl, chat template, the `gsm8k` reward) runs end to end through
`astraflow run`, and the trainer's bf16 and gradient-checkpointing settings train on the CPU."""

import json
from pathlib import Path

import pytest

from astraflow.settings_load import load_settings
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


@pytest.mark.parametrize(
    ("recipe", "trainer", "engines"),
    [
        ("recipes/gsm8k-qwen.yaml", "0,1,2,3", ["4", "5", "6", "7"]),
        ("recipes/gsm8k-qwen-1gpu.yaml", "0", ["0"]),
    ],
)
def test_the_recipes_lay_out_their_gpus_and_load_without_one(tmp_path, monkeypatch, recipe, trainer, engines):
    """8 GPUs: four FSDP2 ranks under torchrun and four vLLM RaaS workers of one GPU each; one GPU: the
    trainer and one engine share it."""
    from astraflow.launch.launcher import workers

    recipe = Path(recipe).resolve()
    monkeypatch.chdir(tmp_path)  # where its user put the weights and data it names
    (tmp_path / "models" / "Qwen2.5-1.5B-Instruct").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k" / "train.jsonl").touch()
    s = load_settings(recipe)
    policy = s.policy("policy")
    assert (policy.engine.type, policy.engine.device, policy.engine.devices) == ("vllm", "cuda", "")
    assert (policy.trainer.device, policy.trainer.dtype) == ("cuda", "bfloat16")
    assert s.raas.workflow_options["reward"] == "gsm8k"
    ws = {w.name: w for w in workers(s)}
    assert ws["trainer-policy"].env["CUDA_VISIBLE_DEVICES"] == trainer
    assert [ws[f"raas-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in range(len(engines))] == engines
    assert len([n for n in ws if n.startswith("raas-")]) == len(engines)


def test_the_recipe_data_path_trains_on_the_cpu_with_the_tiny_model(tmp_path, tiny_model):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS * 4))
    summary = run(
        tmp_path / "run",
        "gsm8k",
        f"engine.model={tiny_model}",
        "engine.device=cpu",
        "layout.gpus=0",  # the CPU: no GPU to lay out
        "engine.max_model_len=256",
        "trainer.device=cpu",
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
