"""The call contracts of the dataflow's Lua scripts (`lua/<name>.lua`; see `streams.contract`)."""

from __future__ import annotations

from astraflow.streams.contract import Arg, Contract, KeyList, List, Many, Pairs

READY_SETS = KeyList("readys", doc="the ready set of each model")
ROOM_ARGS = (
    Arg("raas_group"),
    Arg("backlog_limit", "int", "None: no room wanted (collect)"),
    Arg("ready_limit", "int", "in batch units"),
    Arg("unit", doc="the batch unit, 'groups' or 'samples'"),
    Arg("batch_size", "int"),
)
ROOM_REPLY = "{room, ready sets full (1/0), cursor, notice (-1: none yet), eval due} (`room`, common.lua)"

SUBMIT = Contract(
    "submit",
    keys=("prompts", "state", "in_flight", "ledger", "traces"),
    rest=READY_SETS,
    args=(
        Arg("expected", "int", "the dataset cursor the items start at"),
        *ROOM_ARGS,
        Arg("trace_prefix", doc="`Keys.trace_prefix`"),
        Arg("trace_ttl_s"),
        Arg("now"),
        Arg("trace_max", "int", "trace_max_groups"),
        Arg("trace_every", "int", "a trace for the positions it divides; 0: none"),
        Many(
            "items",
            (Arg("submit", "flag"), Arg("uid"), Arg("row"), Arg("version"), Pairs("fields")),
            "one per dataset position: submitted as `fields` (a PromptGroup entry) or skipped",
        ),
    ),
    reply=f"{{status ('ok', 'full' or 'moved'), submitted, the room left: {ROOM_REPLY}}}",
)
SUBMIT_EVAL = Contract(
    "submit_eval",
    keys=("prompts", "state", "in_flight", "ledger", "metrics"),
    args=(
        Arg("version"),
        Arg("now"),
        Arg("metrics_maxlen"),
        Many("datasets", (Arg("name"), Arg("rows"))),
        Many("groups", (Arg("uid"), Pairs("fields"))),
    ),
    reply="the groups submitted (0: already submitted)",
)
ROOM = Contract("room", keys=("prompts", "state"), rest=READY_SETS, args=ROOM_ARGS, reply=ROOM_REPLY)
CURATOR_KEYS = ("curator_state", "streak")
"""The selected curator's own hash (`Curator.state`) and the zero-variance streaks some curators share."""
CURATOR_ARGS = (
    Arg("curator", doc="the registered name of the curator whose Lua half runs ('' = none)"),
    Pairs("curator_params", doc="its settings (`Curator.lua_params`)"),
)
COLLECT = Contract(
    "collect",
    keys=("rollouts", "in_flight", "ledger", "state", *CURATOR_KEYS, "errors", "metrics", "prompts"),
    rest=KeyList("models", ("ready", "samples", "refs"), "per model: ready set, samples hash, refs hash"),
    args=(
        Arg("group"),
        Arg("consumer"),
        Arg("max_staleness", "int"),
        Arg("trace_prefix", doc="`Keys.trace_prefix`"),
        Arg("trace_ttl_s"),
        Arg("order", doc="'edf' or 'fifo'"),
        Arg("now"),
        *CURATOR_ARGS,
        Arg("written", "flag", "the caller wrote the accepted parts' bytes"),
        Many(
            "items",
            (
                Arg("entry_id"),
                Arg("uid"),
                Arg("mean_reward", doc="'' = none"),
                Arg("zero_var", "flag"),
                Pairs("trace"),
                Many(
                    "parts",
                    (
                        Arg("model"),
                        Arg("index", "int", "the model's place in `models`"),
                        Arg("reason", doc="'' = accept"),
                        Arg("min_version", "int"),
                        Arg("n_samples"),
                        Arg("payload", "bytes", "'' = none passed"),
                    ),
                ),
            ),
        ),
        Arg("metrics_maxlen"),
        Many(
            "records", (Pairs("fields"),), "the collector's `metrics` entries, written when all settle 'ok'"
        ),
        *ROOM_ARGS,
    ),
    reply="{records written (1/0), per item {status, outcome per part...}, the feeder's room after the "
    f"settle ({{}} when not wanted): {ROOM_REPLY}}}",
    include=("curators",),
)
FORM = Contract(
    "form",
    keys=("ready", "samples", "refs", "replay", "batches", "ledger", "state", "formed", "identity"),
    args=(
        Arg("model"),
        Arg("max_staleness", "int"),
        Arg("size", "int"),
        Arg("unit", doc="'samples' or 'groups'"),
        Arg("replay_quota", "int", "in units"),
        Arg("selection", doc="replay selection, 'latest' or 'uniform'"),
        Arg("capacity", "int", "replay capacity in groups; 0 = keep none"),
        Arg("prefetch", "int"),
        Arg("trainer_group"),
        Arg("trace_prefix"),
        Arg("trace_ttl_s"),
        Arg("order"),
        Arg("now"),
        List("randoms", "num", "for 'uniform': random numbers in [0, 1)"),
    ),
    reply="{status ('ok', 'full', 'wait'), batch uid, fresh groups, replayed groups, expired groups, units "
    "missing: for this batch ('wait'), for the next one ('ok'), 0 ('full')}",
)
VERSION = Contract(
    "version",
    keys=("versions", "state", "errors"),
    args=(
        Arg("group"),
        Arg("consumer"),
        Arg("id"),
        Arg("model"),
        Arg("version", "int"),
        Arg("manifest_key"),
        Arg("eval", "flag"),
        Arg("checkpoint"),
        Arg("incarnation"),
        Arg("max_step", "int"),
    ),
    reply="'ok', 'dup', 'lost' or 'far'",
)
ANNOUNCE = Contract(
    "announce",
    keys=("notices", "state", *CURATOR_KEYS),
    args=(
        Arg("expected", "int", "the last announced version (-1 = none yet)"),
        Arg("version", "int"),
        Arg("maxlen"),
        *CURATOR_ARGS,
        List("forget", doc="state fields to delete"),
        Pairs("notice", doc="the notice's fields"),
    ),
    reply="{status ('ok'/'moved'), the last announced version}",
    include=("curators",),
)
SET_ASIDE = Contract(
    "set_aside",
    keys=("batches", "dead", "errors", "ledger"),
    args=(
        Arg("group"),
        Arg("consumer"),
        Arg("id"),
        Arg("model"),
        Arg("reason"),
        Arg("dead_maxlen"),
        Arg("max_field_bytes", "int"),
        Arg("attempts_field"),
        Arg("error_field"),
    ),
    reply="'ok', 'dup' (already settled: a retry) or 'lost' (another consumer owns it now)",
)
CONTRACTS = (SUBMIT, SUBMIT_EVAL, ROOM, COLLECT, FORM, VERSION, ANNOUNCE, SET_ASIDE)
