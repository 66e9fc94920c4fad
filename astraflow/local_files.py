"""The local files a recipe names - starting weights and datasets - checked when the settings load, so a
typo fails at once with the field named instead of deep inside a worker (or after minutes of retrying a
model hub that has no such model).

Relative paths are relative to the working directory, as the engines and loaders read them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from astraflow.workflows.datasets import DatasetSettings

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""How a Hugging Face hub model id is spelled (`org/name` or `name`)."""
FILE_DATASETS = {"jsonl": "file", "parquet": "file or directory", "hf_disk": "directory"}


def model_problem(name: str) -> str | None:
    """What is wrong with starting weights `name`, with the fix; None when it is a local directory or a
    hub model in the local Hugging Face cache (looked up offline: nothing is fetched). Unset (`""`) is
    no problem here: the policy then starts from the run's tiny model or the engine says what it lacks."""
    if not name or Path(name).expanduser().is_dir():
        return None
    where = "" if Path(name).expanduser().is_absolute() else " (relative to the working directory)"
    if not _hub_id(name):
        return f"starting weights: no such directory{where}"
    if in_hub_cache(name):
        return None
    return (
        f"starting weights: no such directory{where}, nor a model of that name in the Hugging Face cache"
        f" ({hub_cache()}): fix the path, or download the model first (`hf download {name}`)"
    )


def _hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None and ".." not in name and "--" not in name


def hub_cache() -> str:
    """The Hugging Face hub cache directory (`HF_HUB_CACHE`, else under `HF_HOME`)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds model `repo_id` (its config.json at `main`)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache())
    return isinstance(found, str)


def dataset_problem(dataset: DatasetSettings) -> str | None:
    """What is wrong with a dataset's `path`; None when its type reads no file or the file is there."""
    kind = FILE_DATASETS.get(dataset.type)
    if kind is None:
        return None
    if not dataset.path:
        return f"dataset type {dataset.type} reads a {kind}: set its path"
    path = Path(dataset.path).expanduser()
    found = {"file": path.is_file(), "directory": path.is_dir()}
    if found.get(kind, path.exists()):
        return None
    where = "" if path.is_absolute() else " (relative to the working directory)"
    return f"no such {kind}{where}"
