"""Episodes of agent programs: the key each one calls the endpoint with, and the record of its calls.

A key is a fresh random secret per episode, good from `open` until `close`. Every call made under it
is recorded exactly as the engine saw and produced it: the prompt's token ids as templated, the sampled
token ids with their logprobs and the weight version of each. A key that has closed is refused (the
episode counts the attempt: `late`), and a call still generating when its episode closes is not
recorded (it counts as late too): nothing reaches an episode's record after its trajectories are built.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import weakref
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from astraflow.engines.base import GenerateResponse


@dataclass(frozen=True)
class Call:
    """One completion served to an episode."""

    seq: int
    """Order of arrival within the episode."""
    model: str
    """The policy that served it."""
    prompt_ids: list[int]
    response: GenerateResponse
    tool_calls: int = 0
    """How many tool calls the response carried."""


@dataclass
class Episode:
    models: tuple[str, ...]
    """The policies this episode may call; the first serves a `model` that names none of them."""
    key: str = field(default_factory=lambda: "af-" + secrets.token_urlsafe(32), repr=False)
    calls: list[Call] = field(default_factory=list)
    ended: bool = False
    late: int = 0
    """Calls refused because the episode had ended (after or while it closed)."""
    in_flight: int = 0
    """Calls being generated: one still running when the episode ends is a call after its end."""
    _seq: itertools.count = field(default_factory=itertools.count, repr=False)

    def policy(self, model: object) -> str | None:
        """The policy a request's `model` names; the episode's only policy for any other name (a program
        written for some hosted model's name runs unchanged); None when it has several."""
        if isinstance(model, str) and model in self.models:
            return model
        return self.models[0] if len(self.models) == 1 else None

    def ticket(self) -> int:
        """A call's place in the episode, taken when it arrives; `record` or `drop` it after."""
        self.in_flight += 1
        return next(self._seq)

    def drop(self) -> None:
        """A call that produced nothing (the engine failed)."""
        self.in_flight -= 1

    def record(self, call: Call) -> bool:
        """Keep `call`; False (and counted late) when the episode has ended meanwhile."""
        self.in_flight -= 1
        if self.ended:
            self.late += 1
            return False
        self.calls.append(call)
        return True

    def ordered(self) -> list[Call]:
        return sorted(self.calls, key=lambda c: c.seq)


class Refused(Exception):
    """A request whose key opens no running episode; `str` says why, for the HTTP 401 reply."""


class Episodes:
    """The running episodes by key, and the last `remember` ended ones (to say why a late key fails; an
    ended episode is held weakly: its record goes when its workflow is done with it)."""

    def __init__(self, remember: int = 4096) -> None:
        self._live: dict[bytes, Episode] = {}
        self._ended: OrderedDict[bytes, weakref.ref[Episode]] = OrderedDict()
        self._remember = remember

    def open(self, models: Collection[str]) -> Episode:
        episode = Episode(tuple(models))
        self._live[_digest(episode.key)] = episode
        return episode

    def close(self, episode: Episode) -> None:
        """End `episode`: its key is refused from now on."""
        episode.ended = True
        digest = _digest(episode.key)
        self._live.pop(digest, None)
        self._ended[digest] = weakref.ref(episode)
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)

    def authorize(self, header: str | None) -> Episode:
        """The running episode whose key `header` (`Bearer <key>`) carries; Refused otherwise."""
        scheme, _, key = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Refused("missing bearer key: set the episode's key as the API key")
        digest = _digest(key.strip())
        episode = self._live.get(digest)
        if episode is not None:
            return episode
        if digest in self._ended:
            ended = self._ended[digest]()
            if ended is not None:
                ended.late += 1
            raise Refused("this episode has ended: its key is no longer valid")
        raise Refused("invalid key")

    @property
    def running(self) -> int:
        return len(self._live)


def _digest(key: str) -> bytes:
    """Keys are looked up by their hash, so lookups take no time that depends on how much of one matched."""
    return hmac.digest(b"astraflow-episode-key", key.encode(), hashlib.sha256)
