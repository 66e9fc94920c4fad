"""The run's data model has one home (`astraflow/streams/schema.py`): these tests fail when a Lua script or
a Python module spells a state field, ledger counter or entry field itself instead of taking it from the
schema (Lua: the generated prelude, `schema.lua_prelude`; Python: the schema's names)."""

import ast
import re
from pathlib import Path

import pytest

import astraflow
from astraflow.streams import schema

pytestmark = pytest.mark.timeout(60)
ROOT = Path(astraflow.__file__).parent
LUA = sorted([*ROOT.glob("*/lua/*.lua"), *ROOT.glob("*/lua/*/*.lua")])  # (with the curators' halves)
HASH_AND_STREAM = ("HSET", "HSETNX", "HGET", "HMGET", "HINCRBY", "HDEL", "HEXISTS", "XADD")
KEYWORDS = {"MAXLEN", "~", "*"}
VALUES = {"samples", "unknown", "skip_zero_variance"}
"""Lua literals that are values (`batch.unit`, a reply status, a curator), not names, though spelled like
one (or holding a family's fixed part: `p_`)."""


def constants(*namespaces: type) -> set[str]:
    return {v for ns in namespaces for v in schema.names(ns).values() if isinstance(v, str)}


def segments(*namespaces: type) -> set[str]:
    """The fixed parts of the families' templates that hold a letter (`v:`, `:dropped:`, `field.`)."""
    out = set()
    for ns in namespaces:
        for v in schema.names(ns).values():
            if isinstance(v, schema.Family):
                out |= {p for p in v.template.split("{}") if re.search(r"[a-z]", p)}
    return out


LUA_NAMES = {s for s in constants(*schema.NAMESPACES) - VALUES if not s.isdigit()}
LUA_SEGMENTS = segments(*schema.NAMESPACES)


def lua_code(text: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def lua_calls(code: str):
    """(command, argument text) of each `redis.call('CMD', ...)` of a hash or stream command."""
    for m in re.finditer(r"redis\.call\('([A-Z]+)'", code):
        if m.group(1) not in HASH_AND_STREAM:
            continue
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        yield m.group(1), code[m.end() : i - 1]


def lua_offences(path: Path, text: str) -> list[str]:
    code, out = lua_code(text), []
    for command, args in lua_calls(code):
        literals = [s for s in re.findall(r"'([^']*)'", args) if re.search(r"\w", s)]  # (not separators)
        out += [f"{path.name}: {command} '{s}'" for s in literals if s not in KEYWORDS]
    for s in re.findall(r"'([^'\n]*)'", code):
        if "%" in s or "^" in s or s in VALUES:  # a pattern, a value
            continue
        if s in LUA_NAMES or any(seg in s for seg in LUA_SEGMENTS):
            out.append(f"{path.name}: '{s}' spells a name of the schema")
    return out


def test_lua_scripts_take_every_name_from_the_schema():
    offences = [o for path in LUA for o in lua_offences(path, path.read_text())]
    assert offences == []


def test_a_field_literal_added_to_a_lua_script_fails():
    path = ROOT / "dataflow" / "lua" / "version.lua"
    text = path.read_text() + "\nredis.call('HSET', state, 'bogus', 1)\n"
    assert lua_offences(path, text) == ["version.lua: HSET 'bogus'"]
    text = path.read_text() + "\nlocal f = 'v:' .. model\n"
    assert lua_offences(path, text) == ["version.lua: 'v:' spells a name of the schema"]


def test_every_lua_script_runs_with_the_generated_prelude():
    """Every namespace a script uses is defined by its prelude (and no undeclared one is used)."""
    for path in LUA:
        code = lua_code(path.read_text())
        used = set(re.findall(r"\b([A-Z][A-Za-z]+)\.[a-z_]+", code))
        declared = {ns.__name__ for ns in (*schema.NAMESPACES, *schema.VALUE_NAMESPACES)}
        assert used - {"Key", "Arg"} <= declared, (path.name, used - declared)  # (Key, Arg: its contract's)
        for name, attr in re.findall(r"\b([A-Z][A-Za-z]+)\.([a-z_]+)", code):
            if name not in ("Key", "Arg"):
                assert attr in schema.names(getattr(schema, name)), f"{path.name}: {name}.{attr} not declared"


# -- Python ----------------------------------------------------------------------------------------------

STATE = constants(schema.State)
COUNTERS = constants(schema.Counters)
PREFIXES = tuple(
    v.template.split("{}")[0]
    for ns in (schema.State, schema.Counters)
    for v in schema.names(ns).values()
    if isinstance(v, schema.Family) and v.template.split("{}")[0] and v is not schema.State.batches
)
MID = tuple(
    v.template.split("{}")[1]
    for v in schema.names(schema.Counters).values()
    if isinstance(v, schema.Family) and v.template.startswith("{}")
)
OWNERS = {ROOT / "streams" / "schema.py", ROOT / "streams" / "keys.py"}
REDIS = {"hget", "hmget", "hset", "hincrby", "hsetnx", "hdel", "hexists"}
LOOKUPS = {"get", "setdefault", "pop", *REDIS}


def _spelled(node: ast.AST) -> str | None:
    """The text of a string or f-string's leading constant part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def python_offences(path: Path, text: str) -> list[str]:
    tree, out = ast.parse(text), []
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    docstrings |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    docstrings |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        text_ = None if id(node) in docstrings else _spelled(node)
        if text_ is not None and (text_.startswith(PREFIXES) or any(m in text_ for m in MID)):
            if isinstance(node, ast.JoinedStr) or text_ in PREFIXES or re.fullmatch(r"[\w:]+", text_):
                out.append(f"{path.name}:{node.lineno}: {text_!r} spells a state field or counter")
        # A state field by name anywhere; a counter (common words: `dead`, `collected`) in Redis calls.
        used, names = [], STATE
        if isinstance(node, ast.Subscript):
            used = [node.slice]
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            used = [node.left]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in LOOKUPS:
            redis = node.func.attr in REDIS  # type: ignore[attr-defined]
            used, names = list(node.args), STATE | (COUNTERS if redis else set())
        for arg in used:
            if isinstance(arg, ast.Constant) and arg.value in names:
                out.append(f"{path.name}:{node.lineno}: {arg.value!r} read or written by name")
    return out


def test_python_modules_take_state_fields_and_counters_from_the_schema():
    paths = [path for path in sorted(ROOT.rglob("*.py")) if path not in OWNERS]
    offences = [o for path in paths for o in python_offences(path, path.read_text())]
    assert offences == []


def test_a_state_field_spelled_in_python_fails():
    path = ROOT / "dataflow" / "barrier.py"
    text = path.read_text() + '\n\ndef f(state, m):\n    return state.get(f"v:{m}"), state["notice"]\n'
    assert len(python_offences(path, text)) == 2


ENTRY_OWNERS = {*OWNERS, ROOT / "streams" / "records.py"}
ENTRY_FIELDS = {"reward_sum", "sums", "source_id", "deliveries", "fields_truncated"}
"""Fields of metrics records and dead letters whose names are not common words: spelled only by the
schema and `streams.records` (the one encoder and decoder of those entries)."""


def _kind_read(node: ast.AST) -> bool:
    """`x["kind"]` or `x.get("kind")`: an entry's kind read by name."""
    if isinstance(node, ast.Subscript):
        key = node.slice
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
        key = node.args[0]
    else:
        return False
    return isinstance(key, ast.Constant) and key.value == schema.Entry.kind


def entry_offences(path: Path, text: str) -> list[str]:
    """Metrics and dead-letter entries read or written by field name, or told apart by `kind`, outside
    their decoder (the messages are told apart by `messages.decode`)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare) and _kind_read(node.left):
            out.append(f"{path.name}:{node.lineno}: an entry's kind compared by name")
        if isinstance(node, ast.Constant) and node.value in ENTRY_FIELDS:
            out.append(f"{path.name}:{node.lineno}: {node.value!r} spells an entry field")
    return out


def test_python_modules_read_metrics_and_dead_letters_through_their_records():
    paths = [path for path in sorted(ROOT.rglob("*.py")) if path not in ENTRY_OWNERS]
    offences = [o for path in paths for o in entry_offences(path, path.read_text())]
    assert offences == []


def test_a_metrics_entry_read_by_field_name_fails():
    path = ROOT / "ops" / "scale_plan.py"
    added = '\n\ndef f(f):\n    return f.get("kind") == "rollouts" and float(f["reward_sum"])\n'
    text = path.read_text() + added
    assert len(entry_offences(path, text)) == 2
