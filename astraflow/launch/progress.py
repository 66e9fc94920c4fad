"""What a run is doing, read from Redis alone (so `astraflow top` can show a run started elsewhere).

`Progress.poll` reads the trainers' new `metrics` entries (appending them to `metrics.jsonl` when given a
path), the ledger, the RaaS heartbeats and the streams' lag; `render` turns a snapshot into a rich table,
`line` into one plain log line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.dataflow.ledger import Ledger, read_ledger
from astraflow.errors import DecodeError
from astraflow.launch.evals import EvalResults
from astraflow.messages import Heartbeat, decode
from astraflow.streams import Bus
from astraflow.streams.records import (
    EvalResult,
    EvalSubmitted,
    RolloutStats,
    TrainerStep,
    add_metrics,
    decode_record,
)
from astraflow.streams.views import SCAN_COUNT, inspect_run


@dataclass
class ModelProgress:
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    """(version, wall seconds since start, on-policy reward): the mean reward of all rollouts collected
    since the previous step (before dynamic sampling drops groups), else of the step's batch."""
    last: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    pending: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """Reward sum and samples of rollouts collected since the last step."""
    train_s: float = 0.0
    """Trainer compute time (`step_s`) summed over the steps."""
    curves: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    """Per workflow metric (`tool_call`, ...): (version, wall seconds, its mean over the rollouts collected
    since the previous step), for the steps after which some rollout reported it."""
    pending_metrics: dict[str, list[float]] = field(default_factory=dict)
    """Per workflow metric: [sum, trajectories] of rollouts collected since the last step."""

    def moving_reward(self, window: int) -> float | None:
        return moving(self.steps, window)

    def eta_s(self, window: int, target: float, horizon_s: float = 60.0) -> float | None:
        """Seconds until the moving reward reaches `target` at its trend over the last `horizon_s` (a
        least-squares line through the steps' rewards); None when it is not rising."""
        now = self.steps[-1][1] if self.steps else 0.0
        recent = [(t, r) for _, t, r in self.steps if t >= now - horizon_s]
        ma = self.moving_reward(window)
        if ma is None or len(recent) < 2 * window:
            return None
        if ma >= target:
            return 0.0
        mt = sum(t for t, _ in recent) / len(recent)
        mr = sum(r for _, r in recent) / len(recent)
        var = sum((t - mt) ** 2 for t, _ in recent)
        slope = sum((t - mt) * (r - mr) for t, r in recent) / var if var else 0.0
        return (target - ma) / slope if slope > 0 else None


@dataclass
class Snapshot:
    elapsed_s: float
    models: dict[str, ModelProgress]
    ledger: Ledger | None
    raas: list[Heartbeat]
    streams: list
    evals: dict[str, str] = field(default_factory=dict)
    """Per policy, its newest eval result (`EvalResults.latest`)."""


class Progress:
    def __init__(
        self,
        bus: Bus,
        models: list[str],
        window: int,
        metrics_path: Path | None = None,
        detail_every_s: float = 0.0,
        started: float | None = None,
    ) -> None:
        """`detail_every_s`: the ledger, heartbeats and stream views (a dozen round trips, and a scan of
        every stream) are re-read at most this often; the metrics on every `poll`. `started`: the Unix
        time wall seconds count from (default now; a run started elsewhere: its identity's `created`)."""
        self.bus, self.window, self.metrics_path = bus, window, metrics_path
        self.detail_every_s = detail_every_s
        self._detail: tuple[float, tuple] | None = None
        self.models = {m: ModelProgress() for m in models}
        self.started = time.time() if started is None else started
        self._cursor = "0-0"
        self.evals = EvalResults()
        """The eval results (`kind=eval` entries), every policy's."""
        self._generating: dict[tuple[str, float], float] = {}
        """(RaaS id, started at) -> its generating seconds, as last seen in its heartbeat."""

    @property
    def generating_s(self) -> float:
        """Seconds the RaaS workers spent rolling out, summed over workers (and their restarts)."""
        return sum(self._generating.values())

    def skip_to(self, entry_id: str) -> None:
        """Read `metrics` only after `entry_id` (a resumed run)."""
        self._cursor = entry_id

    async def poll(self) -> Snapshot:
        await self.read_metrics()
        if self._detail is None or time.monotonic() - self._detail[0] >= self.detail_every_s:
            self._detail = (time.monotonic(), await self._read_detail())
        ledger, raas, streams = self._detail[1]
        evals = self.evals.latest()
        return Snapshot(time.time() - self.started, self.models, ledger, raas, streams, evals)

    async def _read_detail(self) -> tuple:
        ledger = await read_ledger(self.bus, list(self.models))
        raas = await read_heartbeats(self.bus)
        for hb in raas:
            self._generating[(hb.uid, hb.started_at)] = hb.generating_s
        return ledger, raas, await inspect_run(self.bus)

    async def read_metrics(self) -> None:
        """Take in the `metrics` entries added since the last read (XRANGE, which every role that may
        read the stream may send)."""
        entries = await self.bus.redis.xrange(self.bus.keys.metrics, min=f"({self._cursor}", count=10_000)
        out = self.metrics_path.open("a") if self.metrics_path else None
        try:
            for entry_id, fields in entries:
                self._cursor = entry_id.decode()
                r = decode_record(fields)
                if isinstance(r, EvalResult | EvalSubmitted):  # any policy's, trained or not
                    self.evals.add(r, r.time - self.started)
                    continue
                if not isinstance(r, RolloutStats | TrainerStep) or r.model not in self.models:
                    continue
                m = self.models[r.model]
                if isinstance(r, RolloutStats):
                    m.pending[0] += r.reward_sum
                    m.pending[1] += r.samples
                    add_metrics(m.pending_metrics, r.metrics)
                    continue
                stats = dict(r.stats)
                at = r.time - self.started
                reward = m.pending[0] / m.pending[1] if m.pending[1] else stats.get("reward_mean", 0.0)
                m.pending = [0.0, 0.0]
                stats["rollout_reward"] = reward
                version = r.version
                for curve in (m.steps, *m.curves.values()):
                    while curve and curve[-1][0] >= version:  # a restarted trainer retrained these
                        curve.pop()
                m.steps.append((version, at, reward))
                for name, (total, n) in m.pending_metrics.items():
                    stats[f"rollout_{name}"] = total / n
                    m.curves.setdefault(name, []).append((version, at, total / n))
                m.pending_metrics = {}
                m.last = stats
                m.samples += int(stats.get("samples", 0))
                m.train_s += float(stats.get("step_s", 0.0))
                if out is not None:
                    line = {"model": r.model, "version": r.version, "wall_s": round(at, 3), **stats}
                    out.write(json.dumps(line) + "\n")
        finally:
            if out is not None:
                out.close()


def moving(points: list[tuple[int, float, float]], window: int) -> float | None:
    """The mean value of the last `window` (version, time, value) points; None without any."""
    tail = [v for _, _, v in points[-window:]]
    return sum(tail) / len(tail) if tail else None


def metrics_text(m: ModelProgress, window: int) -> str:
    """The workflow's metrics' moving averages, ` tool_call 0.812`, or nothing."""
    return "".join(f" {name} {moving(points, window):.3f}" for name, points in m.curves.items() if points)


async def read_heartbeats(bus: Bus) -> list[Heartbeat]:
    """The live RaaS workers' heartbeats (an unreadable one is skipped)."""
    beats = []
    async for key in bus.redis.scan_iter(match=bus.keys.raas("*"), count=SCAN_COUNT):
        try:
            beats.append(decode(await bus.redis.hgetall(key), Heartbeat))
        except DecodeError:
            continue
    return beats


def samples_per_s(m: ModelProgress) -> float:
    if len(m.steps) < 2:
        return 0.0
    span = m.steps[-1][1] - m.steps[0][1]
    return m.samples / span if span > 0 else 0.0


def staleness(stats: dict[str, float]) -> str:
    """The last step's staleness distribution: `0:62% 1:38%` (share of samples by versions behind)."""
    tagged = ((k.removeprefix("staleness_"), v) for k, v in stats.items() if k.startswith("staleness_"))
    shares = sorted((int(lag), share) for lag, share in tagged if lag.isdigit())
    return " ".join(f"{lag}:{share:.0%}" for lag, share in shares) or "-"


def line(s: Snapshot, window: int) -> str:
    """One plain progress line (non-TTY output)."""
    parts = [f"{s.elapsed_s:7.1f}s"]
    for name, m in s.models.items():
        ma = m.moving_reward(window)
        version = m.steps[-1][0] if m.steps else 0
        ma_text = f"{ma:.3f}" if ma is not None else "-"
        parts.append(f"{name} v{version} reward(ma{window}) {ma_text}{metrics_text(m, window)}")
        if m.last:
            parts.append(
                f"tok/s {m.last.get('tokens_per_s', 0):.0f} staleness {m.last.get('staleness_mean', 0):.2f}"
            )
    parts += [f"eval {name} {text}" for name, text in s.evals.items()]
    if s.ledger is not None:
        parts.append(f"ledger sub {s.ledger.submitted} fly {s.ledger.in_flight} dead {s.ledger.dead}")
    return "  ".join(parts)


def render(s: Snapshot, window: int, target: float | None):
    """A rich renderable of the snapshot (the live view)."""
    from rich.console import Group
    from rich.table import Table

    top = Table(title=f"astraflow  {s.elapsed_s:.0f}s", expand=True)
    cols = ("model", "version", f"reward ma{window}", "eval", "samples/s", "tokens/s", "staleness", "ETA")
    for col in cols:
        top.add_column(col, overflow="fold")
    for name, m in s.models.items():
        ma = m.moving_reward(window)
        eta = m.eta_s(window, target) if target is not None else None
        top.add_row(
            name,
            str(m.steps[-1][0] if m.steps else 0),
            (f"{ma:.3f}" + (f" / {target}" if target else "") if ma is not None else "-")
            + metrics_text(m, window),
            s.evals.get(name, "-"),
            f"{samples_per_s(m):.0f}",
            f"{m.last.get('tokens_per_s', 0):.0f}",
            staleness(m.last),
            "-" if eta is None else f"{eta:.0f}s",
        )
    workers = Table(title="RaaS", expand=True)
    for col in ("worker", "versions", "load", "generating", "engine"):
        workers.add_column(col, overflow="fold")
    for hb in s.raas:
        up = max(hb.updated_at - hb.started_at, 1e-9)
        share = f"{hb.generating_s / up:.0%}"
        versions = " ".join(f"{m} v{v}" for m, v in hb.versions.items()) or "-"
        workers.add_row(hb.uid, versions, f"{hb.in_flight}/{hb.capacity}", share, hb.engine)
    streams = Table(title="streams", expand=True)
    for col in ("stream", "length", "group", "pending", "lag"):
        streams.add_column(col, overflow="fold")
    for v in s.streams:
        for g in v.groups or [None]:
            name = v.key  # (without the run prefix: `inspect_run`)
            if g is None:
                streams.add_row(name, str(v.length), "-", "-", "-")
            else:
                streams.add_row(
                    name, str(v.length), g.name, str(g.pending), str(g.lag if g.lag is not None else "-")
                )
    parts = [top, workers, streams]
    if s.ledger is not None:
        parts.append(s.ledger.render())
    return Group(*parts)
