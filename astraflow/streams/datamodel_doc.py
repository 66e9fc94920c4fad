"""The run's data model as a markdown table, generated from `streams.schema`:
`python -m astraflow.streams.datamodel_doc [OUT.md]` (for docs/ARCHITECTURE.md's key table)."""

from __future__ import annotations

import sys
from pathlib import Path

from astraflow.streams import schema
from astraflow.streams.schema import GROUP_DATAFLOW, GROUP_RAAS, GROUP_TRAINER, Family

ENTRY = ", ".join(f"`{v}`" for v in schema.names(schema.Entry).values())
ROWS = [
    ("prompts", f"stream, group `{GROUP_RAAS}`", f"prompt groups: {ENTRY}; plain `policy`, `workflow`, `n`"),
    (
        "rollouts",
        f"stream, group `{GROUP_DATAFLOW}`",
        "rollout groups: the same; plain `raas`, `reward` (mean), `token_versions`, `tokens`, `status`",
    ),
    (
        "versions",
        f"stream, group `{GROUP_DATAFLOW}`",
        "published versions; plain `step`, `incarnation`, `eval`",
    ),
    ("notices", "capped stream", "versions to load; plain `load` (`model=version ...`), `eval`"),
    ("batches:<model>", f"stream, group `{GROUP_TRAINER}`", schema.BatchEntry),
    ("dead", "capped stream", schema.DeadLetter),
    ("metrics", "capped stream", schema.MetricEntry),
    ("raas:<id>", "hash, TTL", "a heartbeat: the message, plain `capacity`, `in_flight`, `versions`, ..."),
    ("state", "hash", schema.State),
    ("ledger", "hash", schema.Counters),
    ("errors", "hash", schema.Errors),
    ("run", "hash", schema.Identity),
    ("curator:greso", "hash", schema.Greso),
    ("trace:<uid>", "hash, TTL", schema.Trace),
]


def _names(namespace: type) -> str:
    out = []
    for attr, value in schema.names(namespace).items():
        text = value.template.replace("{}", "<>") if isinstance(value, Family) else value
        if attr.startswith(("kind", "schema")):  # the value of a header, not a field's name
            text = f"{attr.split('_')[0]}={text}"
        out.append(f"`{text}`".replace("|", "\\|"))
    return f"`{namespace.__name__}`: " + ", ".join(out)


def render() -> str:
    lines = [
        "# The run's data model",
        "",
        "Every key of run RUN starts with `af:{RUN}:`. Names come from `astraflow/streams/schema.py` (Lua",
        "scripts get them from a prelude generated from it); this table is generated from it too:",
        "`python -m astraflow.streams.datamodel_doc`. `astraflow peek KEY` decodes any entry to JSON.",
        "",
        "| key | type | fields (`<>`: a model, version, reason, ...) |",
        "|---|---|---|",
    ]
    for key, kind, fields in ROWS:
        lines.append(f"| `{key}` | {kind} | {fields if isinstance(fields, str) else _names(fields)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(render())
    else:
        print(render(), end="")
