"""The served weights as one flat buffer that is also a safetensors file.

A weight file is `u64 header size | JSON header | data`, exactly the safetensors format, so the half of a
double buffer the trainer writes, the bytes a transfer moves, and the checkpoint an engine loads are the
same bytes. Tensors are laid out in state-dict order, contiguous; a tensor that shares storage with an
earlier one (tied embeddings) is left out, as `save_pretrained` does. Both ends build the header from
the manifest's tensor list, so it never travels.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping

from astraflow.messages import TensorSpec

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
CHUNK_BYTES = 4 << 20
"""Bytes per chunk digest."""


def layout(state: Mapping, dtype: str) -> list[TensorSpec]:
    """The tensor layout of a torch state dict served as `dtype` (floating tensors only)."""
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported served dtype {dtype!r} (one of {', '.join(SAFETENSORS_DTYPES)})")
    specs, seen, offset = [], set(), 0
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: only floating tensors are served, got {tensor.dtype}")
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue  # tied to an earlier tensor
        seen.add(ptr)
        nbytes = tensor.numel() * ITEMSIZE[dtype]
        shape = list(tensor.shape)
        specs.append(TensorSpec(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        offset += nbytes
    return specs


def header(specs: list[TensorSpec]) -> bytes:
    """The safetensors header (length prefix included) of a layout, padded to 8 bytes."""
    meta = {
        s.name: {
            "dtype": SAFETENSORS_DTYPES[s.dtype],
            "shape": s.shape,
            "data_offsets": [s.offset, s.offset + s.nbytes],
        }
        for s in specs
    }
    meta["__metadata__"] = {"format": "pt"}
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def data_bytes(specs: list[TensorSpec]) -> int:
    return specs[-1].offset + specs[-1].nbytes if specs else 0


def itemsize(specs: list[TensorSpec]) -> int:
    """Element size of a layout (one served dtype per layout)."""
    sizes = {ITEMSIZE[s.dtype] for s in specs}
    if len(sizes) != 1:
        raise ValueError(f"a layout has one served dtype, got sizes {sorted(sizes)}")
    return sizes.pop()


def digests(data, chunk_bytes: int = CHUNK_BYTES) -> tuple[str, list[str]]:
    """(whole, per-chunk) blake2b digests of a weight data region. The whole digest covers the chunk
    digests and the size, so one pass over the bytes gives both."""
    return digests_of([data], chunk_bytes)


def digests_of(pieces: Iterable, chunk_bytes: int = CHUNK_BYTES) -> tuple[str, list[str]]:
    """`digests` of the concatenation of `pieces` (buffers), without concatenating them."""
    chunks: list[str] = []
    h, filled, total = hashlib.blake2b(digest_size=16), 0, 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while len(view):
            take = min(chunk_bytes - filled, len(view))
            h.update(view[:take])
            view, filled, total = view[take:], filled + take, total + take
            if filled == chunk_bytes:
                chunks.append(h.hexdigest())
                h, filled = hashlib.blake2b(digest_size=16), 0
    if filled:
        chunks.append(h.hexdigest())
    whole = hashlib.blake2b(f"{total}:".encode() + "".join(chunks).encode(), digest_size=16)
    return whole.hexdigest(), chunks
