"""Versions that are LoRA adapters: the base they apply to, and a half that is a PEFT adapter directory.

A LoRA trainer serves its adapter's tensors as any other weights (deltas, digests, relays and same-host
copies see bytes), and its manifest says `adapter_of`: the digest of the base (`base_digest` of the
starting weights' directory). A receiver refuses an adapter of a base other than the one its engine
holds. Its halves are PEFT adapter directories: `adapter_config.json` (the manifest's) beside
`adapter_model.safetensors`, a link to the half's weights file, which `peft` and vLLM load as they are.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
from pathlib import Path

from astraflow.weights import layout

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@functools.cache
def base_digest(model_dir: str) -> str:
    """The digest of the weights of a Hugging Face model directory, whatever their split into files: its
    tensors' names, dtypes and shapes, then their bytes, in name order (`layout.digests_of`). Two copies
    of the same checkpoint agree; another model, precision or fine-tune does not. Reads every weight
    byte once per process (BLAKE3, a few GB/s)."""
    tensors = {}
    maps = []
    try:
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            maps.append(m)
            (n,) = struct.unpack_from("<Q", m)
            for name, entry in json.loads(m[8 : 8 + n]).items():
                if name != "__metadata__":
                    start, end = (8 + n + int(x) for x in entry["data_offsets"])
                    tensors[name] = (entry["dtype"], entry["shape"], m, start, end)
        if not tensors:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        names = sorted(tensors)
        head = json.dumps([[k, tensors[k][0], tensors[k][1]] for k in names]).encode()
        views = [memoryview(tensors[k][2])[tensors[k][3] : tensors[k][4]] for k in names]
        whole, _ = layout.digests_of([head, *views])
        for v in views:
            v.release()
        return whole
    finally:
        for m in maps:
            m.close()


def make_adapter_dir(directory: Path, config: str, weights_file: str) -> None:
    """Make `directory`, which holds `weights_file` (a half's), a PEFT adapter directory."""
    (directory / ADAPTER_CONFIG).write_text(config)
    link = directory / ADAPTER_WEIGHTS
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(weights_file, link)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether a checkpoint directory an engine is given holds a PEFT adapter (not full weights)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()
