"""The run's data model: every key (`Keys`), the fields of the run-state hash, the ledger's counters, the
fields of stream entries and of the small hashes the scripts write - one home for every name.

Python reads the names from here; every Lua script gets them from `lua_prelude()`, generated from this
module and prepended when the script is registered (`connection.register_scripts`), so no Lua script
spells a name itself. `tests/unit/test_schema_fitness.py` fails when one does, or when a Python module
spells a state field or counter that is declared here.

A name is a constant (`State.notice`) or a `Family` of names built from its arguments
(`State.version("policy")` -> `v:policy`).
"""

from __future__ import annotations

import re

from astraflow.streams.keys import (  # re-exported: the keys are part of the data model
    GROUP_DATAFLOW,
    GROUP_RAAS,
    GROUP_TRAINER,
    Keys,
    run_prefix,
)

__all__ = ["GROUP_DATAFLOW", "GROUP_RAAS", "GROUP_TRAINER", "Keys", "run_prefix"]


class Family:
    """Names built from a template with one `{}` per argument, e.g. `manifest:{}:{}`."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.arity = template.count("{}")
        self._prefix = template.split("{}")[0]
        self._pattern = re.compile("(.+?)".join(re.escape(p) for p in template.split("{}")))

    def __call__(self, *args: object) -> str:
        return self.template.format(*args)

    def parse(self, name: str) -> tuple[str, ...] | None:
        """The arguments `name` was built from, or None when it is not of this family."""
        m = self._pattern.fullmatch(name) if name.startswith(self._prefix) else None  # (a cheap first look)
        return m.groups() if m else None

    def lua(self) -> str:
        """A Lua function building the same names."""
        args = [f"a{i}" for i in range(self.arity)]
        parts = self.template.split("{}")
        terms = [f"'{parts[0]}'"] if parts[0] else []
        for arg, tail in zip(args, parts[1:], strict=True):
            terms += [arg] + ([f"'{tail}'"] if tail else [])
        return f"function({', '.join(args)}) return {' .. '.join(terms)} end"


class State:
    """Fields of the run-state hash `state` (the dataflow's shared state; trainers and RaaS read it only
    through `streams.runstate`)."""

    cursor = "cursor"
    """The feeder's dataset position (compare-and-set by submit.lua)."""
    seq = "seq"
    """Order of arrival in the ready sets and of batches (FIFO scores, replay age)."""
    notice = "notice"
    """The last version announced to the RaaS pool."""
    rollback = "rollback"
    """Set when a restarted trainer moved a version back: the next notice goes out although not new."""
    version = Family("v:{}")
    """Trainer version recorded for a model (version.lua)."""
    incarnation = Family("inc:{}")
    """Trainer incarnation that published a model's recorded version."""
    manifest = Family("manifest:{}:{}")
    """Manifest key of (model, version)."""
    checkpoint = Family("checkpoint:{}:{}")
    """Checkpoint directory of (model, version) on a shared file system ('' = none)."""
    eval = Family("eval:{}")
    """Present when version v is an eval version."""
    eval_pending = Family("eval_pending:{}")
    """Eval groups of version v not collected yet."""
    eval_submitted = Family("eval_submitted:{}")
    """Unix time the eval groups of version v were submitted."""
    batches = Family("batches:{}")
    """Batches formed for a model (the last part of a batch uid)."""
    batch_version = Family("batch_version:{}")
    """Trainer version of the newest batch formed for a model."""


class Counters:
    """Fields of the `ledger` hash: counters that must balance (see `dataflow.ledger`)."""

    submitted = "submitted"
    skipped = "skipped"
    collected = "collected"
    dead = "dead"
    unknown = "unknown"
    eval = "eval"
    eval_submitted = "eval_submitted"
    eval_dropped = Family("eval_dropped:{}")
    model_collected = Family("{}:collected")
    model_ready = Family("{}:ready")
    model_trained = Family("{}:trained")
    model_replayed = Family("{}:replayed")
    model_dead = Family("{}:dead")
    dropped = Family("{}:dropped:{}")
    """Groups of a model dropped for a reason (`stale_ingest`, `stale_wait`, a filter's)."""


SCHEMA_VERSION = 2
"""The encoding of the entries, in their `schema` field: `messages` writes it and refuses an entry of
another, form.lua writes it into batch entries (`BatchEntry.schema`). 2: a rollout group's trajectories
travel as columns (`columnar.Columns`); 1: as a list of maps."""


class Entry:
    """Header fields of a stream entry (beside the msgpack `data` of a message; see `messages`). `uid`,
    `model` and `version` are also the attributes of a message they are copied from."""

    kind = "kind"
    schema = "schema"
    uid = "uid"
    model = "model"
    version = "version"
    data = "data"


class BatchEntry:
    """Fields of a `batches:<model>` entry (written by form.lua, read by `dataflow.batches`)."""

    kind = "batch"
    """Its `kind`."""
    schema = str(SCHEMA_VERSION)
    """Its `schema` (`messages.decode_batch` refuses another)."""
    seq = "seq"
    groups = "groups"
    """Uids of its groups, space-separated."""
    replayed = "replayed"
    """Uids of the groups mixed in from the replay set, space-separated."""
    refs = "refs"
    """Where each group's SampleGroup is kept (fields of `samples:<model>`), in group order."""


class Plain:
    """Fields a message's entry carries beside `data` for a person reading it with redis-cli
    (`messages.Message.readable`): never decoded, nor read by a script, so not among `NAMESPACES`."""

    policy = "policy"
    workflow = "workflow"
    samples = "n"
    """Samples of a prompt group, or trajectories of a rollout group."""
    eval_version = "eval_version"
    raas = "raas"
    status = "status"
    """`ok` or `failed`."""
    reward = "reward"
    """Mean reward of a rollout group."""
    tokens = "tokens"
    token_versions = "token_versions"
    """`<lowest>..<highest>` weight version among a rollout group's tokens."""
    error = "error"
    load = "load"
    """`model=version ...` of a version notice."""
    eval = "eval"
    step = "step"
    incarnation = "incarnation"
    sync = "sync"
    """A weight manifest's kind: `full` or `delta`."""
    base_version = "base_version"
    nbytes = "nbytes"
    region = "region"
    capacity = "capacity"
    in_flight = "in_flight"
    versions = "versions"
    engine = "engine"
    groups = "groups"


class DeadLetter:
    """Fields of a `dead` entry: where it came from, why, and a copy of the original's fields."""

    kind = "dead"
    """Its `kind`."""
    source = "source"
    source_id = "source_id"
    group = "group"
    consumer = "consumer"
    deliveries = "deliveries"
    reason = "reason"
    settled = "settled"
    """The prompt group the dead letter settled: the uid the entry's `data` names (absent: none)."""
    copied = Family("field.{}")
    """A field of the original entry (larger ones replaced by their size and digest)."""
    fields_truncated = "fields_truncated"


class MetricEntry:
    """Fields of a `metrics` entry (see `astraflow.records`), by kind."""

    time = "time"
    batch = "batch"
    data = "data"
    groups = "groups"
    samples = "samples"
    reward_sum = "reward_sum"
    metrics = "metrics"
    dataset = "dataset"
    rows = "rows"
    sums = "sums"
    kind_eval_submitted = "eval_submitted"


class Errors:
    """Fields of the `errors` hash: why the last attempt at an entry failed, kept until it is settled."""

    entry = Family("{}|{}")
    """(stream, entry id): the last processing error of an entry released for retry."""
    attempts = Family("{}|{}|attempts")
    """(batches stream, entry id): steps a trainer began on a batch (`dataflow.batches`)."""
    error = Family("{}|{}|error")
    """(batches stream, entry id): why the last step on a batch failed."""


class Identity:
    """Fields of the run's identity hash `run` (its stop notice: `StopNotice`, on `run:stop`)."""

    nonce = "nonce"
    created = "created"


class Greso:
    """Fields of the GRESO curator hash `curator:greso`."""

    collected = "collected"
    zero_var = Family("zero_var_{}")
    """Zero-variance groups of a kind (`easy`, `hard`) since the last announcement."""
    p = Family("p_{}")
    """Probability of submitting a prompt of a kind."""


class Trace:
    """Fields of a prompt group's lineage hash `trace:<uid>` (`astraflow trace`)."""

    row = "row"
    submitted_version = "submitted_version"
    submitted_at = "submitted_at"
    collected_at = "collected_at"
    raas = "raas"
    token_versions = "token_versions"
    error = "error"
    eval = "eval"
    dead = "dead"
    outcome = Family("{}")
    """A model's outcome: `ready`, `trained` or `dropped: <reason>`."""
    ready_seq = Family("{}:ready_seq")
    min_version = Family("{}:min_version")
    expired_seq = Family("{}:expired_seq")
    batch = Family("{}:batch")
    batch_version = Family("{}:batch_version")
    batch_seq = Family("{}:batch_seq")
    batched_at = Family("{}:batched_at")


EVAL_UID = Family("eval:{}:{}:{}")
"""Uid of an eval prompt group: (version, dataset, row); collect.lua tells eval groups by this prefix."""

NAMESPACES = (State, Counters, Entry, BatchEntry, DeadLetter, MetricEntry, Errors, Identity, Greso, Trace)


def names(namespace: type) -> dict[str, str | Family]:
    """The declared names of `namespace`, by attribute."""
    return {k: v for k, v in vars(namespace).items() if not k.startswith("_") and isinstance(v, str | Family)}


def lua_prelude(script: str | None = None) -> str:
    """Lua tables of the names `script` uses (every name when None): `State.version(model)`,
    `Counters.dead`. Only those: a script builds its tables on every call, and the bus's scripts are on the
    hot path. A name the schema does not declare fails here, at registration."""
    code = None if script is None else "\n".join(line.split("--", 1)[0] for line in script.splitlines())
    used = None if code is None else set(re.findall(r"\b([A-Z][A-Za-z]+)\.([a-z_]+)", code))
    lines = ["-- Generated from astraflow/streams/schema.py at registration: the names this script uses."]
    for ns in (*NAMESPACES, *VALUE_NAMESPACES):
        declared = names(ns)
        wanted = declared if used is None else {a for n, a in used if n == ns.__name__}
        if not wanted:
            continue
        missing = [a for a in wanted if a not in declared]
        if missing:
            raise KeyError(f"{ns.__name__}.{missing[0]} is not declared in astraflow/streams/schema.py")
        items = [
            f"{k} = {v.lua() if isinstance(v, Family) else repr(v)}"
            for k, v in declared.items()
            if k in wanted
        ]
        lines.append(f"local {ns.__name__} = {{{', '.join(items)}}}")
    return "\n".join(lines) + "\n"


class Parse(Family):
    """A family read back in Lua: its `lua()` is a function returning the arguments a name was built from
    (nil when it is not of the family; the last one never empty)."""

    def lua(self) -> str:
        parts = ["".join("%" + c if c in "^$()%.[]*+-?" else c for c in p) for p in self.template.split("{}")]
        groups = ["(.-)"] * (self.arity - 1) + ["(.+)"]
        pattern = parts[0] + "".join(g + p for g, p in zip(groups, parts[1:], strict=True))
        return f"function(s) return string.match(s, '^{pattern}$') end"


class StopNotice:
    """Fields of the run's stop notice `run:stop` (`streams.identity.mark_stopped`)."""

    stopped = "stopped"
    """Unix seconds the run was ended."""
    stop_reason = "stop_reason"
    stopped_by = "stopped_by"
    """`launcher`, or the role of the worker that judged the stop condition."""


NAMESPACES += (StopNotice,)  # (declared after the first ones, a hash's fields like theirs)


class GresoKind:
    """Kinds of zero-variance groups GRESO counts (`Greso.zero_var`, `Greso.p`, its streaks)."""

    easy = "easy"
    """Every sample solved it (mean reward >= 0.5)."""
    hard = "hard"
    """Every sample failed it."""


class Outcome:
    """A model's outcome in a trace (`Trace.outcome`), also collect.lua's per-part reply."""

    ready = "ready"
    trained = "trained"
    dropped = Family("dropped: {}")
    """Dropped for a reason (`DropReason`, or a filter's)."""
    dropped_reason = Parse(dropped.template)
    """The reason of a `dropped` outcome."""
    scored = "scored"
    """An eval group's (`Trace.eval`): scored, not dropped."""


class DropReason:
    """Why the dataflow drops a group's part (beside the filters' own reasons)."""

    stale_ingest = "stale_ingest"
    """Already too stale when collected (collect.lua)."""
    stale_wait = "stale_wait"
    """Went stale waiting in the ready set (form.lua)."""


class Uid:
    """Uid formats."""

    eval = EVAL_UID
    eval_parts = Parse(EVAL_UID.template)
    """(version, dataset, row) of an eval group's uid; collect.lua tells eval groups by it."""
    batch = Family("{}:{}:{}")
    """Uid of a batch: (model, the run's nonce, the model's batch number), written by form.lua."""


VALUE_NAMESPACES = (GresoKind, Outcome, DropReason, Uid)
"""Values (not field names) that Lua and Python share, exported into the Lua prelude like the names."""
