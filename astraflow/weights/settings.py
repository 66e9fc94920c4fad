"""Settings of the weight manager: served dtype, buffers, transport, sync cadence."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class WeightsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: SecretStr | None = None
    """Secret that authenticates weight transfers; unset = a random one kept in the run's Redis (readable
    by whoever may read the run's keys). Never printed."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the served weights (what engines load)."""
    dir: Path | None = None
    """Where weight buffers live; default /dev/shm/astraflow/<run> (else the temp dir)."""
    host: str = "127.0.0.1"
    """Address the weight server listens on and advertises (a routable one on a cluster)."""
    port: int = Field(0, ge=0)
    """Port of the weight server; 0 = any free one."""
    full_every: int = Field(10, ge=1)
    """Every this many versions the manifest asks for a full pull (resets any drift)."""
    keep_deltas: int = Field(4, ge=1)
    """Deltas kept on disk for receivers that are a version behind."""
    parallel: int = Field(4, ge=1)
    """Connections one pull uses."""
    egress_bps: float = Field(0, ge=0)
    """Cap on the bytes/s this process sends (cross-region links); 0 = none."""
    manifest_ttl_s: int = Field(3600, gt=0)
    """How long a version's manifest stays in Redis."""
