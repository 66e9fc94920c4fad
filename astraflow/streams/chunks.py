"""Requests sized to what Redis accepts: a call with many entries goes as several, each within
`streams.max_call_args` arguments and `streams.max_call_bytes` bytes.

Redis refuses a request past its own limits by closing the connection (Redis 6.2: more than 1,048,576
arguments; any version: past `client-query-buffer-limit`), which a client cannot tell from an outage.
Chunks keep every call under them; an entry is never split, so whatever a call promises per entry (one
atomic hand-off, dedup) holds per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

ARG_OVERHEAD_BYTES = 16
"""What one argument adds to a request besides its bytes (RESP's `$<length>` line and CRLFs)."""
CALL_ARGS, CALL_BYTES = 32, 4096
"""Room left in every chunk for the call's own arguments (command, script, fixed keys and arguments)."""


def arg_bytes(args: Iterable[bytes | str | int]) -> int:
    """Bytes that `args` take in a request, as `chunked` counts them."""
    return sum(len(a if isinstance(a, bytes | str) else str(a)) + ARG_OVERHEAD_BYTES for a in args)


def chunked(
    items: Iterable[T], cost: Callable[[T], tuple[int, int]], max_args: int, max_bytes: int
) -> Iterator[list[T]]:
    """`items` in order, in runs whose `cost`s ((arguments, bytes) per item) and the call's own
    (CALL_ARGS, CALL_BYTES) sum to at most `max_args` and `max_bytes`; an item over either limit by
    itself is a run of its own (items are never split)."""
    max_args, max_bytes = max_args - CALL_ARGS, max_bytes - CALL_BYTES
    chunk: list[T] = []
    n_args = n_bytes = 0
    for item in items:
        a, b = cost(item)
        if chunk and (n_args + a > max_args or n_bytes + b > max_bytes):
            yield chunk
            chunk, n_args, n_bytes = [], 0, 0
        chunk.append(item)
        n_args, n_bytes = n_args + a, n_bytes + b
    if chunk:
        yield chunk
