"""`astraflow record --run NAME [--dir D]`: the record of a run whose workers were started on their own.

What `astraflow run` leaves in its directory - `metrics.jsonl`, `summary.json`, `reward.png` - made from
the run's Redis alone (`launch.progress`, `launch.report`), so a cluster of separately started workers
gets it too: follow the run until it is stopped (by a stop condition, `launch.stops`) or until SIGINT or
SIGTERM, rewriting the report every `REPORT_EVERY_S`; `--once`, what the run holds now. It is a command
of its own, not a part of the dataflow: dataflow replicas are stateless and many, may run where no disk
is kept, and a record can be made while the run goes on or after it ended, from any machine that reaches
its Redis. `metrics.jsonl` is rebuilt from the metrics stream each time (its retention bounds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

from astraflow.config import Settings
from astraflow.launch import report
from astraflow.launch.progress import Progress, Snapshot, line
from astraflow.launch.stops import stopped_reason
from astraflow.ops.context import settings_from, with_bus
from astraflow.streams import Bus
from astraflow.streams.identity import existing

REPORT_EVERY_S = 60.0
"""How often a followed run's `summary.json` and `reward.png` are rewritten (and once it stops)."""
POLL_S = 2.0


def cmd_record(args) -> int:
    settings = settings_from(args)
    out = Path(args.dir) if args.dir else settings.run.path
    return asyncio.run(with_bus(settings, lambda bus: record(bus, settings, out, args.once), known=True))


async def record(bus: Bus, settings: Settings, out: Path, once: bool = False) -> int:
    """Write the run's record into `out` until it stops (see the module doc); 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    r = settings.run
    identity = await existing(bus)
    created = identity.created if identity is not None else time.time()
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.write_text("")  # rebuilt from the stream's first entry
    progress = Progress(bus, settings.trained, r.reward_window, metrics, detail_every_s=5.0, started=created)
    print(f"recording run {r.name!r} into {out}", flush=True)
    reported = time.monotonic()
    while True:
        snap = await progress.poll()
        identity = await existing(bus)
        stopped = identity is not None and identity.stopped is not None
        if once or stopped or stop.is_set():
            break
        if time.monotonic() - reported >= REPORT_EVERY_S:
            _write(out, progress, snap, settings, identity, "running")
            reported = time.monotonic()
            print(line(snap, r.reward_window), flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)
    reason = (await stopped_reason(bus) or "stopped") if stopped else None
    progress.detail_every_s = 0.0  # the ledger as it is now
    data = _write(out, progress, await progress.poll(), settings, identity, reason or "running")
    done = f"stopped: {reason}" if reason else "recorded"
    print(f"{done}; see {out / 'reward.png'} and {out / 'summary.json'}")
    print(report.busy_line(data), flush=True)
    return 0


def _write(out: Path, progress: Progress, snap: Snapshot, settings: Settings, identity, state: str) -> dict:
    """`summary.json` (`stopped`: why the run stopped, or `running`) and `reward.png` in `out`."""
    end = identity.stopped if identity is not None and identity.stopped else time.time()
    extra = {
        "stopped": state,
        "wall_s": round(end - progress.started, 1),
        "ledger": snap.ledger.as_dict() if snap.ledger is not None else None,
        "recorded_by": "astraflow record",
    }
    return report.write(out, progress, settings.run.reward_window, extra)
