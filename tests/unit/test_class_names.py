"""Names that mean one thing across the code base: a class of the data model (`streams.schema`) is the only
class of its name, and no module imports a name under a one-letter alias to dodge a collision."""

import ast
from pathlib import Path

import astraflow
from astraflow.streams import schema

ROOT = Path(astraflow.__file__).parent


def _trees():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT.parent), ast.parse(path.read_text())


def one_letter_aliases(tree: ast.AST) -> list[str]:
    """`import x as y` / `from m import x as y` with a one-letter `y` in `tree`."""
    return [
        f"{a.name} as {a.asname}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for a in node.names
        if a.asname is not None and len(a.asname) == 1
    ]


def classes_named_like_the_schema(tree: ast.AST) -> list[str]:
    """Classes in `tree` that take the name of a namespace of the schema."""
    taken = {ns.__name__ for ns in schema.NAMESPACES}
    return [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in taken]


def test_no_module_imports_under_a_one_letter_alias():
    found = [f"{path}: {alias}" for path, tree in _trees() for alias in one_letter_aliases(tree)]
    assert found == []


def test_a_schema_namespace_is_the_only_class_of_its_name():
    schema_file = Path(schema.__file__).relative_to(ROOT.parent)
    found = [
        f"{path}: class {name}"
        for path, tree in _trees()
        if path != schema_file
        for name in classes_named_like_the_schema(tree)
    ]
    assert found == []


def test_the_checks_see_what_they_look_for():
    tree = ast.parse("from astraflow.streams.schema import Entry as E\nclass DeadLetter:\n    pass\n")
    assert one_letter_aliases(tree) == ["Entry as E"]
    assert classes_named_like_the_schema(tree) == ["DeadLetter"]
    assert one_letter_aliases(ast.parse("import numpy as np\n")) == []
