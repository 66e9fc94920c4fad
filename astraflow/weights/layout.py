"""The served weights as one flat buffer that is also a safetensors file.

A weight file is `u64 header size | JSON header | data`, exactly the safetensors format, so the half of a
double buffer the trainer writes, the bytes a transfer moves, and the checkpoint an engine loads are the
same bytes. Tensors are laid out in state-dict order, contiguous; a tensor that shares storage with an
earlier one (tied embeddings) is left out, as `save_pretrained` does. Both ends build the header from
the manifest's tensor list, so it never travels.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import blake3

from astraflow.messages import TensorSpec

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
CHUNK_BYTES = 4 << 20
"""Bytes per chunk digest."""
DIGEST_BYTES = 16
"""Length of every weight digest (BLAKE3 output, 128 bits)."""


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


def read_header(buf) -> tuple[int, list[TensorSpec]]:
    """The tensors of a safetensors file given as a buffer (mapped, not read): where its data starts and
    each tensor's spec, offsets from there. Raises ValueError for a header that is not safetensors, a
    dtype not served here, or a tensor whose bytes are not its shape's or lie outside the buffer."""
    view = memoryview(buf).cast("B")
    if len(view) < 8:
        raise ValueError("not a safetensors file: shorter than its header length")
    (n,) = struct.unpack_from("<Q", view)
    if n > len(view) - 8:
        raise ValueError(f"not a safetensors file: a header of {n} bytes in {len(view)}")
    meta = json.loads(bytes(view[8 : 8 + n]))
    if not isinstance(meta, dict):
        raise ValueError("not a safetensors file: its header is no JSON object")
    base, dtypes, specs = 8 + n, {code: name for name, code in SAFETENSORS_DTYPES.items()}, []
    for name, entry in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtypes[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{name}: {entry!r} is not a tensor of a served dtype ({', '.join(dtypes)})"
            ) from None
        if not 0 <= start <= end <= len(view) - base or end - start != math.prod(shape) * ITEMSIZE[dtype]:
            raise ValueError(f"{name}: data offsets {entry['data_offsets']} do not fit {dtype}{shape}")
        specs.append(TensorSpec(name=name, dtype=dtype, shape=shape, offset=start, nbytes=end - start))
    return base, specs


def data_bytes(specs: list[TensorSpec]) -> int:
    return specs[-1].offset + specs[-1].nbytes if specs else 0


def itemsize(specs: list[TensorSpec]) -> int:
    """Element size of a layout (one served dtype per layout)."""
    sizes = {ITEMSIZE[s.dtype] for s in specs}
    if len(sizes) != 1:
        raise ValueError(f"a layout has one served dtype, got sizes {sorted(sizes)}")
    return sizes.pop()


def digests(data, chunk_bytes: int = CHUNK_BYTES) -> tuple[str, list[str]]:
    """(whole, per-chunk) digests of a weight data region: BLAKE3 of each `chunk_bytes` chunk, hashed in
    parallel threads (BLAKE3 releases the GIL), and a whole digest over the size and the chunk digests,
    so a receiver that verified every chunk as it arrived has the whole one without reading the bytes
    again."""
    view = memoryview(data).cast("B")
    starts = range(0, len(view), chunk_bytes)
    chunks = list(hash_pool().map(lambda s: chunk_digest(view[s : s + chunk_bytes]), starts))
    return whole_digest(len(view), chunks), chunks


def digests_of(pieces: Iterable, chunk_bytes: int = CHUNK_BYTES) -> tuple[str, list[str]]:
    """`digests` of the concatenation of `pieces` (buffers), without concatenating them."""
    chunks: list[str] = []
    h, filled, total = blake3.blake3(), 0, 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while len(view):
            take = min(chunk_bytes - filled, len(view))
            h.update(view[:take])
            view, filled, total = view[take:], filled + take, total + take
            if filled == chunk_bytes:
                chunks.append(h.hexdigest(DIGEST_BYTES))
                h, filled = blake3.blake3(), 0
    if filled:
        chunks.append(h.hexdigest(DIGEST_BYTES))
    return whole_digest(total, chunks), chunks


def chunk_digest(data) -> str:
    """The digest of one chunk (or of a delta): BLAKE3, `DIGEST_BYTES` long, hex."""
    return blake3.blake3(memoryview(data).cast("B")).hexdigest(DIGEST_BYTES)


def whole_digest(nbytes: int, chunks: list[str]) -> str:
    """The whole digest of `nbytes` of data from its chunk digests."""
    return chunk_digest(f"{nbytes}:".encode() + "".join(chunks).encode())


@functools.cache
def hash_pool() -> ThreadPoolExecutor:
    """Threads that digest and compare chunks (one per core: the work is memory- and compute-bound)."""
    return ThreadPoolExecutor(max(os.cpu_count() or 1, 1), thread_name_prefix="weights-hash")
