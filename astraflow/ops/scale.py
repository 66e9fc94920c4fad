"""`astraflow scale`: print the plan once, or serve it to Prometheus (and a KEDA `prometheus` scaler).

Either way the figure is also written to the run's `scale` hash. Served, the pool's production is measured
over the last `window_s` seconds of heartbeats, so the figure follows the pool as it changes.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from astraflow.config import Settings
from astraflow.errors import describe
from astraflow.ops.context import settings_from, with_bus
from astraflow.ops.scale_plan import read_plan, render, write_plan
from astraflow.streams import Bus

log = structlog.get_logger(__name__)

GAUGES = {
    "astraflow_raas_needed": "RaaS workers the run needs (astraflow scale)",
    "astraflow_raas_workers": "RaaS workers alive (heartbeats)",
    "astraflow_raas_demand_groups_per_second": "Prompt groups per second the trainers can take",
    "astraflow_raas_pool_groups_per_second": "Prompt groups per second the pool produced",
    "astraflow_raas_worker_groups_per_second": "Prompt groups per second one worker makes while generating",
    "astraflow_raas_headroom": "Margin applied over the demand",
}


def cmd_scale(args) -> int:
    settings = settings_from(args)
    if args.serve is None:
        fn = lambda bus: once(bus, settings, args.headroom, args.window)  # noqa: E731
    else:
        window_s = 12 * args.interval  # the pool's production over the last minute (at 5 s)
        fn = lambda bus: serve(  # noqa: E731
            bus, settings, args.headroom, args.window, args.serve, args.bind, args.interval, window_s
        )
    return asyncio.run(with_bus(settings, fn))


async def once(bus: Bus, settings: Settings, headroom: float, window: int) -> int:
    p, _ = await read_plan(bus, settings, headroom, window)
    written = await write_plan(bus, p)
    print(render(p, settings.run.name))
    if not written:
        print(f"(not written to {bus.keys.scale}: this Redis user may not write it)")
    return 0


async def serve(
    bus: Bus,
    settings: Settings,
    headroom: float,
    window: int,
    port: int,
    bind: str,
    interval_s: float,
    window_s: float,
) -> int:
    """Serve the gauges on `bind:port` and refresh them (and the `scale` hash) every `interval_s`."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    gauges = {name: Gauge(name, doc, ["run"], registry=registry) for name, doc in GAUGES.items()}
    run = settings.run.name
    start_http_server(port, addr=bind, registry=registry)
    log.info("scale_exporter_started", port=port, bind=bind, run=run)
    history: list[tuple[float, dict]] = []  # (when, heartbeats by (uid, started_at)), oldest first
    while True:
        before = history[0][1] if history else None
        try:
            p, beats = await read_plan(bus, settings, headroom, window, before)
        except Exception as e:  # Redis away: the gauges keep the last figure until it is back
            log.warning("scale_read_failed", error=describe(e))
            await asyncio.sleep(interval_s)
            continue
        if not await write_plan(bus, p) and not history:  # said once
            log.warning("scale_not_written", key=bus.keys.scale, reason="this Redis user may not write it")
        for name, value in (
            ("astraflow_raas_needed", p.needed),
            ("astraflow_raas_workers", p.pool.workers),
            ("astraflow_raas_demand_groups_per_second", p.demand_groups_per_s),
            ("astraflow_raas_pool_groups_per_second", p.pool.groups_per_s),
            ("astraflow_raas_worker_groups_per_second", p.pool.per_worker_groups_per_s),
            ("astraflow_raas_headroom", p.headroom),
        ):
            gauges[name].labels(run=run).set(value)
        log.info("scale", needed=p.needed, workers=p.pool.workers, reason=p.reason)
        now = time.monotonic()
        history.append((now, {(hb.uid, hb.started_at): hb for hb in beats}))
        while len(history) > 1 and history[1][0] <= now - window_s:
            history.pop(0)
        await asyncio.sleep(interval_s)
