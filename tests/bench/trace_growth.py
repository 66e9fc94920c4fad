"""What a run leaves in Redis: keys and memory after `--seconds` of the default recipe, with the prompt
groups' lineage traces as shipped (one group in `dataflow.trace_every`, kept `trace_retention_s`), as
they were before (every group, kept a week), and without any (the baseline), in one invocation.

    python tests/bench/trace_growth.py [--seconds 600] [--arms shipped,before]

Each arm is one `astraflow run --keep-redis` of the default recipe for `--seconds` (no reward target);
its Redis is read after the run stopped, as a shared Redis would hold it. Per arm: rollout groups
collected, the run's keys, its trace keys, Redis `used_memory` (MiB), keys per 1,000 groups and the
largest key families. The last line: `trace growth:
shipped <k> keys <m> MiB, before <k> keys <m> MiB, none <k> keys <m> MiB (<s> s)`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import redis
from _smoke import parse

from astraflow import redis_server
from astraflow.streams.memory import family

ARMS = {
    "none": ["dataflow.trace_every=0"],
    "shipped": [],
    "before": [
        "dataflow.trace_every=1",
        "dataflow.trace_retention_s=604800",
        "dataflow.trace_max_groups=100000",
    ],
}


def run(arm: str, seconds: int, root: Path) -> dict:
    out = root / arm
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/addition-tiny.yaml", "--keep-redis"]
    for s in [f"run.dir={out}", f"run.max_time_s={seconds}", "run.target_reward=null", *ARMS[arm]]:
        cmd += ["--set", s]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, timeout=seconds + 600)
    if done.returncode != 0:
        raise SystemExit(f"{arm}: astraflow run exited {done.returncode}")
    summary = json.loads((out / "summary.json").read_text())
    server = redis_server.load(out / "redis")
    if server is None:
        raise SystemExit(f"{arm}: the run kept no Redis")
    try:
        client = redis.Redis.from_url(server.url)
        families = Counter(family(k.decode().split(":", 2)[-1]) for k in client.scan_iter(count=1000))
        got = {"keys": client.dbsize(), "traces": families["trace:*"], "families": families}
        got["memory"] = client.info("memory")["used_memory"]
        client.close()
    finally:
        server.stop()
    return {**got, "groups": summary["ledger"]["models"]["policy"]["collected"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=int, default=600, help="each run's length")
    p.add_argument("--arms", default="shipped,before", help="besides the baseline: shipped, before")
    args = parse(p, seconds=15, arms="shipped")
    arms = ["none", *(a.strip() for a in args.arms.split(",") if a.strip() in ARMS and a.strip() != "none")]
    with tempfile.TemporaryDirectory() as tmp:
        results = {arm: run(arm, args.seconds, Path(tmp)) for arm in arms}
    print(f"{'traces':>8} {'groups':>8} {'keys':>8} {'trace':>8} {'MiB':>8} {'keys/kgroup':>12}")
    for arm, r in results.items():
        per, mib = 1000 * r["keys"] / max(r["groups"], 1), r["memory"] / 2**20
        largest = ", ".join(f"{name} {n}" for name, n in r["families"].most_common(4))
        print(
            f"{arm:>8} {r['groups']:>8} {r['keys']:>8} {r['traces']:>8} {mib:>8.1f} {per:>12.1f}  {largest}"
        )
    shown = {
        arm: f"{r['keys']} keys {r['memory'] / 2**20:.1f} MiB" if (r := results.get(arm)) else "-"
        for arm in ("shipped", "before", "none")
    }
    print(
        f"trace growth: shipped {shown['shipped']}, before {shown['before']}, none {shown['none']}"
        f" ({args.seconds} s)"
    )


if __name__ == "__main__":
    main()
