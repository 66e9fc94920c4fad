"""Workflows pushed to a running run: a class serialised by value, signed, stored in the run's Redis.

`astraflow workflow push module:Class --run R` pickles the class with cloudpickle, its module by value (a
RaaS need not have it installed), and stores it in the hash `af:{R}:workflows` under the workflow's name
with an HMAC-SHA256 signature under `raas.push_key`. The key is shared by the pusher and the RaaS that
accept pushed code and is never stored in Redis, so a Redis writer alone cannot push code. The signature
covers the payload's digest, the workflow name, the run's name and identity (nonce and creation time,
`af:{R}:run`), who pushed it, when, and the Python version: a payload copied to another run, or to
another name, does not verify.

The identity a RaaS verifies against is the one it saw first (its first prompt group), never re-read:
a Redis writer who later rewrites a new run's nonce to an old run's, to replay the old run's pushes onto
it, finds that RaaS refusing every pushed workflow (the run's identity changed under it) rather than
accepting the old ones. A RaaS that first sees the run after such a rewrite cannot tell; that needs the
identity to be written only by whoever creates the run (no worker ACL may write it).

A RaaS loads a pushed workflow only with `raas.accept_pushed_code` on, and verifies before it unpickles:
nothing unsigned, wrongly signed or meant for another run is ever passed to `cloudpickle.loads`.
"""

from __future__ import annotations

import asyncio
import getpass
import hashlib
import hmac
import socket
import sys
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import msgpack
import structlog

from astraflow.errors import ConfigError
from astraflow.streams.identity import RunIdentity, existing
from astraflow.workflows.api import RolloutWorkflow, UnknownName, load, resolve_workflow

if TYPE_CHECKING:
    from astraflow.raas.settings import RaasSettings
    from astraflow.streams.bus import Bus

log = structlog.get_logger(__name__)

SCHEME = "astraflow-pushed-workflow-v2"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


class PushRefused(UnknownName):
    """A pushed workflow that may not run here: unsigned, wrongly signed, meant for another run or name,
    or pickled by another Python. A prompt group naming it is dead-lettered with this reason."""


@dataclass(frozen=True)
class PushedWorkflow:
    """One entry of the `workflows` hash."""

    name: str
    payload: bytes
    """cloudpickle bytes of the class."""
    digest: str
    """SHA-256 of `payload`, hex."""
    pushed_by: str
    pushed_at: float
    python: str
    signature: bytes

    def signed(self, run: str, identity: RunIdentity) -> bytes:
        """What the signature covers: everything but the payload itself (its digest stands for it)."""
        who = [run, identity.nonce, identity.created]
        fields = [SCHEME, *who, self.name, self.digest, self.pushed_by, self.pushed_at, self.python]
        return msgpack.packb(fields)

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def unpack(cls, name: str, raw: bytes) -> PushedWorkflow:
        try:
            pushed = cls(**msgpack.unpackb(raw))
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise PushRefused(f"pushed workflow {name!r} is malformed: {e}") from None
        if not (isinstance(pushed.payload, bytes) and isinstance(pushed.signature, bytes)):
            raise PushRefused(f"pushed workflow {name!r} is malformed: payload and signature must be bytes")
        return pushed


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def serialise(ref: str) -> bytes:
    """The class `module:Class` pickled with its module by value (the module's own code travels; what
    it imports from elsewhere must be installed where it runs)."""
    import cloudpickle

    cls = load(ref, "workflow")
    if not (isinstance(cls, type) and issubclass(cls, RolloutWorkflow)):
        raise ConfigError(f"{ref} is not a RolloutWorkflow subclass")
    module = sys.modules[cls.__module__]
    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(cls)
    finally:
        cloudpickle.unregister_pickle_by_value(module)


async def push(bus: Bus, key: bytes, ref: str, name: str | None = None) -> PushedWorkflow:
    """Sign `ref`'s class for this run and store it under `name` (default: `ref`); replaces an earlier
    push of that name. The run must exist: the signature binds its nonce."""
    run = await existing(bus)
    if run is None:
        raise ConfigError(f"no run {bus.keys.run!r} on this Redis: start it before pushing workflows")
    payload = serialise(ref)
    pushed = PushedWorkflow(
        name=name or ref,
        payload=payload,
        digest=hashlib.sha256(payload).hexdigest(),
        pushed_by=f"{getpass.getuser()}@{socket.gethostname()}",
        pushed_at=round(time.time(), 3),
        python=PYTHON,
        signature=b"",
    )
    signature = _mac(key, pushed.signed(bus.keys.run, run))
    pushed = PushedWorkflow(**{**asdict(pushed), "signature": signature})
    await bus.call(lambda: bus.redis.hset(bus.keys.workflows, pushed.name, pushed.pack()))
    return pushed


def verify(pushed: PushedWorkflow, key: bytes, run: str, identity: RunIdentity, name: str) -> None:
    """Raise PushRefused unless `pushed` was signed with `key` for workflow `name` of this run."""
    why = None
    if pushed.name != name:
        why = f"it was pushed as {pushed.name!r}"
    elif hashlib.sha256(pushed.payload).hexdigest() != pushed.digest:
        why = "its payload does not match its digest"
    elif not hmac.compare_digest(pushed.signature, _mac(key, pushed.signed(run, identity))):
        why = f"its signature does not verify for run {run!r} (nonce {identity.nonce}) under raas.push_key"
    elif pushed.python != PYTHON:
        why = f"it was pickled by Python {pushed.python}, this is {PYTHON}"
    if why:
        raise PushRefused(f"pushed workflow {name!r} refused: {why}")


class PushedWorkflows:
    """How a RaaS finds a workflow: registered or named in the recipe, else pushed to the run."""

    def __init__(self, bus: Bus, settings: RaasSettings) -> None:
        self.bus, self.accept = bus, settings.accept_pushed_code
        self.key = settings.push_key.get_secret_value().encode() if settings.push_key else b""
        self._loaded: dict[str, type[RolloutWorkflow]] = {}
        self._lock = asyncio.Lock()  # groups arriving together load a workflow once
        self._joined: RunIdentity | None = None

    async def resolve(self, name: str, allowed: Collection[str]) -> type[RolloutWorkflow]:
        if self.accept and self._joined is None:  # the identity pushes verify against, seen once
            self._joined = await existing(self.bus)
        try:
            return resolve_workflow(name, allowed)
        except ValueError as e:
            k = self.bus.keys
            if not self.accept:
                if await self.bus.call(lambda: self.bus.redis.hexists(k.workflows, name)):
                    raise UnknownName(
                        f"{e}; a workflow {name!r} was pushed to the run, but this RaaS does not accept "
                        "pushed code (raas.accept_pushed_code)"
                    ) from None
                raise
            async with self._lock:
                if name not in self._loaded:
                    raw = await self.bus.call(lambda: self.bus.redis.hget(k.workflows, name))
                    if raw is None:
                        raise
                    self._loaded[name] = await self._load(name, raw)
                return self._loaded[name]

    async def _load(self, name: str, raw: bytes) -> type[RolloutWorkflow]:
        import cloudpickle

        pushed = PushedWorkflow.unpack(name, raw)
        try:
            verify(pushed, self.key, self.bus.keys.run, await self._identity(), name)
        except PushRefused as e:
            log.error("pushed_workflow_refused", workflow=name, pushed_by=pushed.pushed_by, error=str(e))
            raise
        cls = cloudpickle.loads(pushed.payload)  # signed by the push key's holder for this run and name
        if not (isinstance(cls, type) and issubclass(cls, RolloutWorkflow)):
            raise PushRefused(f"pushed workflow {name!r} is not a RolloutWorkflow subclass")
        log.info(
            "pushed_workflow_loaded",
            workflow=name,
            digest=pushed.digest,
            pushed_by=pushed.pushed_by,
            pushed_at=pushed.pushed_at,
            cls=f"{cls.__module__}.{cls.__qualname__}",
        )
        return cls

    async def _identity(self) -> RunIdentity:
        """The run's identity as this RaaS first saw it; PushRefused if Redis now shows another."""
        now, joined = await existing(self.bus), self._joined
        if joined is None or now is None or (now.nonce, now.created) != (joined.nonce, joined.created):
            was = f"nonce {joined.nonce}" if joined else "no identity"
            raise PushRefused(
                f"the run's identity changed under this RaaS ({was} when it first read the run, "
                f"nonce {now.nonce if now else None} now): no pushed workflow is accepted"
            )
        return joined
