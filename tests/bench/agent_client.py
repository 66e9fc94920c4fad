"""An agent program's OpenAI client, per episode: CPU per episode with the TLS context built once, against
a client built from scratch for each episode.

A RaaS running a function agent (`workflow_options.agent`) hands every episode an `openai.AsyncOpenAI`
with the episode's key. Building one from scratch loads the CA bundle into a new TLS context (httpx does
it for every client, though the endpoint is plain HTTP on loopback). The server here is a stand-in for the
RaaS's endpoint in a process of its own: it answers each chat call after `--delay-ms`. Each episode makes
`--turns` chat calls, at most `--in-flight` episodes run at once, and the client process's CPU time is
what counts. Clients:

- `shared tls`: what the RaaS hands the program (`astraflow.agents.programs.FunctionAgent`): a client and
  connection pool per episode, one TLS context for all;
- `per episode`: `AsyncOpenAI(base_url=..., api_key=...)` built for each episode, as a user would write
  it, and as the RaaS did before (baseline).

Rounds alternate between the clients; medians are shown. At 128 in flight the baseline can fail: the
128 clients built at once hold the event loop for seconds, past httpx's 5 s connect timeout.

    python tests/bench/agent_client.py [--episodes 400] [--in-flight 64] [--turns 2] [--delay-ms 20]
                                      [--rounds 3] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from _smoke import parse
from _stand_in import alternate, fan_out

from astraflow.agents.programs import FunctionAgent

REPLY = {
    "id": "c",
    "object": "chat.completion",
    "created": 0,
    "model": "policy",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "42"}, "finish_reason": "stop"}],
}
SAMPLE = {"prompt": "123*45="}


def episode(turns: int):
    async def solve(client, sample: dict) -> float:
        messages = [{"role": "user", "content": sample["prompt"]}]
        for _ in range(turns):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert len(messages) == 1 + turns and messages[-1]["content"] == "42"
        return 1.0

    return solve


async def shared_tls(url: str, episodes: int, in_flight: int, turns: int) -> None:
    agent = FunctionAgent(episode(turns))
    await fan_out(lambda: agent.run(url + "/v1", "key", SAMPLE), episodes, in_flight)


async def per_episode(url: str, episodes: int, in_flight: int, turns: int) -> None:
    from openai import AsyncOpenAI

    solve = episode(turns)

    async def one() -> float:
        async with AsyncOpenAI(base_url=url + "/v1", api_key="key", max_retries=0) as client:
            return await solve(client, SAMPLE)

    await fan_out(one, episodes, in_flight)


CLIENTS = {"shared tls": shared_tls, "per episode": per_episode}


def measure(name: str, url: str, a: argparse.Namespace) -> float:
    """Client CPU per episode in ms, one round."""
    cpu = time.process_time()
    asyncio.run(CLIENTS[name](url, a.episodes, a.in_flight, a.turns))
    return (time.process_time() - cpu) / a.episodes * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=400)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    a = parse(p, episodes=40, in_flight=16, rounds=1)
    results = alternate(
        "/v1/chat/completions",
        REPLY,
        a.delay_ms / 1000,
        list(CLIENTS),
        lambda name, url: measure(name, url, a),
        a.rounds,
    )
    print(f"{a.episodes} episodes of {a.turns} calls, {a.in_flight} in flight, medians of {a.rounds} rounds")
    cpu = {name: statistics.median(rows) for name, rows in results.items()}
    for name, ms in cpu.items():
        print(f"{name:<12} {ms:>8.2f} ms cpu per episode")
    print(
        f"agent client: per-episode/shared tls cpu per episode {cpu['per episode'] / cpu['shared tls']:.2f}x "
        f"at {a.in_flight} in flight"
    )


if __name__ == "__main__":
    main()
