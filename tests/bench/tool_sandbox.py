"""Latency of one tool call: isolated in namespaces vs a plain process group (the fallback).

    python tests/bench/tool_sandbox.py [--calls 20]

Prints median and 90th percentile of `run_python("print(1)")`, one call at a time, after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from _smoke import parse

from astraflow.workflows import isolation
from astraflow.workflows.sandbox import run_python


async def timings(calls: int, namespaces: bool) -> list[float]:
    await run_python("pass", namespaces=namespaces)
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        result = await run_python("print(1)", namespaces=namespaces)
        out.append((time.perf_counter() - started) * 1000)
        assert result.ok, result
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    calls = parse(parser, calls=3).calls
    modes = [("process group", False)]
    why_not = isolation.available()
    if why_not is None:
        modes.append(("namespaces", True))
    else:
        print(f"namespaces unavailable here: {why_not}")
    print(f"{'mode':<14} {'median ms':>10} {'p90 ms':>8}")
    for name, namespaces in modes:
        ms = sorted(await timings(calls, namespaces))
        print(f"{name:<14} {statistics.median(ms):>10.1f} {ms[int(0.9 * (len(ms) - 1))]:>8.1f}")


if __name__ == "__main__":
    asyncio.run(main())
