import json

import pytest

from astraflow.workflows.datasets import DatasetSettings, load_rows
from astraflow.workflows.tasks import TASKS, rows

ROWS = [{"question": "1+1=", "solution": "2", "id": 7}, {"question": "2+2=", "solution": "4", "id": 8}]
MAPPING = {"prompt": "question", "answer": "solution"}
EXPECTED = [{**r, "prompt": r["question"], "answer": r["solution"]} for r in ROWS]


def test_builtin_tasks_are_seeded_and_verifiable():
    for name, task in TASKS.items():
        assert rows(name, 5, seed=3) == rows(name, 5, seed=3) != rows(name, 5, seed=4)
        for r in rows(name, 20):
            assert r["prompt"] and r["answer"] and task.reward == "exact_match"
    assert rows("addition", 1, seed=0)[0]["prompt"][2] == "+"


def test_jsonl_with_field_mapping(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert load_rows(DatasetSettings(type="jsonl", path=str(path), fields=MAPPING)) == EXPECTED


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows(DatasetSettings(type="parquet", path=str(path), fields=MAPPING)) == EXPECTED


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    got = load_rows(DatasetSettings(type="hf_disk", path=str(tmp_path / "dd"), fields=MAPPING))
    assert got == EXPECTED


def test_missing_and_bad_fields_are_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match=r"row 0: no column 'problem' \(mapped to 'prompt'\)"):
        load_rows(DatasetSettings(type="jsonl", path=str(path), fields={"prompt": "problem"}))
    with pytest.raises(ValueError, match=r"row 0: missing field\(s\) \['prompt'\]"):
        load_rows(DatasetSettings(type="jsonl", path=str(path)))
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: not JSON"):
        load_rows(DatasetSettings(type="jsonl", path=str(path)))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub: what `HF_HUB_OFFLINE=1` gives a process (set on the modules that read it at import)."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    return str(tmp_path / "cache")


def test_load_dataset_reads_local_files_through_a_builder(tmp_path, offline):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    settings = DatasetSettings(
        type="hf", path="json", data_files=[str(path)], fields=MAPPING, cache_dir=offline
    )
    assert load_rows(settings) == EXPECTED
    assert load_rows(settings) == EXPECTED  # the second time from the datasets cache


def test_load_dataset_takes_the_split_of_a_local_dataset_directory(tmp_path, offline):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (tmp_path / "ds" / "test.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    settings = DatasetSettings(
        type="hf", path=str(tmp_path / "ds"), split="test", fields=MAPPING, cache_dir=offline
    )
    assert load_rows(settings) == EXPECTED[1:]


def test_a_hub_dataset_not_in_the_cache_fails_at_once_offline(offline):
    settings = DatasetSettings(type="hf", path="openai/gsm8k", subset="main", cache_dir=offline)
    with pytest.raises(ValueError, match=r"^dataset 'openai/gsm8k': .*reach 'openai/gsm8k'"):
        load_rows(settings)
