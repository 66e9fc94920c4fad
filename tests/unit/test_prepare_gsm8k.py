"""`scripts/prepare_gsm8k.py` on a small local file in `openai/gsm8k`'s schema: the rows the GSM8K recipe
reads, which its reward scores."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from astraflow.workflows.datasets import DatasetSettings, load_rows

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prepare_gsm8k.py"
ROWS = [  # as on the hub: a worked solution, the final answer after ####
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 12 eggs. How many in 5 boxes? ", "answer": "12 * 5 = <<12*5=60>>60\n#### 60"},
]


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gsm8k_schema_becomes_the_recipe_rows_its_reward_scores(script, tmp_path):
    pytest.importorskip("datasets")
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert script.main(["--out", str(tmp_path / "out"), "--data-files", str(source)]) == 0

    recipe = load_rows(
        DatasetSettings(
            type="jsonl", path=str(tmp_path / "out" / "train.jsonl"), fields={"prompt": "question"}
        )
    )
    assert [r["prompt"] for r in recipe] == [r["question"].strip() for r in ROWS]
    pytest.importorskip("math_verify")
    from astraflow.workflows.rewards import gsm8k

    assert [gsm8k(r["prompt"], "So the answer is 7.", r["answer"]) for r in recipe] == [1.0, 0.0]
    assert gsm8k(recipe[1]["prompt"], "5 boxes hold \\boxed{60} eggs", recipe[1]["answer"]) == 1.0


def test_a_row_without_a_final_answer_is_named(script):
    with pytest.raises(ValueError, match="row 1: expected a question and an answer ending '#### <number>'"):
        list(script.convert([ROWS[0], {"question": "q", "answer": "no marker"}]))
