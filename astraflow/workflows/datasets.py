"""Prompt datasets: a built-in task, jsonl / parquet / a Hugging Face dataset saved to disk or loaded by
`datasets.load_dataset` (a hub name or local files), or the rows a `module:function` loader the recipe
names returns, with the recipe's field mapping applied."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.workflows.tasks import rows as task_rows


class DatasetSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["task", "jsonl", "parquet", "hf_disk", "hf", "loader"] = "task"
    """`hf`: `datasets.load_dataset(path, subset, data_files=..., split=...)`: a hub dataset (`openai/gsm8k`,
    fetched once into the datasets cache; with `HF_HUB_OFFLINE=1` only the cache is read) or a builder
    over local files (`path: json`, `data_files: [data/train.jsonl]`)."""
    task: str = "addition"
    """type task: the built-in task (addition, reverse)."""
    size: int = Field(10_000, ge=1)
    """type task: rows generated (seeded by run.seed)."""
    path: str = ""
    """jsonl / parquet file, the directory `datasets.Dataset.save_to_disk` wrote, or (hf) the dataset's hub
    name, local directory, or builder (`json`, `csv`, `parquet`)."""
    split: str = "train"
    """hf_disk, hf: the split, when the dataset has several."""
    subset: str | None = None
    """hf: the dataset's configuration (`main` of `openai/gsm8k`)."""
    data_files: list[str] = Field(default_factory=list)
    """hf: the files a builder reads (`path: json`)."""
    revision: str | None = None
    """hf: the hub revision (a commit pins the data)."""
    cache_dir: str | None = None
    """hf: the datasets cache; default `HF_DATASETS_CACHE` (`~/.cache/huggingface/datasets`)."""
    loader: str = ""
    """type loader: the `module:function` that returns the rows (an iterable of dicts). Only the recipe
    names it: no row ever picks code."""
    loader_args: dict[str, Any] = Field(default_factory=dict)
    """type loader: keyword arguments of the loader."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Row field -> source column, e.g. {prompt: question, answer: solution}; unmapped columns are kept."""
    required: list[str] = Field(default_factory=lambda: ["prompt"])
    """Fields every row must have after mapping."""

    @model_validator(mode="after")
    def _loader_named(self) -> DatasetSettings:
        if self.type == "loader" and not all(self.loader.partition(":")[::2]):
            raise ValueError(f"dataset type loader: loader {self.loader!r} is not module:function")
        return self


def load_rows(settings: DatasetSettings, seed: int = 0) -> list[dict[str, Any]]:
    """All rows, mapped; raises ValueError naming the file, the row and the missing field."""
    if settings.type == "task":
        return task_rows(settings.task, settings.size, seed)
    if settings.type == "loader":
        return _from_loader(settings)
    path = Path(settings.path)
    if settings.type == "jsonl":
        raw = _jsonl(path)
    elif settings.type == "parquet":
        import pyarrow.parquet as pq

        raw = pq.read_table(path).to_pylist()
    elif settings.type == "hf":
        raw = _load_dataset(settings)
    else:
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[settings.split]
        raw = ds.to_list()
    return [_map(row, settings, path, i) for i, row in enumerate(raw)]


def _load_dataset(settings: DatasetSettings) -> list[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(
            settings.path,
            settings.subset,
            data_files=settings.data_files or None,
            split=settings.split,
            revision=settings.revision,
            cache_dir=settings.cache_dir,
        )
    except (ConnectionError, FileNotFoundError) as e:  # not on the hub, not reachable, not in the cache
        raise ValueError(f"dataset {settings.path!r}: {e}") from None
    return ds.to_list()


def _from_loader(settings: DatasetSettings) -> list[dict[str, Any]]:
    from astraflow.workflows.api import load  # the workflow API (engines, messages) only when used

    fn = load(settings.loader, "dataset loader")
    if not callable(fn):
        raise ValueError(f"dataset loader {settings.loader!r} is not a function")
    raw = list(fn(**settings.loader_args))
    for i, row in enumerate(raw):
        if not isinstance(row, dict):
            raise ValueError(
                f"dataset loader {settings.loader}: row {i} is a {type(row).__name__}, not a dict"
            )
    return [_map(row, settings, Path(settings.loader), i) for i, row in enumerate(raw)]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return out


def _map(row: dict[str, Any], settings: DatasetSettings, path: Path, i: int) -> dict[str, Any]:
    mapped = dict(row)
    for target, source in settings.fields.items():
        if source not in row:
            raise ValueError(f"{path}: row {i}: no column {source!r} (mapped to {target!r})")
        mapped[target] = row[source]
    missing = [f for f in settings.required if f not in mapped]
    if missing:
        raise ValueError(
            f"{path}: row {i}: missing field(s) {missing}; map them with dataflow.dataset.fields"
        )
    return mapped
