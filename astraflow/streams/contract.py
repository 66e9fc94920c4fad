"""A Lua script's call contract, declared once in Python: its keys by name, its arguments by name and type
(variable-length and nested lists included), its reply.

The caller builds a call only through the declaration (`Contract.call`, keyword arguments), and the
script reads its keys and arguments only as `Key.<name>` and `Arg.<name>`: tables generated into its
prelude (`Contract.lua`, with straight-line code that reads them) when it is registered
(`connection.register_scripts`). No script spells `KEYS[n]` or `ARGV[n]`; `check` refuses a script that
reads a name its contract does not declare, or declares one it never reads (at registration, and in
`tests/unit/test_script_contracts.py` for every script).

Each package with Lua scripts declares their contracts in its `scripts` module (`CONTRACTS`), one per
`lua/<name>.lua`. A contract may `include` a folder of Lua files (`lua/<folder>/<name>.lua`): each
returns a table, assembled into the script as `<folder>[name]` (e.g. the curators' Lua halves, selected
by their registered names).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["str", "int", "num", "flag", "bytes"]
"""How a value reaches Lua: as it is (`str`, `bytes`), a number (`int`, `num`: tonumber, nil for None),
or `flag` (a bool, true in Lua)."""


@dataclass(frozen=True)
class Arg:
    """One value. None is sent as '' (a number then reads as nil in Lua)."""

    name: str
    kind: Kind = "str"
    doc: str = ""


@dataclass(frozen=True)
class List:
    """A count, then that many values of one kind: a Lua list."""

    name: str
    kind: Kind = "str"
    doc: str = ""


@dataclass(frozen=True)
class Pairs:
    """A count, then that many name-value pairs (a mapping in Python): a flat Lua list, ready to unpack
    into HSET or XADD."""

    name: str
    doc: str = ""


@dataclass(frozen=True)
class Many:
    """A count, then that many records of `fields` (mappings by field name in Python): a Lua list of
    tables with the same names."""

    name: str
    fields: tuple[Arg | List | Pairs | Many, ...]
    doc: str = ""


@dataclass(frozen=True)
class KeyList:
    """The keys after the named ones: a Lua list of keys, or with `fields`, of tables of that many keys
    each (records: mappings by field name in Python)."""

    name: str
    fields: tuple[str, ...] = ()
    doc: str = ""


Field = Arg | List | Pairs | Many

KEY_LIST = """
-- Generated from astraflow/streams/contract.py: the keys from KEYS[from] on, a list of keys, or with
-- `fields` of tables of that many keys each.
local function key_list(from, fields)
  local out = {}
  local width = math.max(1, #fields)
  for i = from, #KEYS, width do
    if #fields == 0 then
      out[#out + 1] = KEYS[i]
    else
      local record = {}
      for j, f in ipairs(fields) do record[f] = KEYS[i + j - 1] end
      out[#out + 1] = record
    end
  end
  return out
end
"""
"""The Lua of a contract's `rest` keys (`Contract.lua`)."""


@dataclass(frozen=True)
class Contract:
    """What one script takes and returns. `keys`: its named keys, in order; `rest`: the keys after them;
    `args`: its arguments, in order; `reply`: what it returns; `include`: folders of Lua parts it is
    assembled with (see the module)."""

    name: str
    keys: tuple[str, ...]
    args: tuple[Field, ...]
    reply: str
    rest: KeyList | None = None
    include: tuple[str, ...] = ()
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        names = [*self.keys, *([self.rest.name] if self.rest else []), *(a.name for a in self.args)]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a key or argument name is declared twice: {names}")
        object.__setattr__(self, "names", frozenset(names))

    def call(self, **values: object) -> tuple[list, list]:
        """The KEYS and ARGV of a call, from every declared key and argument by name."""
        if values.keys() != self.names:
            wrong = sorted(values.keys() ^ self.names)
            raise TypeError(f"{self.name}.lua takes exactly {sorted(self.names)}; wrong: {wrong}")
        keys = [values[k] for k in self.keys]
        if self.rest is not None:
            fields = self.rest.fields
            for item in values[self.rest.name]:  # type: ignore[attr-defined]
                keys += [item[f] for f in fields] if fields else [item]
        args: list = []
        _encode(self.args, values, args)
        return keys, args

    def lua(self) -> str:
        """The prelude that makes this contract's `Key` and `Arg` tables (see the module)."""
        items = [f"{k} = KEYS[{i}]" for i, k in enumerate(self.keys, 1)]
        lines = [
            f"-- Generated from the contract of {self.name}.lua: its keys and arguments by name.",
        ]
        lines.append(f"local Key = {{{', '.join(items)}}}")
        if self.rest is not None:
            fields = "{" + ", ".join(f"'{f}'" for f in self.rest.fields) + "}"
            lines += [KEY_LIST, f"Key.{self.rest.name} = key_list({len(self.keys) + 1}, {fields})"]
        lines += [
            "local Arg = " + _presized(self.args),
            "do",
            "  local at = 1",
            *_decoder(self.args, "Arg", 1),
        ]
        lines.append("end")
        return "\n".join(lines) + "\n"

    def check(self, script: str) -> None:
        """Raise ValueError when `script` (its own text and includes) reads KEYS or ARGV itself, a key or
        argument its contract does not declare, or declares one (or a record field) it never reads."""
        code = "\n".join(line.split("--", 1)[0] for line in script.splitlines())
        raw = re.search(r"\b(KEYS|ARGV)\b", script)
        if raw:
            raise ValueError(f"{self.name}.lua reads {raw.group(1)} itself: use Key.<name> / Arg.<name>")
        keys = {*self.keys, *([self.rest.name] if self.rest else [])}
        read_keys = set(re.findall(r"\bKey\.([a-z_]\w*)", code))
        read_args = set(re.findall(r"\bArg\.([a-z_]\w*)", code))
        wrong = (read_keys - keys) | (read_args - (self.names - keys))
        if wrong:
            raise ValueError(f"{self.name}.lua reads {sorted(wrong)}, not in its contract")
        unread = sorted(self.names - read_keys - read_args)
        code = re.sub(r"\b[A-Z]\w*\.\w+", "", code)  # (a record field is not a namespace's name)
        unread += [f for f in _nested(self.args) if not re.search(rf"\.{f}\b", code)]
        if self.rest is not None:
            unread += [f for f in self.rest.fields if not re.search(rf"\.{f}\b", code)]
        if unread:
            raise ValueError(f"{self.name}.lua never reads {unread} of its contract")


def _encode(fields: Sequence[Field], values: Mapping, out: list) -> None:
    for f in fields:
        v = values[f.name]
        if isinstance(f, Arg):
            out.append(_scalar(f.kind, v))
        elif isinstance(f, List):
            out.append(len(v))
            out += [_scalar(f.kind, x) for x in v]
        elif isinstance(f, Pairs):
            out.append(len(v))
            for name, value in v.items():
                out += (name, value)
        else:
            out.append(len(v))
            for record in v:
                if len(record) != len(f.fields):
                    raise TypeError(
                        f"{f.name}: a record takes {[g.name for g in f.fields]}, got {list(record)}"
                    )
                _encode(f.fields, record, out)


def _scalar(kind: str, v: object) -> object:
    if v is None:
        return ""
    if kind == "flag":
        return 1 if v else 0
    return v


def _presized(fields: Sequence[Field]) -> str:
    """A Lua table constructor with a slot for each field (filled in after: no rehash as they come)."""
    return "{" + ", ".join(f"{f.name} = false" for f in fields) + "}"


def _value(kind: str, v: str) -> str:
    """Lua reading ARGV value `v` as `kind`."""
    return {"int": f"tonumber({v})", "num": f"tonumber({v})", "flag": f"{v} == '1'"}.get(kind, v)


def _decoder(fields: Sequence[Field], into: str, depth: int) -> list[str]:
    """Straight-line Lua reading `fields` from ARGV[at] on into table `into`, `at` left after them (no
    interpreter of a spec: the hand-off runs this for every item it carries)."""
    pad = "  " * depth
    lines = []
    for f in fields:
        if isinstance(f, Arg):
            lines.append(f"{pad}{into}.{f.name} = {_value(f.kind, 'ARGV[at]')}; at = at + 1")
        elif isinstance(f, List | Pairs):
            width, kind = (2, "str") if isinstance(f, Pairs) else (1, f.kind)
            lines += [
                f"{pad}do",
                f"{pad}  local n, list = tonumber(ARGV[at]) * {width}, {{}}",
                f"{pad}  for i = 1, n do list[i] = {_value(kind, 'ARGV[at + i]')} end",
                f"{pad}  {into}.{f.name}, at = list, at + 1 + n",
                f"{pad}end",
            ]
        else:
            n, items, record, i = f"n{depth}", f"list{depth}", f"r{depth}", f"i{depth}"
            lines += [
                f"{pad}do",
                f"{pad}  local {n}, {items} = tonumber(ARGV[at]), {{}}",
                f"{pad}  at = at + 1",
                f"{pad}  for {i} = 1, {n} do",
                f"{pad}    local {record} = {_presized(f.fields)}",
                *_decoder(f.fields, record, depth + 2),
                f"{pad}    {items}[{i}] = {record}",
                f"{pad}  end",
                f"{pad}  {into}.{f.name} = {items}",
                f"{pad}end",
            ]
    return lines


def _nested(fields: Sequence[Field]) -> list[str]:
    """The names of every record field (of `Many` arguments, at any depth)."""
    out = []
    for f in fields:
        if isinstance(f, Many):
            out += [g.name for g in f.fields] + _nested(f.fields)
    return out


def declared(package: str, name: str) -> Contract:
    """The contract of `<package>/lua/<name>.lua`, from `<package>.scripts.CONTRACTS`."""
    contracts = importlib.import_module(f"{package}.scripts").CONTRACTS
    try:
        return next(c for c in contracts if c.name == name)
    except StopIteration:
        raise KeyError(f"{package}/lua/{name}.lua has no contract in {package}.scripts") from None


def includes(contract: Contract, lua) -> str:
    """The Lua of the folders `contract` includes: per folder a table of its files' tables, by file name
    (`lua` the package's `lua` folder, a `Traversable`)."""
    lines = []
    for folder in contract.include:
        lines.append(f"local {folder} = {{}}")
        for part in sorted((p for p in (lua / folder).iterdir() if p.name.endswith(".lua")), key=str):
            lines.append(f"{folder}['{part.name[:-4]}'] = (function()\n{part.read_text()}\nend)()")
    return "\n".join(lines) + "\n" if lines else ""
