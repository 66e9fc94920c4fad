"""Settings of the Redis connection and of the bus."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from astraflow.streams import keys


class RedisSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    """redis://host:port/db of a shared Redis; unset = start the embedded redis-server in the run dir."""
    password: SecretStr | None = None
    """Password for `url` (or put it in the URL); never printed."""
    socket_timeout_s: float = 5.0
    """Socket timeout of command connections (blocking reads use block_ms plus this)."""
    reconnect_max_s: float = 60.0
    """How long a one-shot command keeps reconnecting (with backoff) before it raises BusConnectionError;
    long-running workers wait out any outage instead."""


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
    handler_timeout_s: float = Field(600.0, gt=0)
    """A handler running longer is cancelled, its entry released, and its worker ends as unhealthy."""
