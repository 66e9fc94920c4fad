"""Codec round trips for every message type, readable headers, and DecodeError on bad input."""

import ast
import dataclasses
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from astraflow import messages
from astraflow.columnar import ColumnList, column, joined
from astraflow.dataflow.checks import check_values
from astraflow.dataflow.settings import CollectorSettings
from astraflow.dataflow.verdicts import Judge
from astraflow.errors import DecodeError
from astraflow.messages import (
    KINDS,
    SCHEMA_VERSION,
    Heartbeat,
    PromptGroup,
    RolloutGroup,
    SampleGroup,
    TensorSpec,
    Trajectory,
    VersionNotice,
    VersionPublished,
    WeightManifest,
    batch_refs,
    decode,
    decode_batch,
    encode,
)
from astraflow.packing import _pack_array, _unpack_array, pack, unpack
from astraflow.streams import schema
from astraflow.streams.schema import BatchEntry, Entry, Plain
from tests.dataflow_helpers import trajectory

text = st.text(max_size=12)
ints = st.integers(-(2**40), 2**40)
floats = st.floats(allow_nan=False, width=64)
names = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=8)
json_like = st.recursive(
    st.none() | st.booleans() | ints | floats | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def trajectories(draw):
    n = draw(st.integers(0, 16))
    arr = lambda dtype, elements: draw(hnp.arrays(dtype, n, elements=elements))  # noqa: E731
    return Trajectory(
        model=draw(names),
        token_ids=arr(np.int32, st.integers(0, 2**31 - 1)),
        logprobs=arr(np.float32, st.floats(-30, 0, width=32)),
        loss_mask=arr(np.uint8, st.integers(0, 1)),
        versions=arr(np.int32, st.integers(-1, 1000)),
        reward=draw(floats),
        finish_reason=draw(text),
        error=draw(st.none() | text),
    )


MESSAGES = st.one_of(
    st.builds(
        PromptGroup,
        uid=text,
        workflow=names,
        models=st.lists(names, max_size=3),
        n_samples=ints,
        version=ints,
        sample=st.dictionaries(names, json_like, max_size=4),
        submitted_at=floats,
    ),
    st.builds(
        RolloutGroup,
        uid=text,
        raas=names,
        version=ints,
        trajectories=st.lists(trajectories(), max_size=3),
        timings=st.dictionaries(names, floats, max_size=3),
        error=st.none() | text,
        models=st.lists(names, max_size=2),
    ),
    st.builds(
        VersionPublished,
        uid=text,
        model=names,
        version=ints,
        manifest_key=text,
        step=ints,
        incarnation=text,
        eval=st.booleans(),
    ),
    st.builds(
        VersionNotice,
        uid=text,
        version=ints,
        models=st.dictionaries(names, ints, max_size=3),
        manifests=st.dictionaries(names, text, max_size=3),
        eval=st.booleans(),
    ),
    st.builds(
        WeightManifest,
        uid=text,
        model=names,
        version=ints,
        kind=st.sampled_from(["full", "delta"]),
        base_version=st.none() | ints,
        endpoints=st.lists(text, max_size=2),
        nbytes=ints,
        digest=text,
        chunk_digests=st.lists(text, max_size=3),
        tensors=st.lists(
            st.builds(
                TensorSpec, name=text, dtype=names, shape=st.lists(ints, max_size=3), offset=ints, nbytes=ints
            ),
            max_size=3,
        ),
        incarnation=text,
    ),
    st.builds(
        Heartbeat,
        uid=names,
        region=names,
        capacity=ints,
        in_flight=ints,
        versions=st.dictionaries(names, ints, max_size=2),
        endpoint=st.none() | text,
        started_at=floats,
        updated_at=floats,
    ),
)


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, list | ColumnList):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def test_every_message_kind_is_covered():
    assert set(KINDS) == {
        "prompt_group",
        "rollout_group",
        "version_published",
        "version_notice",
        "weight_manifest",
        "heartbeat",
    }


@settings(max_examples=300, deadline=None)
@given(MESSAGES)
def test_round_trip(msg):
    fields = encode(msg)
    assert same(decode(fields), msg)
    assert fields["kind"] == msg.KIND.encode()
    assert decode(fields, type(msg), max_bytes=len(fields["data"]))


def test_batch_with_a_bad_group_names_it():
    fields = {
        "kind": b"batch",
        "schema": str(SCHEMA_VERSION).encode(),
        "uid": b"b",
        "model": b"m",
        "version": b"1",
        "groups": b"g1",
    }
    fields |= {"replayed": b"", "refs": b"r1"}
    with pytest.raises(DecodeError, match="group g1: missing"):
        decode_batch(fields, [None])  # the reference points at nothing
    with pytest.raises(DecodeError, match="group g1: not valid msgpack"):
        decode_batch(fields, [b"\xc1"])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_decode_error(data):
    for kind in KINDS:
        with pytest.raises(DecodeError):
            result = decode({"kind": kind, "schema": str(SCHEMA_VERSION), "data": data})
            # Random bytes that happen to be valid msgpack must still not validate as this kind.
            raise AssertionError(f"decoded {result!r}")


def test_a_bad_value_deep_in_a_message_is_named_by_its_whole_path():
    def traj(reward):
        z = np.zeros(2, np.int32)
        return Trajectory(
            model="m", token_ids=z, logprobs=z.astype(np.float32), loss_mask=z, versions=z, reward=reward
        )

    fields = encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=[traj(0.5), traj(1.0)]))
    plain = msgpack.unpackb(fields["data"], raw=False, ext_hook=_unpack_array)
    columns = plain["trajectories"]  # one list (or array) per field for the whole group

    def decoded(drop: str = "", **changes):
        changed = {k: v for k, v in {**columns, **changes}.items() if k != drop}
        return decode(
            {**fields, "data": msgpack.packb({**plain, "trajectories": changed}, default=_pack_array)}
        )

    with pytest.raises(
        DecodeError, match=r"^rollout_group\.trajectories\.reward\[1\]: expected a number, got str$"
    ):
        decoded(reward=[0.5, "high"])
    with pytest.raises(
        DecodeError, match=r"^rollout_group\.trajectories\.metrics\[0\]\.tool: expected a number"
    ):
        decoded(metrics=[{"tool": "x"}, {}])
    with pytest.raises(DecodeError, match=r"^rollout_group\.trajectories\.reward: 3 values for 2 elements$"):
        decoded(reward=[0.5, 1.0, 2.0])
    with pytest.raises(DecodeError, match=r"^rollout_group\.trajectories\.lengths: expected a 1-D array"):
        decoded(lengths=np.array([5, -1]))  # (sums to the tokens there are)
    wrapping = np.array([2**64 - 1, 5], np.uint64)  # sums to 4 in uint64: the whole column, then nothing
    with pytest.raises(DecodeError, match=r"^rollout_group\.trajectories\.token_ids: shape \(4,\) does not"):
        decoded(lengths=wrapping)
    with pytest.raises(DecodeError, match=r"^rollout_group\.trajectories\.logprobs: shape \(3,\) does not"):
        decoded(logprobs=np.zeros(3, np.float32))
    with pytest.raises(DecodeError, match=r"^rollout_group\.trajectories\.model: missing$"):
        decoded(drop="model")


def test_a_group_travels_as_columns_and_comes_back_as_trajectories_of_their_own():
    lengths = [3, 0, 5]
    trajs = [
        Trajectory(
            model=f"m{n}",
            token_ids=np.arange(n, dtype=np.int32) + 10 * n,
            logprobs=-np.ones(n, np.float32),
            loss_mask=np.ones(n, np.uint8),
            versions=np.full(n, n, np.int32),
            reward=float(n),
            error=None if n else "timeout",
            metrics={"turns": float(n)} if n else {},
        )
        for n in lengths
    ]
    fields = encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=trajs))
    plain = msgpack.unpackb(fields["data"], raw=False, ext_hook=_unpack_array)
    assert plain["trajectories"]["lengths"].tolist() == lengths
    assert plain["trajectories"]["token_ids"].tolist() == [10 * n + i for n in lengths for i in range(n)]
    back = decode(fields, RolloutGroup).trajectories
    assert [len(t.token_ids) for t in back] == lengths
    assert all(same(a, b) for a, b in zip(back, trajs, strict=True))
    assert back[2].versions.tolist() == [5] * 5 and back[1].error == "timeout"
    empty = decode(encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=[], error="boom")))
    assert empty.trajectories == [] and empty.error == "boom"


def test_a_decoded_group_keeps_its_columns_for_looks_at_every_trajectory():
    """What checks every trajectory's values reads the decoded columns whole: the arrays the
    trajectories are views of, not copies of them; a subset, or trajectories never sent, give the same."""
    trajs = [trajectory("a", float(n), n, tokens=n) for n in (3, 0, 5)]
    back = decode(encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=trajs))).trajectories
    whole = joined(back, "token_ids")
    assert whole.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert all(np.shares_memory(t.token_ids, whole) for t in back if len(t.token_ids))
    assert column(back, "reward") == column(trajs, "reward") == [3.0, 0.0, 5.0]
    assert joined(back, "versions", [0, 2]).tolist() == joined(trajs, "versions", [0, 2]).tolist()
    assert joined(back, "versions", [1]).tolist() == [] and joined(trajs, "versions", []).tolist() == []
    assert joined(back, "token_ids", [0, 0, 2]).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match="array field"):
        column(back, "token_ids")


def test_a_decoded_group_builds_its_trajectories_only_when_one_is_looked_at():
    """The collector judges a group by its columns alone: decoding it, checking its values and deciding it
    build no trajectory (a dozen objects per entry, on the dataflow's hot path); a look at one builds
    them all, equal to what was sent."""
    trajs = [trajectory("a", float(n), n, tokens=n + 1) for n in (3, 0, 5)]
    entry = encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=trajs, models=["a"]))
    group = decode(entry)
    owned = check_values(group, {"a": 0}, {"a": 100}, (0.0, 5.0))
    Judge(CollectorSettings(), ["a"])("1-0", group, entry["data"], owned)
    back = group.trajectories
    assert "_items" not in vars(back) and len(back) == 3
    assert same(back[2], trajs[2]) and "_items" in vars(back)
    assert same(list(back), trajs) and back == list(back) and back != trajs[:2]


def test_a_column_the_sender_left_out_gives_each_element_its_own_default():
    trajs = [trajectory("a", 1.0, 0), trajectory("a", 0.0, 0)]
    plain = msgpack.unpackb(
        encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=trajs))["data"],
        raw=False,
        ext_hook=_unpack_array,
    )
    del plain["trajectories"]["metrics"], plain["trajectories"]["finish_reason"]
    back = unpack(RolloutGroup, msgpack.packb(plain, default=_pack_array, use_bin_type=True)).trajectories
    assert [t.metrics for t in back] == [{}, {}] and back[0].metrics is not back[1].metrics
    assert [t.finish_reason for t in back] == ["", ""]


def test_arrays_travel_as_raw_bytes_not_lists():
    n = 1000
    traj = Trajectory(
        model="m",
        token_ids=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, np.float32),
        loss_mask=np.ones(n, np.uint8),
        versions=np.zeros(n, np.int32),
        reward=0.5,
    )
    fields = encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=[traj]))
    assert len(fields["data"]) < 1000 * 13 + 400  # 4+4+1+4 bytes per token plus the fields and headers
    assert fields["uid"] == b"u" and fields["version"] == b"0"


def test_bad_field_is_named():
    msg = PromptGroup(uid="u", workflow="rlvr", models=["m"], n_samples=4, version=0)
    fields = encode(msg)
    plain = msgpack.unpackb(fields["data"])
    plain["n_samples"] = "four"
    with pytest.raises(DecodeError, match=r"prompt_group\.n_samples: expected an integer"):
        decode({**fields, "data": msgpack.packb(plain)})
    del plain["n_samples"]
    with pytest.raises(DecodeError, match=r"prompt_group\.n_samples: missing"):
        decode({**fields, "data": msgpack.packb(plain)})


def test_inconsistent_arrays_are_rejected():
    traj = Trajectory(
        model="m",
        token_ids=np.arange(4, dtype=np.int32),
        logprobs=np.zeros(3, np.float32),
        loss_mask=np.ones(4, np.uint8),
        versions=np.zeros(4, np.int32),
        reward=0.0,
    )
    with pytest.raises(DecodeError, match=r"trajectories\.logprobs: shape \(3,\) does not match"):
        decode(encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=[traj])))
    floats = dataclasses.replace(traj, logprobs=np.zeros(4, np.float32), token_ids=np.zeros(4, np.float32))
    with pytest.raises(DecodeError, match=r"trajectory\.token_ids: integer dtype expected"):
        decode(encode(RolloutGroup(uid="u", raas="w", version=0, trajectories=[floats, floats])))


def test_headers_are_checked():
    msg = VersionPublished(uid="m:1", model="m", version=1, manifest_key="k", step=1, incarnation="i")
    fields = encode(msg)
    with pytest.raises(DecodeError, match="kind: unknown"):
        decode({**fields, "kind": b"nope"})
    with pytest.raises(DecodeError, match="schema: unsupported"):
        decode({**fields, "schema": b"99"})
    with pytest.raises(DecodeError, match="kind: expected 'heartbeat'"):
        decode(fields, Heartbeat)
    with pytest.raises(DecodeError, match="kind: expected 'batch'"):
        decode_batch(fields, [])
    with pytest.raises(DecodeError, match="exceeds the limit"):
        decode(fields, max_bytes=3)


def test_arrays_round_trip_in_the_raw_format_and_the_older_msgpack_one_still_reads():
    for arr in (np.arange(5, dtype=np.int32), np.zeros((2, 3), np.float32), np.zeros(0, np.uint8)):
        ext = _pack_array(arr)
        back = _unpack_array(ext.code, ext.data)
        assert ext.code == 2 and back.dtype == arr.dtype and np.array_equal(back, arr)
    older = msgpack.packb(["<i4", [3], np.arange(3, dtype="<i4").tobytes()], use_bin_type=True)
    assert _unpack_array(1, older).tolist() == [0, 1, 2]  # what a worker of the previous release writes
    with pytest.raises(DecodeError, match="bad array"):
        _unpack_array(2, _pack_array(np.arange(4, dtype=np.int32)).data[:-1])  # one byte short
    with pytest.raises(DecodeError, match="bad array"):
        _unpack_array(1, msgpack.packb(["|O", [1], b"x" * 8], use_bin_type=True))  # object arrays: never


def field_spellings(text: str) -> list[str]:
    """Entry field names (`schema.Entry`, `BatchEntry`, `Plain`) spelled as strings in `text`: as a dict
    key, a subscript, a call's argument or an assigned value."""
    names = {v for ns in (Entry, BatchEntry, Plain) for v in schema.names(ns).values() if isinstance(v, str)}
    spots = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Dict):
            spots += node.keys
        elif isinstance(node, ast.Subscript):
            spots.append(node.slice)
        elif isinstance(node, ast.Call):
            spots += node.args
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            spots.append(node.value)
    return sorted(
        f"{n.lineno}: {n.value!r}" for n in spots if isinstance(n, ast.Constant) and n.value in names
    )


def test_the_codec_takes_every_entry_field_name_from_the_schema():
    # One home for the names: form.lua writes batch entries with `BatchEntry`'s, the codec reads them so.
    text = Path(messages.__file__).read_text()
    assert field_spellings(text) == []
    assert field_spellings('x = {"kind": 1}\ny = f["refs"]\nz = _text(fields, "groups")\nK = "batch"\n') == [
        "1: 'kind'",
        "2: 'refs'",
        "3: 'groups'",
        "4: 'batch'",
    ]


def test_a_batch_entry_written_with_the_schemas_names_decodes():
    group = SampleGroup("g1", "policy", 0, 0, b"", [], np.zeros(0, np.float32))
    fields = {
        Entry.kind: BatchEntry.kind,
        Entry.schema: BatchEntry.schema,
        Entry.uid: "b1",
        Entry.model: "policy",
        Entry.version: "3",
        BatchEntry.groups: "g1",
        BatchEntry.replayed: "g1",
        BatchEntry.refs: "ref1",
    }
    assert batch_refs(fields) == ["ref1"]
    batch = decode_batch(fields, [pack(group)])
    assert (batch.uid, batch.version, batch.group_uids, batch.replayed_uids) == ("b1", 3, ["g1"], ["g1"])
    with pytest.raises(DecodeError, match="schema: unsupported"):
        decode_batch({**fields, Entry.schema: str(SCHEMA_VERSION + 1)}, [pack(group)])
