"""The ledger: counters that must always balance, and the reading of them.

Identity (docs/ARCHITECTURE.md, "The ledger"), read in one transaction so concurrent writers cannot skew it:
    submitted == in_flight + dead + collected                        (prompt groups)
    collected[m] == ready[m] + trained[m] + sum(dropped[m][reason]) + dead[m]  (each model's part)
`dead[m]` counts the groups of batches the trainer set aside (dead-lettered, never trained); they were
counted `trained` when the batch was formed and move to `dead[m]` then. With one model these are
`submitted == in_flight + ready + trained + dropped + dead + eval` (`dead` both the prompt groups
dead-lettered before collection and those of set-aside batches; eval groups are collected with no model
parts: `eval` counts them). `ready[m]` must also
equal the size of the ready set, and `replayed` counts replay on purpose, outside the identity.

Balanced also requires that no group counted in flight is stranded: in flight with no prompt or rollout
entry behind it (`streams.strays`). A group in flight always has such an entry - every step that moves a
group changes its entries and the in-flight set atomically - so one without can never settle and would
hide lost work inside `in_flight` for good (as guessed dedup markers once made it). The dataflow
dead-letters a group stranded longer than its lease + `STRAY_GRACE_MS`; until then the ledger names it.
The check is a lower bound read in one transaction: in-flight groups beyond the unacknowledged prompt and
rollout entries (unchecked where Redis does not report a group's lag, e.g. Redis 6.2).

After a failover the counters are those the promoted replica had: a consistent, earlier state of the run
(replication keeps the order of writes, and every script's writes together). What the old primary
acknowledged after that point is gone from Redis - with `redis.min_replicas_ack` 0 a hand-off may be among
it, and its work is redone - so the ledger says that a failover happened, where, and attributes any
imbalance to it rather than presenting it as a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.exceptions import ResponseError

from astraflow.streams import Bus
from astraflow.streams.schema import Counters
from astraflow.streams.strays import stranded_at_least


@dataclass
class ModelLedger:
    collected: int = 0
    ready: int = 0
    trained: int = 0
    replayed: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    ready_set: int = 0
    """Groups actually in the ready set (cross-check of `ready`)."""
    dead: int = 0
    """Groups of batches the trainer set aside (dead letters): collected, never trained."""

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


@dataclass
class Ledger:
    submitted: int
    in_flight: int
    dead: int
    collected: int
    skipped: int
    unknown: int
    models: dict[str, ModelLedger]
    eval: int = 0
    """Eval groups among `collected` (they have no model parts: never trained on)."""
    eval_dropped: dict[str, int] = field(default_factory=dict)
    """Eval groups collected but not scored, by reason (`wrong_version`, `failed`)."""
    failover_offset: int | None = None
    """Replication offset at which this Redis was promoted from a replica (None: no failover known)."""
    stranded: int | None = 0
    """Groups in flight with no prompt or rollout entry behind them, at least (None: unchecked)."""

    def problems(self) -> list[str]:
        """Every way the identity fails; empty when the ledger balances."""
        out = []
        rhs = self.in_flight + self.dead + self.collected
        if self.submitted != rhs:
            out.append(f"submitted {self.submitted} != in_flight + dead + collected = {rhs}")
        for name, m in self.models.items():
            parts = m.ready + m.trained + m.dropped_total + m.dead
            if m.collected != parts:
                out.append(f"{name}: collected {m.collected} != ready + trained + dropped + dead = {parts}")
            if m.ready != m.ready_set:
                out.append(f"{name}: ready counter {m.ready} != {m.ready_set} groups in the ready set")
        if self.stranded:
            out.append(
                f"{self.stranded} groups in flight have no prompt or rollout entry behind them (stranded;"
                " the dataflow dead-letters them after their lease + grace)"
            )
        return out

    def as_dict(self) -> dict:
        return {
            "submitted": self.submitted,
            "in_flight": self.in_flight,
            "dead": self.dead,
            "collected": self.collected,
            "skipped": self.skipped,
            "unknown": self.unknown,
            "eval": self.eval,
            "eval_dropped": self.eval_dropped,
            "models": {n: {**vars(m), "dropped_total": m.dropped_total} for n, m in self.models.items()},
            "balanced": not self.problems(),
            "problems": self.problems(),
            "failover_offset": self.failover_offset,
            "stranded": self.stranded,
        }

    def render(self) -> str:
        lines = [
            f"submitted   {self.submitted:>8}   (skipped by the curator: {self.skipped})",
            f"in flight   {self.in_flight:>8}",
            f"dead        {self.dead:>8}",
            f"collected   {self.collected:>8}" + (f"   (duplicates: {self.unknown})" if self.unknown else ""),
        ]
        if self.eval:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.eval_dropped.items()))
            lines.append(
                f"  eval: {self.eval} (scored, never trained)" + (f", dropped: {reasons}" if reasons else "")
            )
        for name, m in self.models.items():
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(m.dropped.items()))
            lines.append(
                f"  {name}: ready {m.ready}, trained {m.trained}, dropped {m.dropped_total}"
                + (f" ({reasons})" if reasons else "")
                + (f", dead in set-aside batches {m.dead}" if m.dead else "")
                + f"; replayed {m.replayed}"
            )
        if len(self.models) == 1:
            (m,) = self.models.values()
            lines.append(
                f"identity: submitted {self.submitted} = in_flight {self.in_flight} + ready {m.ready}"
                f" + trained {m.trained} + dropped {m.dropped_total} + dead {self.dead + m.dead}"
                + (f" + eval {self.eval}" if self.eval else "")
            )
        problems = self.problems()
        if self.failover_offset is not None:
            lines.append(
                "failover: this Redis was promoted from a replica at replication offset"
                f" {self.failover_offset};"
                " what the old primary acknowledged later is lost (and redone), unless redis.min_replicas_ack"
                " held hand-offs back until a replica had them"
            )
        cause = " (lost in the failover)" if self.failover_offset is not None else ""
        lines += [f"NOT BALANCED{cause}: {p}" for p in problems] if problems else ["balanced"]
        return "\n".join(lines)


async def read_ledger(bus: Bus, models: Sequence[str]) -> Ledger:
    k = bus.keys
    async with bus.redis.pipeline(transaction=True) as pipe:
        pipe.hgetall(k.ledger).scard(k.in_flight)
        for m in models:
            pipe.zcard(k.ready(m))
        raw, in_flight, *ready_sets = await pipe.execute()
    counts = {key.decode(): int(v) for key, v in raw.items()}
    per_model = {}
    for m, ready_set in zip(models, ready_sets, strict=True):
        parsed = ((Counters.dropped.parse(name), n) for name, n in counts.items())
        dropped = {args[1]: n for args, n in parsed if args and args[0] == m}
        per_model[m] = ModelLedger(
            collected=counts.get(Counters.model_collected(m), 0),
            ready=counts.get(Counters.model_ready(m), 0),
            trained=counts.get(Counters.model_trained(m), 0),
            replayed=counts.get(Counters.model_replayed(m), 0),
            dropped=dropped,
            ready_set=ready_set,
            dead=counts.get(Counters.model_dead(m), 0),
        )
    return Ledger(
        submitted=counts.get(Counters.submitted, 0),
        in_flight=in_flight,
        dead=counts.get(Counters.dead, 0),
        collected=counts.get(Counters.collected, 0),
        skipped=counts.get(Counters.skipped, 0),
        unknown=counts.get(Counters.unknown, 0),
        eval=counts.get(Counters.eval, 0),
        eval_dropped={args[0]: c for n, c in counts.items() if (args := Counters.eval_dropped.parse(n))},
        models=per_model,
        failover_offset=await failover_offset(bus),
        stranded=await stranded_at_least(bus),
    )


async def failover_offset(bus: Bus) -> int | None:
    """Where this Redis took over from a failed primary (`INFO replication`: a promoted replica keeps the
    old primary's replication id as `master_replid2`, until it restarts), else None."""
    try:
        info = await bus.call(lambda: bus.redis.info("replication"))
    except ResponseError:  # a Redis that does not answer INFO (fakeredis; a user without +info)
        return None
    if info.get("role") != "master" or set(str(info.get("master_replid2", "0"))) == {"0"}:
        return None
    return int(info["second_repl_offset"])
