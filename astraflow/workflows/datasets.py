"""Prompt datasets: a built-in task, jsonl / parquet / a Hugging Face dataset saved to disk, or the rows a
`module:function` loader the recipe names returns, with the recipe's field mapping applied (nothing is
fetched from a hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.workflows.tasks import rows as task_rows


class DatasetSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["task", "jsonl", "parquet", "hf_disk", "loader"] = "task"
    task: str = "addition"
    """type task: the built-in task (addition, reverse)."""
    size: int = Field(10_000, ge=1)
    """type task: rows generated (seeded by run.seed)."""
    path: str = ""
    """jsonl / parquet file, or the directory `datasets.Dataset.save_to_disk` wrote."""
    split: str = "train"
    """hf_disk: the split, when the directory holds a DatasetDict."""
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
    else:
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[settings.split]
        raw = ds.to_list()
    return [_map(row, settings, path, i) for i, row in enumerate(raw)]


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
