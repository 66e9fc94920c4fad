"""docs/settings.md from the settings classes: `python -m astraflow.settings_doc [--check]`.

A table per section: dotted name, type, default (never a secret's), the docstring under the field.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import re
import sys
import textwrap
import types
import typing
from pathlib import Path

from pydantic import BaseModel, TypeAdapter

from astraflow.config import Settings

DOC = Path("docs") / "settings.md"
PIPE = {ord("|"): "\\|"}  # escaped in table cells
HEADER = """# Settings reference

Generated from the settings classes by `python -m astraflow.settings_doc` (a unit test fails when stale).
Precedence, highest first: `--set section.key=value`, env `ASTRAFLOW_SECTION__KEY=value`, the recipe
YAML, these defaults. Errors name the field and where its value came from; secrets (`redis.password`, a
password inside `redis.url`, `weights.secret`, ...) are never printed. `astraflow config RECIPE` prints the
effective settings, and under `policies` those of each policy ([recipes.md](recipes.md#policies)).
"""


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal right under an annotated field) of `cls` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not issubclass(klass, BaseModel) or klass.__module__.startswith("pydantic"):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in itertools.pairwise(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _is_model(t: typing.Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def nested(annotation: typing.Any) -> tuple[list[type[BaseModel]], bool]:
    """The models a field holds, directly or in an Optional/union, and whether as `dict[str, Model]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if _is_model(annotation):
        return [annotation], False
    if origin in (typing.Union, types.UnionType):
        return [a for a in args if _is_model(a)], False
    keyed = origin is dict and len(args) == 2 and _is_model(args[1])
    return ([args[1]], True) if keyed else ([], False)


def type_name(annotation: typing.Any) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", str(annotation)).replace("NoneType", "None")


def default_text(field: typing.Any) -> str:
    if "SecretStr" in str(field.annotation):
        return "(secret)"
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    shown = TypeAdapter(field.annotation).dump_python(value, mode="json")
    return "" if isinstance(value, BaseModel) else json.dumps(shown)


def rows(model: type[BaseModel], prefix: str) -> list[str]:
    """A table row per field of `model` (name, type, default, doc), a nested model's after its field."""
    docs, out = field_docs(model), []
    for name, field in model.model_fields.items():
        dotted, default, doc = f"{prefix}{name}", default_text(field), field.description or docs.get(name, "")
        kind, shown = type_name(field.annotation).translate(PIPE), default and f"`{default.translate(PIPE)}`"
        out.append(f"| `{dotted}` | `{kind}` | {shown} | {doc.translate(PIPE)} |\n")
        models, keyed = nested(field.annotation)
        for sub in models:
            out.extend(rows(sub, f"{dotted}.<name>." if keyed else f"{dotted}."))
    return out


def render(root: type[BaseModel] = Settings) -> str:
    """The whole reference for `root`: one table per section."""
    parts, docs = [HEADER], field_docs(root)
    for section, field in root.model_fields.items():
        models, _ = nested(field.annotation)
        parts.append(f"\n## `{section}`\n")
        if doc := field.description or docs.get(section) or (models and models[0].__dict__.get("__doc__")):
            parts.append(f"\n{' '.join(doc.split())}\n")
        parts.append("\n| setting | type | default | meaning |\n|---|---|---|---|\n")
        parts.extend(row for m in models for row in rows(m, f"{section}."))
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    text = render()
    if "--check" in (sys.argv[1:] if argv is None else argv):
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m astraflow.settings_doc", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
