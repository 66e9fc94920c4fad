"""msgpack bytes of a message dataclass and back: numpy arrays as a msgpack ext type (little-endian dtype,
shape, raw bytes), never as lists of Python ints; a `Columns` field as columns (`columnar.columns`); nested
dataclasses as maps. No pickle. What `messages` puts in an entry's `data` field.
"""

from __future__ import annotations

import dataclasses
import struct
import typing
from typing import Any, TypeVar

import msgpack
import numpy as np

from astraflow.columnar import column_type, columns
from astraflow.decoding import from_plain
from astraflow.errors import DecodeError

_ARRAY_EXT, _RAW_ARRAY_EXT = 1, 2
"""msgpack ext types of a numpy array. 1: a msgpack [dtype, shape, bytes] (still read, no longer written).
2: a header - dtype length u8, dtype, ndim u8, each dimension u64 little-endian - then the bytes: read
with no second msgpack pass (a rollout group holds 4 arrays per trajectory)."""
_DTYPES: dict[bytes, np.dtype] = {}
_M = TypeVar("_M")


def pack(msg: Any) -> bytes:
    """The msgpack bytes of `msg` alone (no headers)."""
    return msgpack.packb(_to_plain(msg), default=_pack_array, use_bin_type=True)


def unpack(cls: type[_M], data: Any, max_bytes: int | None = None, path: str = "data") -> _M:
    """The message of class `cls` (a `messages.Message`) that `pack` made; DecodeError names the bad
    field."""
    if not isinstance(data, bytes | bytearray):
        raise DecodeError(f"{path}: missing or not bytes")
    if max_bytes is not None and len(data) > max_bytes:
        raise DecodeError(f"{path}: {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        plain = msgpack.unpackb(data, ext_hook=_unpack_array, raw=False, strict_map_key=True)
    except DecodeError:
        raise
    except Exception as e:
        raise DecodeError(f"{path}: not valid msgpack ({type(e).__name__}: {e})") from None
    msg = from_plain(cls, plain, cls.KIND)  # type: ignore[attr-defined]
    msg._check()
    return msg


_FIELDS: dict[type, tuple[tuple[str, type | None], ...]] = {}
"""Per dataclass packed: its fields' names, each with the element class of a `Columns` field (else None)."""
_LEAVES = (str, int, float, bool, bytes, np.ndarray, type(None))
_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})
"""Types a list or map of which msgpack packs as it is (no element to convert)."""
_LEAF_TYPES = frozenset(_LEAVES)


def _to_plain(value: Any) -> Any:
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, list | tuple):
        return value if all(type(v) in _SCALARS for v in value) else [_to_plain(v) for v in value]
    if isinstance(value, dict):
        if all(type(v) in _SCALARS for v in value.values()):
            return value
        return {k: _to_plain(v) for k, v in value.items()}
    cls = type(value)
    names = _FIELDS.get(cls)
    if names is None:
        if not dataclasses.is_dataclass(cls):
            return value
        hints = typing.get_type_hints(cls, include_extras=True)
        names = _FIELDS[cls] = tuple((f.name, column_type(hints[f.name])) for f in dataclasses.fields(cls))
    out = {}  # a message (or a part of one): a map of its fields
    for name, element in names:
        v = getattr(value, name)
        if element is not None:
            out[name] = columns(element, v, _to_plain)
        else:  # (a leaf as it is, without a call: most fields are)
            out[name] = v if type(v) in _LEAF_TYPES else _to_plain(v)
    return out


def _pack_array(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("<"))
        dtype = arr.dtype.str.encode()
        header = struct.pack(f"<B{len(dtype)}sB{arr.ndim}Q", len(dtype), dtype, arr.ndim, *arr.shape)
        return msgpack.ExtType(_RAW_ARRAY_EXT, header + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _unpack_array(code: int, payload: bytes) -> np.ndarray:
    try:
        if code == _RAW_ARRAY_EXT:
            n = payload[0]
            dtype, ndim = _dtype(payload[1 : 1 + n]), payload[1 + n]
            shape = struct.unpack_from(f"<{ndim}Q", payload, 2 + n)
            flat = np.frombuffer(payload, dtype, offset=2 + n + 8 * ndim)
            return flat if ndim == 1 and len(flat) == shape[0] else flat.reshape(shape)
        if code == _ARRAY_EXT:
            dtype_str, shape, raw = msgpack.unpackb(payload, raw=False)
            return np.frombuffer(raw, dtype=_dtype(dtype_str.encode())).reshape(shape)
    except Exception as e:
        raise DecodeError(f"data: bad array ({type(e).__name__}: {e})") from None
    raise DecodeError(f"data: unknown msgpack ext type {code}")


def _dtype(name: bytes) -> np.dtype:
    """The numpy dtype `name` ('<i4', ...); never an object dtype."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = np.dtype(name.decode())
        if dtype.hasobject:
            raise ValueError("object arrays are not allowed")
        if len(_DTYPES) < 64:  # names from the wire: a bounded cache
            _DTYPES[name] = dtype
    return dtype
