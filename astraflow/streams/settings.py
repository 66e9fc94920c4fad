"""Settings of the Redis connection and of the bus."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator

from astraflow.errors import RuleError
from astraflow.streams import keys


class RedisSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    """redis://host:port/db (rediss:// for TLS) of a shared Redis; unset = the embedded redis-server."""
    username: str | None = None
    """ACL user (or put it in the URL); `astraflow redis acl` makes one per role of a run."""
    password: SecretStr | None = None
    """Password for `url` (or put it in the URL); never printed."""
    password_file: Path | None = None
    """File holding the password (its content less one trailing newline), read at start: e.g. a mounted
    Secret only this process sees. Exclusive with `password`; its content is never printed."""
    tls_ca_file: Path | None = None
    """CA certificate that signed the server's (rediss:// URLs); unset = the system's CAs."""
    tls_cert_file: Path | None = None
    """Client certificate, for a server that asks for one (`tls-auth-clients yes`)."""
    tls_key_file: Path | None = None
    """Private key of `tls_cert_file`."""
    socket_timeout_s: float = 5.0
    """Socket timeout of command connections (blocking reads use block_ms plus this)."""
    reconnect_max_s: float = 60.0
    """How long a one-shot command keeps reconnecting (with backoff) before it raises BusConnectionError;
    long-running workers wait out any outage instead."""
    replica_url: str | None = None
    """redis:// of a (region-local) replica: read-only traffic (notices, weight manifests, peer lists) goes
    there, everything else to the primary. A key the replica lacks yet, or a replica that is down or
    refusing, is read from the primary instead. Unset with `sentinels`: one of Sentinel's replicas."""
    sentinels: list[str] = Field(default_factory=list)
    """host:port of Redis Sentinels: when set, the primary (and replicas) are the ones they name for
    `master_name`, so every worker follows a failover; `url` is then unused."""
    master_name: str = "astraflow"
    """The name Sentinel monitors the primary under (`sentinel monitor NAME ...`)."""
    min_replicas_ack: int = Field(0, ge=0)
    """> 0: a hand-off is acknowledged to its worker only once `WAIT` reports this many replicas have it,
    so it survives a failover. 0: a failover may lose the last hand-offs (the ledger reports them)."""
    replica_ack_timeout_ms: int = Field(1000, gt=0)
    """How long one `WAIT` for `min_replicas_ack` replicas lasts before the hand-off is tried again."""

    _file_password: SecretStr | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_password_file(self) -> RedisSettings:
        if self.password_file is None:
            return self
        if self.password is not None:
            raise RuleError(
                "redis.password_file", "redis.password and redis.password_file are both set: give one"
            )
        try:
            text = self.password_file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else "not text"
            raise RuleError("redis.password_file", f"cannot read {self.password_file} ({reason})") from None
        if not text.strip():
            raise RuleError("redis.password_file", f"{self.password_file} is empty (it holds the password)")
        self._file_password = SecretStr(text.removesuffix("\n"))
        return self

    def secret(self) -> str | None:
        """The password to authenticate with: `password`, else the content of `password_file` as read when
        these settings were made, else None."""
        found = self.password or self._file_password
        return found.get_secret_value() if found else None

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, sentinels: list[str]) -> list[str]:
        for s in sentinels:
            host, _, port = s.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"sentinel {s!r}: expected host:port")
        return sentinels


class StreamsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_ms: int = Field(keys.LEASE_MS, gt=0)
    """An entry whose owner stopped renewing for this long may be reclaimed by another consumer."""
    block_ms: int = Field(keys.BLOCK_MS, gt=0)
    """How long one XREADGROUP blocks waiting for new entries."""
    max_deliveries: int = Field(3, ge=1)
    """An entry delivered more often than this goes to the `dead` stream."""
    dedup_ttl_ms: int = Field(keys.DEDUP_TTL_MS, gt=0)
    """How long an idempotency key prevents a republished entry from appearing twice."""
    max_entry_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """Largest entry a producer may publish and a consumer will decode."""
    capped_maxlen: int = Field(100_000, gt=0)
    """Approximate length kept of streams without a group (notices, dead, metrics)."""
    trim_interval_ms: int = Field(10_000, gt=0)
    """How often a consumer trims its input stream up to what every group acknowledged."""
    max_call_args: int = Field(100_000, ge=64)
    """Most arguments one Redis call of the bus carries: a call with many entries (publish_many, a
    hand-off of many items, ack, renew) goes as several, each entry whole in one. Redis 6.2 closes the
    connection on a request of more than 1,048,576 arguments; a smaller call also blocks Redis less."""
    max_call_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024)
    """Most bytes of arguments one Redis call of the bus carries (split like `max_call_args`; an entry
    larger than this goes in a call of its own). Redis closes the connection of a client whose request
    passes its `client-query-buffer-limit` (1 GiB by default)."""
    handler_timeout_s: float = Field(600.0, gt=0)
    """A handler running longer is cancelled, its entry released, and its worker ends as unhealthy."""
