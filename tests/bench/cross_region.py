"""Cross-region weight sync: one version to N receivers in region b behind a long link (a user-space
proxy adding latency and capping bandwidth), relayed in the region vs each receiver pulling over the
link, both measured in the same run: bytes over the link and time to have every receiver verified, for a
full version and then a delta (a sparse change).

The baseline runs the same receivers, each alone in its own region (so each is its region's relay and
pulls from the trainer): what happens without a relay in the region.

    python tests/bench/cross_region.py [--mib 8] [--receivers 8] [--latency-ms 50] [--link-mbps 100]
                                       [--changed 0.01] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` helpers, run as a script

from _smoke import parse

from astraflow import redis_server
from astraflow.streams import Bus
from astraflow.streams.settings import RedisSettings, StreamsSettings
from astraflow.weights import layout
from astraflow.weights.published import run_secret
from astraflow.weights.publisher import WeightPublisher
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings
from tests.link_proxy import LinkProxy

MODEL = "policy"
VERSIONS = ("v0 full", "v1 delta")


def random_state(mib: float) -> dict[str, torch.Tensor]:
    rows = max(1, int(mib * (1 << 20)) // (2 * 1024))  # bf16: 2 bytes an element, 1024 columns
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows // 4 or 1, 1024, generator=g) for i in range(4)}


def sparse_step(state: dict[str, torch.Tensor], frac: float) -> None:
    g = torch.Generator().manual_seed(1)
    for t in state.values():
        t.add_((torch.rand(t.shape, generator=g) < frac) * torch.randn(t.shape, generator=g))


async def one_round(url: str, run: str, args, tmp: Path) -> dict[tuple[str, str], tuple[int, float]]:
    """{(version, mode): (bytes over the link, seconds until every receiver holds it verified)}."""
    # Every receiver pulls in a thread, and here they share one process: a pool for all of them (the
    # default one, of 6 threads on 2 cores, would queue the relay's pull behind its followers' waits).
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4 * args.receivers))
    bus = Bus.connect(url, run, RedisSettings(), StreamsSettings())
    await bus.bootstrap([MODEL])
    proxy = LinkProxy(latency_s=args.latency_ms / 1000, bps=args.link_mbps * 1e6 / 8)
    settings = WeightsSettings(full_every=100, host="127.0.0.1", advertise=f"127.0.0.1:{proxy.port}")
    secret = await run_secret(bus, settings)
    state = random_state(args.mib)
    pub = WeightPublisher(
        bus, settings, MODEL, layout.layout(state, "bfloat16"), tmp / run / "trainer", secret
    )
    proxy.target = ("127.0.0.1", pub.server.port)
    out = {}
    receivers = {
        mode: [
            WeightReceiver(
                bus,
                WeightsSettings(io_timeout_s=30.0, same_host=False),  # they stand for far hosts
                MODEL,
                tmp / run / f"{mode}{i}",
                secret,
                WeightServer(secret),
                region="b" if mode == "relay" else f"b{i}",  # direct: each alone in its region
            )
            for i in range(args.receivers)
        ]
        for mode in ("direct", "relay")
    }
    try:
        for v, name in enumerate(VERSIONS):
            if v:
                sparse_step(state, args.changed)
            await pub.publish(state, v, step=v)
            await pub.wait()
            for mode, group in receivers.items():
                proxy.reset()
                started = time.perf_counter()
                await asyncio.gather(*(rx.sync(bus.keys.weights(MODEL, v), v) for rx in group))
                out[(name, mode)] = (proxy.down, time.perf_counter() - started)
                assert all(rx.held == (v, pub._digest) for rx in group)
    finally:
        for rx in (rx for group in receivers.values() for rx in group):
            rx.close()
            rx.server.close()
        await pub.close()
        proxy.close()
        await bus.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=8.0, help="size of the served (bf16) weights")
    ap.add_argument("--receivers", type=int, default=8)
    ap.add_argument("--latency-ms", type=float, default=50.0, help="one way, on the link")
    ap.add_argument("--link-mbps", type=float, default=100.0, help="link bandwidth, megabits/s each way")
    ap.add_argument("--changed", type=float, default=0.01, help="share of elements a step changes")
    ap.add_argument("--rounds", type=int, default=1)
    args = parse(ap, mib=0.25, receivers=2, latency_ms=5, link_mbps=1000)
    results: dict[tuple[str, str], list[tuple[int, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = redis_server.start(tmp)
        try:
            for r in range(args.rounds):
                got = asyncio.run(one_round(server.url, f"xr{r}", args, Path(tmp)))
                for k, v in got.items():
                    results.setdefault(k, []).append(v)
        finally:
            server.stop()
    print(
        f"cross-region sync: {args.receivers} receivers in region b behind a {args.latency_ms:g} ms, "
        f"{args.link_mbps:g} Mbit/s link; {args.mib:g} MiB bf16 weights, delta = {args.changed:.0%} changed; "
        f"median of {args.rounds} round(s)"
    )
    head = f"{'version':<10}{'mode':<8}{'link MiB':>10}{'time s':>9}"
    print(f"{head}{'bytes direct/relay':>20}{'time direct/relay':>19}")
    for name in VERSIONS:
        med = {
            mode: (
                statistics.median(b for b, _ in results[(name, mode)]),
                statistics.median(t for _, t in results[(name, mode)]),
            )
            for mode in ("direct", "relay")
        }
        for mode, (nbytes, secs) in med.items():
            ratio = ("", "")
            if mode == "relay":
                ratio = (f"{med['direct'][0] / nbytes:.2f}x", f"{med['direct'][1] / secs:.2f}x")
            print(f"{name:<10}{mode:<8}{nbytes / (1 << 20):>10.3f}{secs:>9.2f}{ratio[0]:>20}{ratio[1]:>19}")


if __name__ == "__main__":
    main()
