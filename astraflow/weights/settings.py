"""Settings of the weight manager: served dtype, buffers, transport, sync cadence."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class WeightsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: SecretStr | None = None
    """Secret that authenticates weight transfers; unset = a random one kept in the run's Redis (readable
    by whoever may read the run's keys). Never printed."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the served weights (what engines load)."""
    dir: Path | None = None
    """Where weight buffers live; default /dev/shm/astraflow-<uid>/<run> (else the temp dir)."""
    host: str | None = None
    """Address the weight server listens on; unset = loopback for a local run (embedded Redis or one on
    this host), else this host's address on the route to the Redis host (see `weights.address`)."""
    advertise: str | None = None
    """HOST or HOST:PORT other processes are told to pull from (`--advertise`; NAT, a Kubernetes Service);
    unset = `host` and the bound port."""
    port: int = Field(0, ge=0)
    """Port of the weight server; 0 = any free one."""
    full_every: int = Field(10, ge=1)
    """Every this many versions the manifest asks for a full pull (resets any drift)."""
    keep_deltas: int = Field(4, ge=1)
    """Deltas kept on disk for receivers that are a version behind."""
    same_host: bool = True
    """Copy a full version from the trainer's buffer file when it is on this host and readable here
    (verified chunk by chunk as a pull is) instead of pulling it over TCP; else, or when a chunk differs,
    over TCP (`weights.local`)."""
    build_on: Literal["auto", "device", "host"] = "auto"
    """Where the trainer builds each version (snapshot, compare with the served one, checksum): `device`
    on the weights' own device (`weights.on_device`: the trainer waits for one device-to-device copy, and
    engines on its host map the version by CUDA IPC); `host` in the host buffer; `auto` = `device` where
    the weights are on CUDA."""
    parallel: int = Field(4, ge=1)
    """Connections one pull uses."""
    egress_bps: float = Field(0, ge=0)
    """Cap on the bytes/s this process sends (cross-region links); 0 = none."""
    manifest_ttl_s: int = Field(3600, gt=0)
    """How long a version's manifest stays in Redis."""
    io_timeout_s: float = Field(30.0, gt=0)
    """Longest a weight connection waits on its peer for one send or receive; a silent peer is dropped."""
    max_connections: int = Field(64, ge=1)
    """Authenticated connections a weight server serves at once; more are closed after their handshake
    (the puller tries another source). Connections still in the handshake take no slot."""
    handshake_timeout_s: float = Field(5.0, gt=0)
    """Longest the whole handshake of a weight connection may take (TLS included), on both sides: a peer
    that has not proved the run secret by then is dropped, however it trickles its bytes, and a puller
    leaves a source that accepts and never answers (a frozen process) for the next one."""
    max_unauthenticated_per_address: int = Field(16, ge=1)
    """Connections from one address a weight server keeps in the handshake at once; a newer one from that
    address closes the oldest (a peer without the secret holds at most this many, each at most
    `handshake_timeout_s`, and cannot keep a puller sharing its address out)."""
    reader_grace_s: float = Field(10.0, gt=0)
    """How long writing a buffer half waits for transfers still reading it before cutting them off."""
    pull_deadline_s: float = Field(600.0, gt=0)
    """Longest one pull of a version may take over all the sources it tries."""
    tls: bool = False
    """Encrypt weight transfers with TLS (`tls_cert`, `tls_key`, `tls_ca`); plaintext by default."""
    tls_cert: Path | None = None
    """PEM certificate this process's weight server presents (its SAN must name `host`)."""
    tls_key: Path | None = None
    """PEM private key of `tls_cert`."""
    tls_ca: Path | None = None
    """PEM CA bundle that weight servers' certificates are checked against."""

    @model_validator(mode="after")
    def _wildcard(self) -> WeightsSettings:
        if self.host in ("0.0.0.0", "::") and self.advertise is None:
            raise ValueError(f"weights.host {self.host} is no address to pull from: set weights.advertise")
        return self

    @model_validator(mode="after")
    def _tls_files(self) -> WeightsSettings:
        missing = [n for n in ("tls_cert", "tls_key", "tls_ca") if getattr(self, n) is None]
        if self.tls and missing:
            raise ValueError(f"weights.tls needs {', '.join(missing)}")
        return self
