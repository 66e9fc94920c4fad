"""Which address a weight server listens on and which endpoint it advertises to other processes.

Unset `weights.host` means: loopback when the run is local (the embedded Redis, or a Redis URL on this
host), else the address of the interface that routes to the Redis host (the one other hosts of the
cluster reach), else what this host's name resolves to. `weights.advertise` (`--advertise`) overrides
what others are told: a HOST or HOST:PORT, e.g. behind NAT or a Kubernetes Service.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from astraflow.weights.settings import WeightsSettings

LOOPBACK = "127.0.0.1"


def is_local(redis_url: str | None) -> bool:
    """Whether a run on `redis_url` is confined to this host: the embedded Redis, or one on loopback."""
    if not redis_url:
        return True
    host = urlsplit(redis_url).hostname or "localhost"
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: another host, as far as we can tell without asking DNS


def outbound_address(peer: str) -> str | None:
    """The local address the kernel would use to reach `peer` (no packet is sent), else None."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:
        return None


def default_host(redis_url: str | None) -> str:
    """The listening address of `weights.host` when unset (see the module doc)."""
    if is_local(redis_url):
        return LOOPBACK
    found = outbound_address(urlsplit(redis_url).hostname)  # type: ignore[arg-type]
    if found is None or ipaddress.ip_address(found).is_loopback:
        try:
            found = socket.gethostbyname(socket.gethostname())
        except OSError:
            found = None
    if found is None or ipaddress.ip_address(found).is_loopback:
        raise ValueError(
            "no address of this host that others can reach was found: set weights.host or --advertise"
        )
    return found


def redis_contact(url: str | None, sentinels: list[str]) -> str | None:
    """Where this process finds Redis, as a URL whose host `is_local` and `default_host` judge: the
    configured URL, else the first Sentinel's (a run behind Sentinel has no URL), else None (embedded)."""
    return url or (f"redis://{sentinels[0]}" if sentinels else None)


def resolved(weights: WeightsSettings, redis_url: str | None) -> WeightsSettings:
    """`weights` with `host` filled in when unset: what a process serving weights on this host uses."""
    if weights.host is not None:
        return weights
    return weights.model_copy(update={"host": default_host(redis_url)})


def endpoint(host: str, port: int, advertise: str | None) -> str:
    """The `host:port` others are told: `advertise` (HOST or HOST:PORT; the bound port when none) or the
    listening address."""
    if advertise is None:
        return f"{host}:{port}"
    name, sep, given = advertise.rpartition(":")
    if sep and name and given.isdigit():
        return advertise
    return f"{advertise}:{port}"
