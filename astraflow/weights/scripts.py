"""The call contracts of the weight transfer's Lua scripts (`lua/<name>.lua`; see `streams.contract`)."""

from __future__ import annotations

from astraflow.streams.contract import Arg, Contract, KeyList, Pairs

ELECT = Contract(
    "elect",
    keys=("relay",),
    args=(
        Arg("endpoint", doc="this process's"),
        Arg("ttl_ms"),
        Arg("failed", doc="seen failing ('' = none)"),
    ),
    reply="the elected endpoint",
)
MANIFEST = Contract(
    "manifest",
    keys=("manifest", "peers"),
    args=(Arg("ttl_s"), Pairs("fields", doc="the manifest's fields")),
    reply="1",
)
RESIGN = Contract(
    "resign",
    keys=(),
    rest=KeyList("seats", doc="relay keys this process won"),
    args=(Arg("endpoint"),),
    reply="how many seats it deleted",
)
CONTRACTS = (ELECT, MANIFEST, RESIGN)
