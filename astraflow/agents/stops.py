"""Stop strings (the API's `stop`): the engines stop at tokens, so a reply is cut after generation.

The client gets the text before the first stop string (the API leaves the stop string out); the record
keeps the sampled tokens up to the one that completed it (what the policy wrote, and all it wrote that
the conversation goes on from), and the reply's finish reason is `stop`.
"""

from __future__ import annotations

from typing import Any

MAX_STOPS = 4
"""As the OpenAI API: at most four stop strings."""


def stops(body: dict[str, Any]) -> list[str]:
    """The request's stop strings; ValueError when `stop` is not a string or a list of up to four."""
    given = body.get("stop")
    if given is None:
        return []
    found = [given] if isinstance(given, str) else given
    if (
        not isinstance(found, list)
        or len(found) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in found)
    ):
        raise ValueError(f"stop: a non-empty string or a list of up to {MAX_STOPS} expected")
    return found


def cut(tokenizer: Any, token_ids: list[int], found: list[str]) -> tuple[int, str] | None:
    """(k, text): the first k tokens are the shortest prefix whose text holds a stop string, `text` that
    text before it; None when the reply holds none. "The first k tokens hold a stop string" only turns
    true as k grows: a binary search finds k in O(log n) decodes."""

    def first(k: int) -> int | None:
        text = tokenizer.decode(token_ids[:k], skip_special_tokens=True)
        at = [i for i in (text.find(s) for s in found) if i >= 0]
        return min(at) if at else None

    if not found or first(len(token_ids)) is None:
        return None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if first(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    text = tokenizer.decode(token_ids[:lo], skip_special_tokens=True)
    return lo, text[: first(lo)]
