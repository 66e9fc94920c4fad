"""A worker that logs a line, then dies of an error inside a task group (as a service's body would)."""

import asyncio
import json
import sys


async def main() -> None:
    print(json.dumps({"event": "worker_started", "level": "info"}), file=sys.stderr, flush=True)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(asyncio.sleep(0))
        tg.create_task(fail())


async def fail() -> None:
    raise ValueError("train.jsonl:2: not JSON (Expecting value)")


if __name__ == "__main__":
    asyncio.run(main())
