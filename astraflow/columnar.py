"""The columnar layout of a list of dataclasses: how a `Columns[...]` list travels and what it decodes to.

A list of dataclasses annotated `Columns[...]` travels as columns (`columns`): one list per field, and
each 1-D array field concatenated over the elements with their `lengths` once: a group of 8 trajectories
is 4 arrays and a few short lists, not 8 maps of 4 arrays each. Decoded (`decoding`), it is a
`ColumnList`: the columns, for whoever looks at a field of every element (`column`, `joined`), and the
elements, built from them at the first look at one.

This module promises the layout alone (annotation, encoder, the decoded list and its readers); checking
the decoded columns against the element's annotations is `decoding`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import numpy as np

_T = TypeVar("_T")
COLUMNAR = "columnar"
Columns = Annotated[list[_T], COLUMNAR]
"""A list of dataclasses that travels as columns (see `columns`)."""


def columns(cls: type, items: list[Any], to_plain: Callable[[Any], Any]) -> dict[str, Any]:
    """`items` (instances of the dataclass `cls`) as columns: per field the list of its `to_plain` values,
    except the array fields (`np.ndarray`, 1-D, of one length per item): each concatenated, with
    `lengths`, the items' lengths (of the first array field)."""
    names, arrays = split_fields(cls)
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
def split_fields(cls: type) -> tuple[list[str], list[str]]:
    """(the names of `cls`'s fields that are not arrays, those that are)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return [n for n in names if hints[n] is not np.ndarray], [n for n in names if hints[n] is np.ndarray]
