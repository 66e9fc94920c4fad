"""Plain decoded values (msgpack's lists, maps, numbers, arrays) checked against type annotations and
built into dataclasses: what `packing.unpack` does with a message's `data`.

A checker is built once per annotation (decoding is on every hot path). It builds no text on the way: a
value of the wrong type raises `Invalid`, each level it passes through on the way out adds its place, and
`from_plain` turns it into a DecodeError naming the whole path (`data.trajectories.reward[3]: expected a
number, got str`).

A `Columns[...]` list (`columnar`) is checked column by column and decoded into a `ColumnList`.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import numpy as np

from astraflow.columnar import ColumnList, column_type, split_fields
from astraflow.errors import DecodeError

Converter = Callable[[Any], Any]
_CONVERTERS: dict[Any, Converter] = {}
_EXACT: dict[Converter, type] = {}
"""Converters of leaves that return a value of exactly this type unchanged (`float` a float, `str` a
str): a list or map of such values is checked by type alone."""
_T = TypeVar("_T")


class Invalid(Exception):
    """A value of the wrong type, `places` (innermost first) from where conversion started."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message, self.places = message, []

    def at(self, place: str) -> Invalid:
        self.places.append(place)
        return self


def from_plain(tp: Any, value: Any, path: str) -> Any:
    """`value` checked against the annotation `tp`, dataclasses built; DecodeError names the place under
    `path`."""
    try:
        return converter(tp)(value)
    except Invalid as e:
        raise DecodeError(f"{path}{''.join(reversed(e.places))}: {e.message}") from None


def converter(tp: Any) -> Converter:
    """The checker/builder of values of annotation `tp` (built once)."""
    conv = _CONVERTERS.get(tp)
    if conv is None:
        conv = _CONVERTERS[tp] = _build(tp)
    return conv


def expect(ok: bool, what: str, value: Any) -> None:
    if not ok:
        raise Invalid(f"expected {what}, got {type(value).__name__}")


def _columns(cls: type) -> Converter:
    """The builder of a `Columns[cls]` value: the elements back from the columns `columnar.columns`
    made, their arrays views of the concatenated ones."""
    hints = typing.get_type_hints(cls)
    names, arrays = split_fields(cls)
    required = {f.name for f in dataclasses.fields(cls) if _required(f)}
    defaults = {f.name: _default(f) for f in dataclasses.fields(cls) if not _required(f)}
    lists = [(name, _list(converter(hints[name]))) for name in names]
    plain = all(f.init for f in dataclasses.fields(cls)) and not hasattr(cls, "__post_init__")
    if not plain or hasattr(cls, "__slots__"):  # (its __init__ would do more than set each field)
        raise TypeError(f"{cls.__name__}: a Columns element is built without its __init__")

    def to_list(value: Any) -> ColumnList:
        expect(isinstance(value, dict), "a map", value)
        lengths = value.get("lengths")
        ok = isinstance(lengths, np.ndarray) and lengths.ndim == 1 and lengths.dtype.kind in "iu"
        sizes = lengths.tolist() if ok else []  # (Python ints: their sum cannot wrap)
        if not ok or min(sizes, default=0) < 0:
            raise Invalid("expected a 1-D array of lengths >= 0").at(".lengths")
        n, cols = len(sizes), {}
        for name, conv in lists:
            if name not in value:
                if name in required:
                    raise Invalid("missing").at(f".{name}")
                cols[name] = [defaults[name]() for _ in range(n)]  # (left out by the sender)
                continue
            try:
                cols[name] = column = conv(value[name])
            except Invalid as e:
                raise e.at(f".{name}") from None
            if len(column) != n:
                raise Invalid(f"{len(column)} values for {n} elements").at(f".{name}")
        whole = dict(cols)
        bounds = list(itertools.accumulate(sizes, initial=0))
        for name in arrays:
            whole[name] = column = value.get(name)
            if not isinstance(column, np.ndarray) or column.ndim != 1 or len(column) != bounds[-1]:
                what = f"shape {column.shape}" if isinstance(column, np.ndarray) else type(column).__name__
                raise Invalid(f"{what} does not match the lengths (total {bounds[-1]})").at(f".{name}")

        def elements() -> list:
            spans = list(itertools.pairwise(bounds))
            for name in arrays:
                cols[name] = [whole[name][start:end] for start, end in spans]
            rows = zip(*cols.values(), strict=True)
            return [_instance(cls, dict(zip(cols, row, strict=True))) for row in rows]

        return ColumnList(whole, n, elements)

    return to_list


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default(f: dataclasses.Field) -> Callable[[], Any]:
    return f.default_factory if f.default is dataclasses.MISSING else lambda: f.default  # type: ignore[return-value]


def _instance(cls: type[_T], values: dict[str, Any]) -> _T:
    """An instance of the dataclass `cls` holding `values` (checked, one per field) without its
    `__init__`: a frozen dataclass's sets each field through `object.__setattr__`, and a rollout group
    builds a dozen such instances per entry."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def _build(tp: Any) -> Converter:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        element = column_type(tp)
        return converter(typing.get_args(tp)[0]) if element is None else _columns(element)
    if tp is Any:
        return lambda value: value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        optional = type(None) in args
        inner = converter(next(a for a in args if a is not type(None)))
        return lambda value: None if value is None and optional else inner(value)
    if origin is list:
        return _list(converter(typing.get_args(tp)[0]))
    if origin is dict:
        return _dict(converter(typing.get_args(tp)[1]))
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp)
    if tp is float:

        def to_float(value: Any) -> float:
            expect(isinstance(value, int | float) and not isinstance(value, bool), "a number", value)
            return float(value)

        _EXACT[to_float] = float
        return to_float
    if tp is int:

        def to_int(value: Any) -> int:
            expect(isinstance(value, int) and not isinstance(value, bool), "an integer", value)
            return value

        _EXACT[to_int] = int
        return to_int

    def check(value: Any) -> Any:
        expect(isinstance(value, tp), tp.__name__, value)
        return value

    _EXACT[check] = tp
    return check


def _list(item: Converter) -> Converter:
    exact = _EXACT.get(item)

    def to_list(value: Any) -> list:
        expect(isinstance(value, list), "a list", value)
        if exact is not None and all(type(v) is exact for v in value):
            return value  # (what `item` returns as it is: a look at each type is enough)
        try:
            return [item(v) for v in value]
        except Invalid as e:  # which one: only now that one failed
            raise e.at(f"[{next(i for i, v in enumerate(value) if not _passes(item, v))}]") from None

    return to_list


def _dict(entry: Converter) -> Converter:
    exact = _EXACT.get(entry)

    def to_dict(value: Any) -> dict:
        expect(isinstance(value, dict), "a map", value)
        if exact is not None and all(type(v) is exact for v in value.values()):
            return value
        out = {}
        for k, v in value.items():
            try:
                out[k] = entry(v)
            except Invalid as e:
                raise e.at(f".{k}") from None
        return out

    return to_dict


def _dataclass(cls: type) -> Converter:
    hints = typing.get_type_hints(cls, include_extras=True)
    specs: list[tuple[str, Converter, bool]] = []

    def build(value: Any) -> Any:
        expect(isinstance(value, dict), "a map", value)
        kwargs = {}
        for name, conv, required in specs:
            if name in value:
                try:
                    kwargs[name] = conv(value[name])
                except Invalid as e:
                    raise e.at(f".{name}") from None
            elif required:
                raise Invalid("missing").at(f".{name}")
        return cls(**kwargs)

    _CONVERTERS[cls] = build  # before the fields: a dataclass may contain its own kind
    for f in dataclasses.fields(cls):
        specs.append((f.name, converter(hints[f.name]), _required(f)))
    return build


def _passes(conv: Converter, value: Any) -> bool:
    try:
        conv(value)
    except Invalid:
        return False
    return True
