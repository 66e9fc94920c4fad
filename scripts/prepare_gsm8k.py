"""Make the GSM8K recipe's data (`recipes/gsm8k-qwen.yaml`) from the Hugging Face `openai/gsm8k` dataset.

    python scripts/prepare_gsm8k.py --out data/gsm8k            # train.jsonl and test.jsonl
    python scripts/prepare_gsm8k.py --out data/gsm8k --data-files gsm8k.parquet   # a local copy

The dataset (config `main`) has `question` and `answer`, a worked solution whose last line is
`#### <final number>`; the recipe reads the same two fields (`prompt` mapped from `question`, the `gsm8k`
reward reads the number after `####`). Rows are checked and kept in the dataset's order. The hub is read
through `datasets.load_dataset` and its cache: run once online (or `HF_HUB_OFFLINE=1` with a filled
cache), or pass the files of a copy with `--data-files`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

SOURCE = "openai/gsm8k"
SUBSET = "main"


def to_row(row: dict, index: int) -> dict[str, str]:
    """One recipe row from one dataset row; ValueError naming the row when it has no `#### <answer>`."""
    question, answer = str(row.get("question", "")).strip(), str(row.get("answer", "")).strip()
    final = answer.rpartition("####")[2].strip() if "####" in answer else ""
    if not question or not final:
        raise ValueError(
            f"row {index}: expected a question and an answer ending '#### <number>', got {row!r}"
        )
    return {"question": question, "answer": answer}


def convert(rows: Iterable[dict]) -> Iterator[dict[str, str]]:
    for i, row in enumerate(rows):
        yield to_row(row, i)


def write_jsonl(rows: Iterable[dict], path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def load(split: str, source: str, data_files: list[str]) -> Iterable[dict]:
    import datasets

    if data_files:  # a local copy: its format from the file name (jsonl, json, parquet, csv)
        suffix = Path(data_files[0]).suffix.lstrip(".")
        builder = {"jsonl": "json"}.get(suffix, suffix)
        return datasets.load_dataset(builder, data_files={split: data_files}, split=split)
    return datasets.load_dataset(source, SUBSET, split=split)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/gsm8k", help="directory of <split>.jsonl (default data/gsm8k)")
    p.add_argument("--splits", nargs="+", default=["train", "test"], help="splits to write")
    p.add_argument("--source", default=SOURCE, help=f"hub dataset (default {SOURCE}, config {SUBSET})")
    p.add_argument("--data-files", nargs="+", default=[], help="a local copy instead (one split)")
    args = p.parse_args(argv)
    splits = args.splits[:1] if args.data_files else args.splits
    for split in splits:
        n = write_jsonl(convert(load(split, args.source, args.data_files)), Path(args.out) / f"{split}.jsonl")
        print(f"{Path(args.out) / f'{split}.jsonl'}: {n} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
