"""Plain decoded values (msgpack's lists, maps, numbers, arrays) checked against type annotations and
built into dataclasses: what `packing.unpack` does with a message's `data`.

A checker is built once per annotation (decoding is on every hot path). It builds no text on the way: a
value of the wrong type raises `Invalid`, each level it passes through on the way out adds its place, and
`from_plain` turns it into a DecodeError naming the whole path (`data.trajectories.reward[3]: expected a
number, got str`).

A list of dataclasses annotated `Columns[...]` travels as columns (`columns`): one list per field, and
each 1-D array field concatenated over the elements with their `lengths` once: a group of 8 trajectories
is 4 arrays and a few short lists, not 8 maps of 4 arrays each. Decoded, it is a `ColumnList`: the
columns, for whoever looks at a field of every element (`column`, `joined`), and the elements, built
from them at the first look at one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import numpy as np

from astraflow.errors import DecodeError

Converter = Callable[[Any], Any]
_CONVERTERS: dict[Any, Converter] = {}
_EXACT: dict[Converter, type] = {}
"""Converters of leaves that return a value of exactly this type unchanged (`float` a float, `str` a
str): a list or map of such values is checked by type alone."""
_T = TypeVar("_T")
COLUMNAR = "columnar"
Columns = Annotated[list[_T], COLUMNAR]
"""A list of dataclasses that travels as columns (see `columns`)."""


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


def columns(cls: type, items: list[Any], to_plain: Callable[[Any], Any]) -> dict[str, Any]:
    """`items` (instances of the dataclass `cls`) as columns: per field the list of its `to_plain` values,
    except the array fields (`np.ndarray`, 1-D, of one length per item): each concatenated, with
    `lengths`, the items' lengths (of the first array field)."""
    names, arrays = _fields(cls)
    out: dict[str, Any] = {name: [to_plain(getattr(x, name)) for x in items] for name in names}
    for name in arrays:
        out[name] = np.concatenate([getattr(x, name) for x in items]) if items else np.zeros(0, np.int32)
    out["lengths"] = np.array([len(getattr(x, arrays[0])) for x in items], np.int64)
    return out


class ColumnList(Sequence):
    """The elements a `Columns` value was decoded into, with the columns they are built from (`columns`:
    per field the list of the elements' values; for an array field the concatenated array they are views
    of): what a look at every element reads in one piece. The elements themselves are built at the first
    look at one (a collector reads the columns alone). Read them, do not write them."""

    def __init__(self, columns: dict[str, Any], n: int, build: Callable[[], list]) -> None:
        self.columns, self._n, self._build = columns, n, build

    @functools.cached_property
    def _items(self) -> list:
        return self._build()

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        return self._items[index]

    def __iter__(self):
        return iter(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._items)


def column(items: Sequence[Any], name: str) -> list:
    """The values of the (not array) field `name` of every element of `items` (the decoded column of a
    `ColumnList`); an array field's are `joined`."""
    if isinstance(items, ColumnList):
        values = items.columns[name]
        if isinstance(values, np.ndarray):
            raise TypeError(f"{name} is an array field: joined() reads it")
        return values
    return [getattr(x, name) for x in items]


def joined(items: Sequence[Any], name: str, picked: Sequence[int] | None = None) -> np.ndarray:
    """The array field `name` of the elements of `items` at `picked` (all when None) concatenated: the
    decoded column itself for all of a `ColumnList` (not a copy)."""
    if picked is not None and list(picked) == list(range(len(items))):
        picked = None
    if picked is None and isinstance(items, ColumnList):
        return items.columns[name]
    chosen = items if picked is None else [items[i] for i in picked]
    arrays = [getattr(x, name) for x in chosen]
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int32)


def column_type(tp: Any) -> type | None:
    """The element class of a `Columns[...]` annotation; None for any other annotation."""
    if typing.get_origin(tp) is Annotated and COLUMNAR in typing.get_args(tp)[1:]:
        return typing.get_args(typing.get_args(tp)[0])[0]
    return None


@functools.cache
def _fields(cls: type) -> tuple[list[str], list[str]]:
    """(the names of `cls`'s fields that are not arrays, those that are)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return [n for n in names if hints[n] is not np.ndarray], [n for n in names if hints[n] is np.ndarray]


def _columns(cls: type) -> Converter:
    """The builder of a `Columns[cls]` value: the elements back from the columns `columns` made, their
    arrays views of the concatenated ones."""
    hints = typing.get_type_hints(cls)
    names, arrays = _fields(cls)
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
