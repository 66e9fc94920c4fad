"""Typed wire messages and their field maps.

A message travels as a flat field map: small human-readable headers (`kind`, `schema`, and `uid`,
`model`, `version` where the message has them) plus one `data` field holding the message's msgpack bytes
(`packing`: arrays as raw bytes, a rollout group's trajectories as columns, no pickle), so
`redis-cli XRANGE` shows a person what flows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from astraflow.columnar import Columns
from astraflow.errors import DecodeError
from astraflow.packing import pack, unpack
from astraflow.streams.schema import SCHEMA_VERSION, BatchEntry, Entry, Plain

__all__ = ["SCHEMA_VERSION"]  # re-exported: the version this codec writes and reads


@dataclass(frozen=True, eq=False)
class Message:
    KIND: ClassVar[str] = ""

    def readable(self) -> dict[str, str]:
        """Plain fields beside `data` for a person reading the entry with redis-cli (never decoded: the
        message is `data` alone). A few short ones: entries are on the hot path."""
        return {}

    def _check(self) -> None:
        """Raise DecodeError naming a field whose value is inconsistent; called after decoding."""


@dataclass(frozen=True, eq=False)
class PromptGroup(Message):
    # dataflow feeder -> RaaS, stream `prompts`
    KIND: ClassVar[str] = "prompt_group"
    uid: str
    workflow: str
    models: list[str]
    n_samples: int
    version: int
    """Trainer version current when the group was submitted."""
    sample: dict[str, Any] = field(default_factory=dict)
    """The dataset row: prompt, answer and whatever else the workflow and reward read."""
    submitted_at: float = 0.0
    eval_version: int = -1
    """An eval group (>= 0): run on exactly this weight version, scored, never trained on."""
    eval_dataset: str = ""
    """The eval dataset the row comes from (eval groups only)."""
    sampling: dict[str, float] = field(default_factory=dict)
    """Overrides of the RaaS's sampling for this group (eval: `temperature` 0, `max_new_tokens`)."""

    def readable(self) -> dict[str, str]:
        out = {Plain.policy: " ".join(self.models), Plain.workflow: self.workflow}
        out[Plain.samples] = str(self.n_samples)
        return out | ({Plain.eval_version: str(self.eval_version)} if self.eval_version >= 0 else {})


@dataclass(frozen=True, eq=False)
class Trajectory(Message):
    # part of a RolloutGroup or a Batch
    KIND: ClassVar[str] = "trajectory"
    model: str
    token_ids: np.ndarray
    """int32 [T]: prompt then completion tokens (tool outputs included)."""
    logprobs: np.ndarray
    """float32 [T]: sampling logprob of each token (0 where the engine did not sample it)."""
    loss_mask: np.ndarray
    """uint8 [T]: 1 where the token is trained on (sampled by `model`), 0 for prompt and tool output."""
    versions: np.ndarray
    """int32 [T]: weight version that produced each token, -1 where no policy produced it."""
    reward: float
    finish_reason: str = ""
    error: str | None = None
    """Why this trajectory failed (reward raised or timed out, ...); None when it did not."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the workflow measured in the episode (`tool_call`: 1.0 or 0.0, ...); the dataflow reports the
    mean of each per model and step, as it does the reward."""
    temperature: float = 1.0
    """The sampling `logprobs` are of (`astraflow.logits`): the temperature (0 = greedy, scored at 1), ..."""
    top_k: int = 0
    """... the top-k cut (0 = none) ..."""
    top_p: float = 1.0
    """... and the top-p cut (1 = none). The trainer scores the tokens through the same processing, so its
    logprobs and these agree at the same weights. Entries written before these fields decode as plain
    sampling (temperature 1, no cut)."""


def _check_dtypes(arrays: Mapping[str, np.ndarray]) -> None:
    """Raise DecodeError unless a trajectory's token ids, versions and loss mask are of an integer dtype
    and its logprobs of a float one."""
    for name in ("token_ids", "versions", "loss_mask"):
        dtype = arrays[name].dtype
        if dtype.kind not in "iub":
            raise DecodeError(f"trajectory.{name}: integer dtype expected, got {dtype}")
    if arrays["logprobs"].dtype.kind != "f":
        raise DecodeError(f"trajectory.logprobs: float dtype expected, got {arrays['logprobs'].dtype}")


@dataclass(frozen=True, eq=False)
class RolloutGroup(Message):
    # RaaS -> dataflow, stream `rollouts`
    KIND: ClassVar[str] = "rollout_group"
    uid: str
    """The prompt group's uid."""
    raas: str
    """Worker id of the RaaS that ran it."""
    version: int
    """Submitted-at version of the prompt group."""
    trajectories: Columns[Trajectory]
    """(On the wire one list or array per field for the whole group: `columnar.columns`.)"""
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    """Why the whole group failed; None when it did not."""
    models: list[str] = field(default_factory=list)
    """The policies the prompt group trains (a failed group has no trajectories to tell)."""
    eval_version: int = -1
    """The prompt group's `eval_version` (>= 0: an eval group, scored and never trained on)."""
    eval_dataset: str = ""

    def readable(self) -> dict[str, str]:
        trajs = self.trajectories
        out = {Plain.raas: self.raas, Plain.samples: str(len(trajs))}
        out[Plain.status] = "failed" if self.error else "ok"
        if trajs:
            out[Plain.policy] = " ".join(sorted({t.model for t in trajs}))
            out[Plain.reward] = f"{sum(t.reward for t in trajs) / len(trajs):.4g}"
            out[Plain.tokens] = str(sum(len(t.token_ids) for t in trajs))
            made = [v for t in trajs if len(v := t.versions[t.versions >= 0])]
            if made:
                low, high = min(int(v.min()) for v in made), max(int(v.max()) for v in made)
                out[Plain.token_versions] = f"{low}..{high}"
        if self.error:
            out[Plain.error] = self.error[:120]
        return out

    def _check(self) -> None:
        # Decoded, every trajectory's arrays are slices at the same bounds of the same four (the columns
        # of a `columnar.ColumnList`, checked 1-D and of the lengths' total): those have the dtypes of all.
        if self.trajectories:
            _check_dtypes(self.trajectories.columns)  # type: ignore[attr-defined]


@dataclass(frozen=True, eq=False)
class SampleGroup(Message):
    # dataflow -> trainer: one accepted group of one model, kept in the ready set, then part of a Batch
    KIND: ClassVar[str] = "sample_group"
    uid: str
    model: str
    min_version: int
    """Oldest weight version among the group's trained tokens (its staleness)."""
    max_version: int
    rollout: bytes
    """The RolloutGroup's `data` exactly as the RaaS published it: token arrays are never re-encoded."""
    indices: list[int]
    """Which of the rollout's trajectories this group trains, in order."""
    advantages: np.ndarray
    """float32 [len(indices)]: normalised advantage per trajectory."""
    submitted_version: int = 0
    raas: str = ""

    @functools.cached_property
    def trajectories(self) -> list[Trajectory]:
        """The trajectories at `indices` (decoded on first use; DecodeError if the rollout is bad)."""
        group = unpack(RolloutGroup, self.rollout, path=f"g:{self.uid}.rollout")
        if any(not 0 <= i < len(group.trajectories) for i in self.indices):  # type: ignore[attr-defined]
            raise DecodeError(f"g:{self.uid}.indices: out of range")
        return [group.trajectories[i] for i in self.indices]  # type: ignore[attr-defined]

    def _check(self) -> None:
        if self.advantages.shape != (len(self.indices),):
            n = len(self.indices)
            raise DecodeError(f"sample_group.advantages: shape {self.advantages.shape} != ({n},)")


@dataclass(frozen=True, eq=False)
class Batch(Message):
    # dataflow -> trainer of `model`, stream `batches:<model>`
    KIND: ClassVar[str] = BatchEntry.kind
    uid: str
    model: str
    version: int
    """Trainer version the batch was formed for."""
    groups: list[SampleGroup]
    replayed_uids: list[str] = field(default_factory=list)
    """Groups mixed in from the replay set (trained before, on purpose)."""

    @property
    def group_uids(self) -> list[str]:
        return [g.uid for g in self.groups]


@dataclass(frozen=True, eq=False)
class VersionPublished(Message):
    # trainer -> dataflow, stream `versions`
    KIND: ClassVar[str] = "version_published"
    uid: str
    model: str
    version: int
    manifest_key: str
    step: int
    incarnation: str
    """Id of the trainer process lineage; a restarted trainer with a new one forces full re-syncs."""
    eval: bool = False
    checkpoint: str = ""
    """A loadable checkpoint directory of this version on a shared file system ('' = none)."""

    def readable(self) -> dict[str, str]:
        return {
            Plain.step: str(self.step),
            Plain.incarnation: self.incarnation,
            Plain.eval: str(int(self.eval)),
        }


@dataclass(frozen=True, eq=False)
class VersionNotice(Message):
    # dataflow -> every RaaS, stream `notices`
    KIND: ClassVar[str] = "version_notice"
    uid: str
    version: int
    models: dict[str, int]
    """Model -> version to load now."""
    manifests: dict[str, str]
    """Model -> manifest key."""
    checkpoints: dict[str, str] = field(default_factory=dict)
    """Model -> checkpoint directory to load directly (a shared file system; no weight transfer)."""
    eval: bool = False
    """Eval notices are synchronous: load every model before taking new work."""
    incarnations: dict[str, str] = field(default_factory=dict)
    """Model -> trainer incarnation of its version: weights of another incarnation are dropped (a
    restarted trainer rolled back to an older version and trains the next ones again, differently)."""

    def readable(self) -> dict[str, str]:
        return {Plain.load: _pairs(self.models), Plain.eval: str(int(self.eval))}


@dataclass(frozen=True, eq=False)
class TensorSpec(Message):
    # part of a WeightManifest
    KIND: ClassVar[str] = "tensor_spec"
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class WeightFile(Message):
    # part of a WeightManifest: where a process on the trainer's host may read the served bytes
    KIND: ClassVar[str] = "weight_file"
    host: str
    """The boot id of the trainer's kernel: a process whose kernel has another one is on another host."""
    device: int
    inode: int
    """The file's identity on that kernel (another file at `path`, e.g. in another container, differs)."""
    path: str
    offset: int
    """Where the weight data starts in the file."""


@dataclass(frozen=True, eq=False)
class WeightManifest(Message):
    # trainer -> RaaS, hash `weights:<model>:<version>`
    KIND: ClassVar[str] = "weight_manifest"
    uid: str
    model: str
    version: int
    kind: str
    """`full`: receivers pull the whole buffer (a periodic full sync); `delta`: those holding
    `base_version` of the same incarnation may pull the delta instead."""
    base_version: int | None
    endpoints: list[str]
    nbytes: int
    """Size of the weight data (the safetensors data section)."""
    digest: str
    """BLAKE3 digest of the weight data (see `weights.layout.digests`)."""
    chunk_digests: list[str]
    tensors: list[TensorSpec]
    incarnation: str
    chunk_bytes: int = 4 << 20
    delta_nbytes: int = 0
    delta_digest: str = ""
    """BLAKE3 digest of the delta bytes ('' = no delta from `base_version`)."""
    base_digest: str = ""
    """Digest of the base version's weights: a receiver holding exactly those bytes may apply the delta
    (whichever trainer incarnation produced them)."""
    file: WeightFile | None = None
    """The served half's file, for receivers on the trainer's host (`weights.local`); None: none."""
    device_checksum: str = ""
    """`weights.device.checksum` of the weight data where the trainer built it on its device ('' where it
    built it on the host): checked by engines that take the version device to device."""
    adapter_of: str = ""
    """A LoRA adapter of the base weights with this digest (`weights.adapters.base_digest`); '' = the
    version is full weights."""
    adapter_config: str = ""
    """A LoRA adapter's PEFT `adapter_config.json` text ('' for full weights)."""

    def readable(self) -> dict[str, str]:
        base = "" if self.base_version is None else str(self.base_version)
        return {Plain.sync: self.kind, Plain.base_version: base, Plain.nbytes: str(self.nbytes)}


@dataclass(frozen=True, eq=False)
class Heartbeat(Message):
    # RaaS -> dataflow and operators, hash `raas:<id>` with a TTL
    KIND: ClassVar[str] = "heartbeat"
    uid: str
    """Worker id."""
    region: str
    capacity: int
    in_flight: int
    versions: dict[str, int]
    endpoint: str | None
    """Where peers fetch weights it holds (the weight manager); None until it serves any."""
    started_at: float
    updated_at: float
    engine: str = ""
    """Engine type (vllm, hf, openai) and model."""
    generating_s: float = 0.0
    """Seconds since `started_at` during which at least one prompt group was being rolled out."""
    groups: int = 0
    """Prompt groups handed off to `rollouts` since `started_at` (its production, for `astraflow scale`)."""

    def readable(self) -> dict[str, str]:
        return {
            Plain.region: self.region,
            Plain.capacity: str(self.capacity),
            Plain.in_flight: str(self.in_flight),
            Plain.versions: _pairs(self.versions),
            Plain.engine: self.engine,
            Plain.groups: str(self.groups),
        }


def _pairs(values: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (PromptGroup, RolloutGroup, VersionPublished, VersionNotice, WeightManifest, Heartbeat)
}
HEADERS = (Entry.uid, Entry.model, Entry.version)
"""Header fields copied from the message's attribute of the same name, where it has one."""


def encode(msg: Message) -> dict[str, bytes]:
    """The field map of `msg`: readable headers plus msgpack `data`."""
    fields = {Entry.kind: msg.KIND.encode(), Entry.schema: str(SCHEMA_VERSION).encode()}
    for name in HEADERS:
        value = getattr(msg, name, None)
        if value is not None:
            fields[name] = str(value).encode()
    fields.update((k, v.encode()) for k, v in msg.readable().items())
    fields[Entry.data] = pack(msg)
    return fields


def batch_refs(fields: dict[Any, Any]) -> list[str]:
    """The sample references of a batch entry (`schema.BatchEntry`, written by the dataflow's form.lua):
    where each group's packed SampleGroup is kept, in group order."""
    return _text(_str_keys(fields), BatchEntry.refs).split()


def decode_batch(
    fields: dict[Any, Any], payloads: Sequence[bytes | None], max_bytes: int | None = None
) -> Batch:
    """Decode a batch entry (`schema.BatchEntry`) and its groups' payloads (fetched by its `refs`, in
    order); DecodeError names the bad field or group."""
    fields = _str_keys(fields)
    if _text(fields, Entry.kind) != BatchEntry.kind:
        raise DecodeError(f"{Entry.kind}: expected {BatchEntry.kind!r}, got {_text(fields, Entry.kind)!r}")
    _check_schema(fields)
    try:
        version = int(_text(fields, Entry.version))
    except ValueError:
        raise DecodeError(f"{Entry.version}: not an integer") from None
    uids = _text(fields, BatchEntry.groups).split()
    if len(uids) != len(payloads):
        raise DecodeError(f"{BatchEntry.refs}: {len(payloads)} payloads for {len(uids)} groups")
    groups = [
        unpack(SampleGroup, data, max_bytes, f"group {u}") for u, data in zip(uids, payloads, strict=True)
    ]
    return Batch(
        uid=_text(fields, Entry.uid),
        model=_text(fields, Entry.model),
        version=version,
        groups=groups,  # type: ignore[arg-type]
        replayed_uids=_text(fields, BatchEntry.replayed).split(),
    )


def decode(
    fields: dict[Any, Any], expect: type[Message] | None = None, max_bytes: int | None = None
) -> Message:
    """Decode a field map produced by `encode`; raises DecodeError naming the first bad field."""
    fields = _str_keys(fields)
    kind = _text(fields, Entry.kind)
    cls = KINDS.get(kind)
    if cls is None:
        raise DecodeError(f"{Entry.kind}: unknown message kind {kind!r}")
    if expect is not None and cls is not expect:
        raise DecodeError(f"{Entry.kind}: expected {expect.KIND!r}, got {kind!r}")
    _check_schema(fields)
    return unpack(cls, fields.get(Entry.data), max_bytes)


def _str_keys(fields: dict[Any, Any]) -> dict[str, Any]:
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}


def _check_schema(fields: dict[str, Any]) -> None:
    if _text(fields, Entry.schema) != str(SCHEMA_VERSION):
        got = fields[Entry.schema]
        raise DecodeError(f"{Entry.schema}: unsupported schema {got!r} (this build reads {SCHEMA_VERSION})")


def _text(fields: dict[str, Any], name: str) -> str:
    value = fields.get(name)
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise DecodeError(f"{name}: not UTF-8") from None
    if isinstance(value, str):
        return value
    raise DecodeError(f"{name}: missing header field")
