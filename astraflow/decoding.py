"""Plain decoded values (msgpack's lists, maps, numbers, arrays) checked against type annotations and
built into dataclasses: what `messages.unpack` does with a message's `data`.

A checker is built once per annotation (decoding is on every hot path). It builds no text on the way: a
value of the wrong type raises `Invalid`, each level it passes through on the way out adds its place, and
`from_plain` turns it into a DecodeError naming the whole path (`data.trajectories[3].reward: expected a
number, got str`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from astraflow.errors import DecodeError

Converter = Callable[[Any], Any]
_CONVERTERS: dict[Any, Converter] = {}


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


def _build(tp: Any) -> Converter:
    origin = typing.get_origin(tp)
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

        return to_float
    if tp is int:

        def to_int(value: Any) -> int:
            expect(isinstance(value, int) and not isinstance(value, bool), "an integer", value)
            return value

        return to_int

    def check(value: Any) -> Any:
        expect(isinstance(value, tp), tp.__name__, value)
        return value

    return check


def _list(item: Converter) -> Converter:
    def to_list(value: Any) -> list:
        expect(isinstance(value, list), "a list", value)
        try:
            return [item(v) for v in value]
        except Invalid as e:  # which one: only now that one failed
            raise e.at(f"[{next(i for i, v in enumerate(value) if not _passes(item, v))}]") from None

    return to_list


def _dict(entry: Converter) -> Converter:
    def to_dict(value: Any) -> dict:
        expect(isinstance(value, dict), "a map", value)
        out = {}
        for k, v in value.items():
            try:
                out[k] = entry(v)
            except Invalid as e:
                raise e.at(f".{k}") from None
        return out

    return to_dict


def _dataclass(cls: type) -> Converter:
    hints = typing.get_type_hints(cls)
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
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append((f.name, converter(hints[f.name]), required))
    return build


def _passes(conv: Converter, value: Any) -> bool:
    try:
        conv(value)
    except Invalid:
        return False
    return True
