"""The call contracts of the bus's Lua scripts (`lua/<name>.lua`; see `streams.contract`)."""

from __future__ import annotations

from astraflow.streams.contract import Arg, Contract, KeyList, List, Many, Pairs

HANDOFF = Contract(
    "handoff",
    keys=("input", "errors"),
    rest=KeyList(
        "outputs",
        doc="output streams and dedup keys, referenced by index (1-based) from the items; and where an "
        "item settles a group, the in-flight set and the ledger",
    ),
    args=(
        Arg("settle", "int", "index in `outputs` of the in-flight set, the ledger after it (0: none)"),
        Arg("group"),
        Arg("consumer"),
        Arg("ttl_ms", "int", "how long a dedup marker lives"),
        Many(
            "items",
            (
                Arg("input_id", doc="'' for a plain publish"),
                Arg("dead_uid", doc="the prompt group it settles as dead ('' = none)"),
                Many(
                    "outs",
                    (
                        Arg("stream", "int", "index in `outputs`"),
                        Arg("dedup", "int", "index in `outputs` (0 = none)"),
                        Arg("binding", doc="'' = none"),
                        Pairs("fields"),
                    ),
                ),
            ),
        ),
    ),
    reply="{replies, ignored}: per item {status, id of each output ('' when unknown)}; the dedup keys whose "
    "markers were ignored",
)
RENEW = Contract(
    "renew",
    keys=("stream",),
    args=(Arg("group"), Arg("consumer"), List("ids")),
    reply="the ids this consumer no longer owns",
)
RELEASE = Contract(
    "release",
    keys=("stream", "errors"),
    args=(Arg("group"), Arg("consumer"), Arg("id"), Arg("reason")),
    reply="1, or 0 if not owned",
)
CLAIM = Contract(
    "claim",
    keys=("stream", "errors"),
    rest=KeyList(
        "settle",
        ("dead", "in_flight", "ledger"),
        "none, or where an entry past max_deliveries goes and the group it settles: without them a claim "
        "leaves such entries pending for a 'reap' (a RaaS may write none of the three)",
    ),
    args=(
        Arg("mode", doc="'own', 'others' or 'reap' (dead-letter only; needs `settle`)"),
        Arg("group"),
        Arg("consumer"),
        Arg("min_idle", "int", "min_idle_ms ('others', 'reap') or since (ms, 'own')"),
        Arg("start"),
        Arg("count", "int"),
        Arg("max_deliveries", "int"),
        Arg("dead_maxlen"),
        Arg("tracked", "flag"),
        Arg("max_field_bytes", "int"),
        List("skip", doc="ids the consumer still holds"),
    ),
    reply="{next_start, {id, deliveries, f1, v1, ...}...}; next_start is '' once the scan reached the end; "
    "'reap': {next_start, {id, deliveries}...} of the entries dead-lettered",
)
TRIM = Contract(
    "trim",
    keys=("stream",),
    args=(Arg("forget_idle_ms", "int"), Arg("run_group")),
    reply="the number of entries removed",
)
REPAIR = Contract(
    "repair",
    keys=("stream",),
    args=(Arg("group", doc="the run's group on it ('' for none)"), Arg("horizon_ms", "int")),
    reply="the number of entries deleted, or -1 where nothing was wrong",
)
CREATE_RUN = Contract(
    "create_run",
    keys=("identity",),
    args=(Arg("nonce"), Arg("created", doc="unix seconds")),
    reply="{nonce, created} (never stopped: the stop notice is apart)",
)
STRAYS = Contract(
    "strays",
    keys=("in_flight", "dead", "ledger"),
    rest=KeyList("streams", doc="the tracked streams"),
    args=(
        Arg("dead_maxlen"),
        Arg("reason"),
        List("groups", doc="the run's group of each tracked stream"),
        List("uids", doc="uids to settle"),
    ),
    reply="{settled uids, uids stranded now (after settling)}",
)
TAKE_NAME = Contract(
    "take_name",
    keys=("name",),
    args=(Arg("holder"), Arg("ttl_ms"), Arg("expected", doc="its own holder value, or a dead holder's")),
    reply="the holder that keeps it, or nil when taken",
)
FREE_NAME = Contract("free_name", keys=("name",), args=(Arg("holder"),), reply="1")
BEAT = Contract(
    "beat",
    keys=("name", "heartbeat"),
    args=(Arg("holder"), Arg("ttl_ms"), Arg("holder_field"), Pairs("fields")),
    reply="1 if written, 0 when the name holds another",
)
CONTRACTS = (HANDOFF, RENEW, RELEASE, CLAIM, TRIM, REPAIR, CREATE_RUN, STRAYS, TAKE_NAME, FREE_NAME, BEAT)
