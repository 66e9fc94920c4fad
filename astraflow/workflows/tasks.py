"""Built-in synthetic tasks with verifiable answers, small enough for a tiny model to learn on a CPU."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    name: str
    sample: Callable[[random.Random], dict[str, Any]]
    """One dataset row: `prompt`, `answer` and whatever its reward reads."""
    reward: str
    """Name of the registered reward that scores it."""
    max_new_tokens: int


def _addition(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randrange(100), rng.randrange(100)
    return {"prompt": f"{a:02d}+{b:02d}=", "answer": str(a + b)}


def _reverse(rng: random.Random) -> dict[str, Any]:
    word = "".join(rng.choice("abcdef") for _ in range(rng.randint(3, 5)))
    return {"prompt": f"{word}>", "answer": word[::-1]}


TASKS: dict[str, Task] = {
    "addition": Task("addition", _addition, reward="exact_match", max_new_tokens=4),
    "reverse": Task("reverse", _reverse, reward="exact_match", max_new_tokens=6),
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task: {name!r} (built in: {', '.join(TASKS)})") from None


def rows(task: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows of `task`, the same for the same seed."""
    rng = random.Random(seed)
    t = get_task(task)
    return [t.sample(rng) for _ in range(n)]
