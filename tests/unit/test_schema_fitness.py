"""The run's data model has one home (`astraflow/streams/schema.py`, keys in `streams/keys.py`): these
tests fail when a Lua script or a Python module spells a name of any of its namespaces, a value the
scripts write (an outcome, a drop reason, a GRESO kind, a uid format) or a key name itself instead of
taking it from the schema (Lua: the generated prelude, `schema.lua_prelude`; Python: the schema's names),
in any of the forms that were in use: f-strings, `%` and `+` building names, `hset(mapping={...})`, hash
commands' field lists, fields read after HGETALL, comparisons with a value; in Lua `redis.pcall`,
HINCRBYFLOAT, double-quoted strings and the literal text of patterns. Each form has a self-test that
injects it and shows it caught."""

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


# -- every form, every namespace, key names (issue 40) ------------------------------------------------------

ALL_NAMESPACES = (*schema.NAMESPACES, *schema.VALUE_NAMESPACES)
KEYS = schema.Keys("RUN")
NOT_KEYS = {
    "family",
    "short",
    "grouped_streams",
    "group_of",
    "tracked_streams",
    "capped_streams",
    "reaped_streams",
    "trace_prefix",
}
KEY_FAMILIES = [n for n, v in vars(schema.Keys).items() if not n.startswith("_") and n not in NOT_KEYS]
KEY_NAMES = {KEYS.family(n) for n in KEY_FAMILIES if not callable(getattr(KEYS, n))}
"""Whole key names (`prompts`, `run:stop`)."""
KEY_SEGMENTS = {
    seg
    for n in KEY_FAMILIES
    for seg in (
        KEYS.family(n, "\0").split("\0")
        if callable(getattr(KEYS, n))
        else [":" + KEYS.family(n).split(":", 1)[1]]
        if ":" in KEYS.family(n)
        else []
    )
    if re.search(r"[a-z]", seg) and ":" in seg
}
"""Fixed parts of the key families that hold a letter and a colon (`ready:`, `:peers`, `curator:`)."""
ALL_SEGMENTS = segments(*ALL_NAMESPACES) | KEY_SEGMENTS
FIELD_NAMES = constants(*schema.NAMESPACES) - VALUES
LUA_ALL_NAMES = (FIELD_NAMES | constants(*schema.VALUE_NAMESPACES) | KEY_NAMES) - VALUES
LUA_MAGIC = re.compile(r"%[a-zA-Z%]|[\^$()\[\]*+?]|\.-|\.")
LUA_STRING = re.compile(r"'([^'\n]*)'|\"([^\"\n]*)\"")


def lua_literals(code: str) -> list[tuple[str, bool]]:
    """(text, double-quoted) of every string literal of `code`."""
    return [
        (m.group(1) if m.group(1) is not None else m.group(2), m.group(2) is not None)
        for m in LUA_STRING.finditer(code)
    ]


def lua_offences_all(path: Path, text: str) -> list[str]:
    """A Lua script spelling a name of any namespace, a value, a key name or part of one: in a hash or
    stream command (`redis.call` or `redis.pcall`, HINCRBYFLOAT included), in a pattern (its literal
    text), in single or double quotes; and any double-quoted string (the house style is single)."""
    code, out = lua_code(text), []
    for m in re.finditer(r"redis\.p?call\('([A-Z]+)'", code):
        if m.group(1) in (*HASH_AND_STREAM, "HINCRBYFLOAT", "HMSET", "HGETALL", "HSTRLEN"):
            depth, i = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(code[i], 0)
                i += 1
            for s, _ in lua_literals(code[m.end() : i - 1]):
                if re.search(r"\w", s) and s not in KEYWORDS:
                    out.append(f"{path.name}: {m.group(1)} '{s}'")
    for s, double in lua_literals(code):
        if double:
            out.append(f'{path.name}: "{s}" is double-quoted')
        literal = LUA_MAGIC.sub(" ", s) if ("%" in s or "^" in s) else s  # a pattern: its literal text
        if s in VALUES:
            continue
        if literal in LUA_ALL_NAMES or any(seg in literal for seg in ALL_SEGMENTS):
            out.append(f"{path.name}: '{s}' spells a name of the schema")
    return out


def test_lua_scripts_spell_no_name_value_or_key_in_any_form():
    offences = [o for path in LUA for o in lua_offences_all(path, path.read_text())]
    assert offences == []


@pytest.mark.parametrize(
    ("added", "caught"),
    [
        ("redis.call('HINCRBYFLOAT', state, 'bogus', 1)", "HINCRBYFLOAT 'bogus'"),
        ("redis.pcall('HSET', state, 'bogus', 1)", "HSET 'bogus'"),
        ('local x = "v:" .. model', '"v:" is double-quoted'),
        ('local x = "v:" .. model', "'v:' spells a name"),
        ("local v = string.match(uid, '^eval:(%d+):')", "spells a name"),
        ("local r = string.match(o, '^dropped: (.+)$')", "spells a name"),
        ("local o = 'trained'", "'trained' spells a name"),
        ("local k = 'hard'", "'hard' spells a name"),
        ("local k = prefix .. 'ready:' .. model", "'ready:' spells a name"),
        ("local n = redis.call('HGET', k, 'stop_reason')", "HGET 'stop_reason'"),
        ("local n = redis.call('HGET', k, 'p_easy')", "'p_easy' spells a name"),
    ],
)
def test_each_lua_form_is_caught(added, caught):
    path = ROOT / "dataflow" / "lua" / "version.lua"
    assert any(caught in o for o in lua_offences_all(path, path.read_text() + "\n" + added + "\n"))


def _constants(node: ast.AST) -> list[str]:
    """The text of a str or bytes constant, or of each one in a list, tuple or set."""
    items = node.elts if isinstance(node, ast.List | ast.Tuple | ast.Set) else [node]
    out = []
    for n in items:
        if isinstance(n, ast.Constant) and isinstance(n.value, str | bytes):
            out.append(n.value.decode(errors="replace") if isinstance(n.value, bytes) else n.value)
    return out


def _built_text(node: ast.AST) -> str | None:
    """The fixed text of a string being built: an f-string's constant parts, `"..." % x`'s format, or a
    `+` of strings (None: not a string being built)."""
    if isinstance(node, ast.JoinedStr):
        return "\0".join(str(v.value) for v in node.values if isinstance(v, ast.Constant))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
        return re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[sdifr]", "\0", str(node.left.value))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        parts = [p for side in (node.left, node.right) for p in _constants(side)]
        return "\0".join(parts) if parts else None
    return None


def _name_like(part: str) -> bool:
    """Whether a fixed part of a string being built is part of a name (not prose that mentions one): it
    holds a segment, and nothing but name characters besides; or it is a whole key name."""
    if part in KEY_NAMES:
        return True
    return any(seg in part and re.fullmatch(r"[\w:.|*-]*", part.replace(seg, "")) for seg in ALL_SEGMENTS)


def python_offences_all(path: Path, text: str) -> list[str]:
    """A Python module building a name of any namespace or a key (an f-string, `%`, `+`), writing fields by
    name in `hset(mapping={...})` or a hash command's field list, reading a field by name from what
    HGETALL returned, or comparing with a value the Lua scripts write (an outcome, a drop reason)."""
    tree, out = ast.parse(text), []
    hashes: set[str] = set()  # names bound to an HGETALL's reply
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "hgetall"
            for c in ast.walk(node.value)
        ):
            hashes |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    values = constants(*schema.VALUE_NAMESPACES)
    for node in ast.walk(tree):
        built = _built_text(node)
        if built is not None and any(_name_like(part) for part in built.split("\0")):
            out.append(f"{path.name}:{node.lineno}: builds a name of the schema or a key ({built!r})")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in {*REDIS, "hgetall", "hmget"}:
            for kw in node.keywords:
                if kw.arg == "mapping" and isinstance(kw.value, ast.Dict):
                    names = [s for k in kw.value.keys if k is not None for s in _constants(k)]
                    out += [f"{path.name}:{node.lineno}: hset mapping spells {s!r}" for s in names]
            for arg in node.args[1:]:
                spelled = [
                    s for s in _constants(arg) if s in FIELD_NAMES or s.startswith(("p_", "zero_var_"))
                ]
                out += [f"{path.name}:{node.lineno}: {s!r} written or read by name" for s in spelled]
        read = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in hashes:
            read = node.slice
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "get"
            and isinstance(node.func.value, ast.Name)  # type: ignore[attr-defined]
            and node.func.value.id in hashes  # type: ignore[attr-defined]
            and node.args
        ):
            read = node.args[0]
        if read is not None:
            out += [f"{path.name}:{node.lineno}: {s!r} read by name after HGETALL" for s in _constants(read)]
        sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        if any(isinstance(x, ast.Name) and x.id == "status" for x in sides):
            continue  # (a script's or a step's status: a vocabulary of its own, `'ready'` among it)
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.Eq | ast.NotEq):
            for side in (node.left, *node.comparators):
                out += [
                    f"{path.name}:{node.lineno}: compares with {s!r}" for s in _constants(side) if s in values
                ]
    return out


def test_python_modules_spell_no_name_value_or_key_in_any_form():
    paths = [path for path in sorted(ROOT.rglob("*.py")) if path not in OWNERS]
    offences = [o for path in paths for o in python_offences_all(path, path.read_text())]
    assert offences == []


@pytest.mark.parametrize(
    ("added", "caught"),
    [
        ('def f(m):\n    return f"{m}:trained"', "builds a name"),
        ('def f(m):\n    return "v:%s" % m', "builds a name"),
        ('def f(m):\n    return "eval_pending:" + m', "builds a name"),
        ('def f(k):\n    return f"{k.identity}:stop"', "builds a name"),
        ('def f(k, m):\n    return f"{k.prefix}ready:{m}"', "builds a name"),
        ('async def f(r, k):\n    await r.hset(k, mapping={"stopped": 1})', "hset mapping spells 'stopped'"),
        ('async def f(r, k):\n    return await r.hmget(k, ["p_easy", "p_hard"])', "'p_easy' written or read"),
        ('async def f(r, k):\n    return await r.hget(k, "nonce")', "'nonce' written or read"),
        ('async def f(r, k):\n    h = await r.hgetall(k)\n    return h[b"stop_reason"]', "after HGETALL"),
        ('async def f(r, k):\n    h = await r.hgetall(k)\n    return h.get("anything")', "after HGETALL"),
        ('def f(o):\n    return o == "trained"', "compares with 'trained'"),
        ('def f(o):\n    return "stale_wait" != o', "compares with 'stale_wait'"),
    ],
)
def test_each_python_form_is_caught(added, caught):
    path = ROOT / "dataflow" / "barrier.py"
    assert any(caught in o for o in python_offences_all(path, path.read_text() + "\n\n" + added + "\n"))
