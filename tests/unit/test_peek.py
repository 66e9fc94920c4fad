"""Readable streams: entries carry plain fields a person reads with redis-cli, and `astraflow peek`
decodes an entry of every stream of a run - written here by the real dataflow on fakeredis, with the
RaaS pool and the trainer simulated over the real streams."""

from __future__ import annotations

import functools
import json

from astraflow.messages import SCHEMA_VERSION, VersionNotice, decode
from astraflow.ops.peek import peek, to_json
from astraflow.streams import Out
from tests.dataflow_helpers import heartbeat, publish_version, roll_out, small_dataflow, train


async def a_short_run():
    bus, df = await small_dataflow("dataflow.feeder.min_backlog=6", "dataflow.batch.size=4")
    await df.feeder.step()
    entries = await bus.read(bus.keys.prompts, "raas", "r", 1, None)
    uid = entries[0].fields["uid"]
    garbage = {"kind": b"rollout_group", "schema": str(SCHEMA_VERSION).encode(), "uid": uid, "data": b"\xc1"}
    await bus.handoff(bus.keys.prompts, "raas", "r", [(entries[0], [Out(bus.keys.rollouts, garbage)])])
    await roll_out(bus, 100, lambda g, i: float(i % 2), version=0)
    while await df.collector.step(1):
        pass
    assert await df.former.step("policy") == "ok"
    await publish_version(bus, "policy", 0)
    await df.barrier.step(1)
    await heartbeat(bus, "raas-0", slots=4, in_flight=1, groups=3)
    return bus, df


async def test_peek_decodes_an_entry_of_every_stream_kind():
    bus, _ = await a_short_run()
    [prompt] = await peek(bus, "prompts")
    assert prompt["kind"] == "prompt_group" and prompt["message"]["models"] == ["policy"]
    [rollout] = await peek(bus, "rollouts")
    assert rollout["message"]["trajectories"][0]["token_ids"] == list(range(8))
    [batch] = await peek(bus, "batches:policy")
    assert batch["kind"] == "batch" and len(batch["message"]["groups"]) == 2
    assert batch["message"]["groups"][0]["trajectories"][0]["reward"] in (0.0, 1.0)
    [version] = await peek(bus, "versions")
    assert (version["message"]["model"], version["message"]["version"]) == ("policy", 0)
    [notice] = await peek(bus, "notices")
    assert notice["message"]["models"] == {"policy": 0}
    [metrics] = await peek(bus, "metrics")
    assert metrics["kind"] == "rollouts" and metrics["model"] == "policy"
    [dead] = await peek(bus, "dead")
    assert "not valid msgpack" in dead["reason"] and dead["entry"]["kind"] == "rollout_group"
    [beat] = await peek(bus, "raas:raas-0")
    assert beat["message"]["capacity"] == 4 and beat["message"]["groups"] == 3
    newest_two = await peek(bus, "rollouts", count=2)
    first = newest_two[0]["id"]
    assert [e["id"] for e in await peek(bus, "rollouts", entry_id=first)] == [first]


async def test_redis_cli_shows_uid_version_and_reward_of_a_rollout_in_plain_fields():
    bus, _ = await a_short_run()
    _, fields = (await bus.redis.xrange(bus.keys.rollouts))[-1]
    assert fields[b"uid"].startswith(b"e0r") and fields[b"version"] == b"0"
    assert fields[b"reward"] == b"0.5" and fields[b"raas"] == b"raas-sim" and fields[b"status"] == b"ok"
    assert fields[b"token_versions"] == b"0..0"
    beat = await bus.redis.hgetall(bus.keys.raas("raas-0"))
    assert (beat[b"capacity"], beat[b"in_flight"], beat[b"groups"]) == (b"4", b"1", b"3")
    [(_, notice)] = await bus.redis.xrange(bus.keys.notices)
    assert notice[b"load"] == b"policy=0"


async def test_plain_fields_are_never_trusted_when_decoding():
    bus, _ = await a_short_run()
    [(_, fields)] = await bus.redis.xrange(bus.keys.notices)
    lying = {**fields, b"load": b"policy=99", b"version": b"99"}
    assert decode(lying, VersionNotice).models == {"policy": 0}  # type: ignore[attr-defined]


async def test_batches_formed_by_the_dataflow_decode_for_the_trainer():
    bus, _ = await a_short_run()
    [(fields, batch)] = await train(bus, "policy")
    assert fields["groups"].decode().split() == [g.uid for g in batch.groups]
    assert batch.version == 0 and batch.replayed_uids == []


async def test_a_hostile_dead_letter_is_shown_bounded_not_decoded_whole():
    """What a worker may write to `dead`: dead letters nested 400 deep around a JSON value nested 3,000
    deep (the attack's 81 MB one, 3,000 deep, ran peek out of memory), and an entry over the size limit."""
    bus, _ = await a_short_run()
    nested = {b"kind": b"trainer", b"data": b"[" * 3000 + b"1" + b"]" * 3000}
    for level in range(400):  # (the outer letters name their source)
        source = {b"source": b"rollouts"} if level >= 390 else {}
        nested = {b"kind": b"dead", **source, **{b"field." + k: v for k, v in nested.items()}}
    await bus.redis.xadd(bus.keys.dead, nested)
    [deep] = await peek(bus, "dead")
    assert deep["entry"]["entry"]["entry"]["entry"]["entry"] == {
        "error": "a dead letter nested over 4 deep: cut"
    }
    await bus.redis.xadd(
        bus.keys.dead, {"kind": "dead", "source": "rollouts", "field.data": b"x" * (17 << 20)}
    )
    [large] = await peek(bus, "dead")
    assert large["error"].endswith(
        "bytes, over peek's limit of 16777216: not decoded (--max-bytes to raise it)"
    )
    assert large["fields"]["field.data"] == f"<{17 << 20} bytes>"
    wide = [[list(range(1000))] * 1000]  # a million values: shown to the limit, the cut named
    shown = json.dumps(to_json(wide))
    assert len(shown) < 1 << 20 and "<cut: over 20000 values>" in shown and "<cut: 744 more>" in shown
    assert "<cut: nested over 32 deep>" in json.dumps(
        to_json(functools.reduce(lambda v, _: [v], range(99), 1))
    )
