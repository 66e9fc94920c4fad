"""The data model table is generated from the schema: every declared name is on it."""

from astraflow.streams import schema
from astraflow.streams.datamodel_doc import DOC, ROWS, render, updated


def test_the_table_lists_every_namespace_and_name_of_the_schema() -> None:
    page = render()
    listed = {fields for _, _, fields in ROWS if not isinstance(fields, str)}
    assert listed == set(schema.NAMESPACES) - {schema.Entry}  # (Entry: on the message streams' rows)
    for ns in schema.NAMESPACES:
        for value in schema.names(ns).values():
            text = value.template.replace("{}", "<>") if isinstance(value, schema.Family) else value
            assert text.replace("|", "\\|") in page, (ns.__name__, text)


def test_the_architecture_doc_holds_the_table_as_generated() -> None:
    page = DOC.read_text()
    assert updated(page) == page, f"{DOC} is stale: run `python -m astraflow.streams.datamodel_doc`"
