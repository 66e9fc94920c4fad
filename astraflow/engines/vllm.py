"""The real engine: a vLLM OpenAI-compatible server subprocess, driven token-in/token-out.

Weight loads meet running requests in one of two ways (`engine.vllm.weight_sync`):

- pause (where the server has the endpoints, see `vllm_server.missing_for_pause`): each request is one
  streamed call to the token-in/token-out endpoint. `pause` freezes the server's requests in place
  (`/pause?mode=keep`, their KV cache kept), `load_weights` reloads from a checkpoint directory and
  relabels the server's weight version, `resume` lets them continue. The server labels every sampled
  token with the version of the weights that sampled it, so versions are exact with no re-prompting.
  Requests carry their submission version as prefix-cache salt: one submitted after a load never reuses
  KV blocks computed with older weights.
- chunks: a request is generated in chunks of `chunk_tokens`, each chunk one completion call that
  continues from the prompt plus the tokens so far. `pause` stops new chunks from starting and waits for
  the running ones, then pauses the server; after `resume` the next chunks recompute the context with
  the new weights, so every token carries exactly the version that produced it, at the cost of a
  prefill per chunk.

The mode in effect is logged at start (a warning with the reason where `auto` falls back to chunks); a
`pause` that cannot be honoured is refused (ConfigError). Loads reach the model through the `WeightLoader`
of `engine.vllm.weight_transfer`. Control calls (pause, load, resume, health) have their own small HTTP
client, so they never queue behind the generation calls, which have no cap (the RaaS bounds them).

The server (with `VLLM_SERVER_DEV_MODE=1` for the control endpoints) is restarted if it dies, reloading
the last weights, and the calls it was running are retried. This module is the engine's state and weight
sync; the calls of each mode are in `vllm_generate`, the process and its clients in `vllm_process`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import structlog

from astraflow.engines import vllm_generate, vllm_lora, vllm_process
from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse
from astraflow.engines.client import GenerationClient
from astraflow.engines.merge import Merger
from astraflow.engines.settings import EngineSettings, resolve_device
from astraflow.engines.vllm_server import planned_sync, served_sync, server_command, weight_transfer
from astraflow.engines.vllm_weights import make_weight_loader
from astraflow.errors import describe
from astraflow.redis_server import free_port

log = structlog.get_logger(__name__)


class VLLMEngine(Engine):
    @classmethod
    def create(cls, settings: EngineSettings, log_path: str | Path | None = None) -> VLLMEngine:
        return cls(settings, log_path)

    def __init__(self, settings: EngineSettings, log_path: str | Path | None = None) -> None:
        self.settings = settings
        self.version = 0
        self.log_path = Path(log_path) if log_path else None
        self.port = settings.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._weights: str | None = None
        self._open = asyncio.Event()  # set while chunks may start: not paused and the server is up
        self._idle = asyncio.Condition()
        self._running = 0
        self._paused = False
        self._closing = False
        self._watch: asyncio.Task | None = None
        self.pause_sync = False
        """Whether weight loads pause requests in place (else they land between chunks); set at start."""
        self.stats: Counter[str] = Counter()
        """`calls` (generation calls: merged requests share one), `chunks`, `tokens` (received so far),
        `events` (streamed events received), `restarts`, `loads`."""
        self.merger = Merger(settings.vllm.max_num_seqs)
        """Concurrent identical requests (a prompt group's samples) go as one call (`merge`), of at most
        the server's sequences a step (its token-in/token-out endpoint refuses more)."""
        self.timings: dict[str, float] = {}
        """Seconds of the last weight load: `load` (the loader putting the weights into the model) and
        `pause` (from `pause` to the end of `resume`: no token was produced meanwhile)."""
        self.transfer = weight_transfer(settings)
        """How loads reach the model (`engine.vllm.weight_transfer` in effect: buffer or files)."""
        self.loader = make_weight_loader(settings, self._control)
        self.adapters = vllm_lora.Adapters(self._control) if settings.vllm.max_lora_rank else None
        """LoRA: every version an adapter (`vllm_lora`); None: versions are full weights."""
        self._paused_at = 0.0

    async def start(self) -> None:
        self._open_clients()
        planned_sync(self.settings)  # refuses a weight_sync the installed vLLM cannot honour, before a spawn
        atexit.register(self._kill_group)  # an exit that skips `close` (an error at start) ends it too
        await self._spawn()
        self._watch = asyncio.create_task(self._watchdog())

    def _open_clients(self) -> None:
        """The generation client (`_http`) and the control client (`_ctl`): `vllm_process.open_clients`."""
        self._http, self._ctl = vllm_process.open_clients(self.url)

    async def _spawn(self) -> None:
        s = self.settings
        device = resolve_device(s)
        cmd, env = server_command(s, self.port, device)
        if s.devices:
            env["CUDA_VISIBLE_DEVICES"] = s.devices
        self._proc = vllm_process.spawn(cmd, env, self.log_path)
        await vllm_process.wait_healthy(self._proc, self.healthy, s.start_timeout_s, self.log_path)
        self.pause_sync = await self._sync_mode() == "pause"
        await self.loader.setup()
        if self.adapters is not None:  # a restart: the newest adapter again
            await self.adapters.restarted()
        elif self._weights is not None:  # a restart: serve the weights we had, not the initial ones
            await self.loader.load(self._weights)
        if self.pause_sync:  # the server labels tokens with this from now on
            await self._control("/update_weight_version", {"new_version": str(self.version)})
        if not self._paused:
            self._open.set()
        log.info(
            "vllm_ready",
            port=self.port,
            pid=self._proc.pid,
            version=self.version,
            device=device,
            weight_sync="pause" if self.pause_sync else "chunks",
            weight_transfer=self.transfer,
        )

    async def _sync_mode(self) -> str:
        """The weight-sync mode in effect on the running server (`pause` or `chunks`), logged: a warning
        with the reason where `auto` fell back to chunks. ConfigError where `pause` cannot be honoured."""
        openapi = {}
        if planned_sync(self.settings)[0] == "pause":
            reply = await self._ctl.get("/openapi.json")
            reply.raise_for_status()
            openapi = reply.json()
        mode, reason = served_sync(self.settings, openapi)
        requested = self.settings.vllm.weight_sync
        if reason:
            log.warning("vllm_weight_sync_fallback", mode=mode, requested=requested, reason=reason)
        else:
            log.info("vllm_weight_sync", mode=mode, requested=requested)
        return mode

    async def _watchdog(self) -> None:
        while not self._closing:
            await asyncio.sleep(1.0)
            if self._proc is not None and self._proc.poll() is not None and not self._closing:
                log.error("vllm_died", returncode=self._proc.returncode)
                self._open.clear()
                self._kill_group()
                self.stats["restarts"] += 1
                try:
                    await self._spawn()
                except Exception as e:  # keep trying: the next round sees the failed process and retries
                    log.error("vllm_restart_failed", error=describe(e))

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        self._kill_group()
        atexit.unregister(self._kill_group)
        if self.adapters is not None:
            self.adapters.close()
        await self._http.close()
        await self._ctl.aclose()

    def _kill_group(self) -> None:
        """End the server and the engine processes it spawned (`vllm_process.kill_group`)."""
        vllm_process.kill_group(self._proc)

    async def healthy(self) -> bool:
        return await vllm_process.answers(self._ctl, "/health", 2.0)

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        started = time.perf_counter()
        if self.adapters is not None:
            resp = await vllm_generate.on_adapter(self, request)
        elif self.pause_sync:
            resp = await vllm_generate.whole(self, request)
        else:
            resp = await vllm_generate.chunks(self, request)
        resp.timings["generate_s"] = time.perf_counter() - started
        resp.sampling = request.params
        return resp

    @property
    def http(self) -> GenerationClient:
        """The generation client (uncapped; control calls have their own)."""
        return self._http

    async def wait_open(self) -> int:
        """Wait until calls may start (re-checked: a pause may follow the resume that woke us); the version
        the server holds then."""
        while not self._open.is_set():
            await self._open.wait()
        return self.version

    async def server_died(self, e: Exception) -> bool:
        """After a failed call: True (after a pause) when the server is gone and the call should be retried
        on its restart, False when the error is the call's own."""
        # asked on the generation client: every failed call asks, and a pause must not wait behind them
        if self._closing or await self._http.answers("/health", 2.0):
            return False
        log.warning("vllm_call_retry", error=describe(e))  # the watchdog restarts the server
        await asyncio.sleep(1.0)
        return True

    @contextlib.asynccontextmanager
    async def chunk_running(self) -> AsyncIterator[None]:
        """Counts a chunk's call as running while it lasts: `pause` in chunks mode waits until none is."""
        self._running += 1
        try:
            yield
        finally:
            async with self._idle:
                self._running -= 1
                self._idle.notify_all()

    async def pause(self) -> None:
        self._paused_at = time.perf_counter()
        self._paused = True
        self._open.clear()
        if self.adapters is not None:  # LoRA: running requests go on with their adapter
            return
        if not self.pause_sync:  # chunks: a load lands between chunks, so wait out the running ones
            async with self._idle:
                await self._idle.wait_for(lambda: self._running == 0)
        await self._control("/pause?mode=keep")  # returns once no step is running

    async def load_weights(self, path: str, version: int) -> None:
        if not self._paused:
            raise RuntimeError("load_weights needs a paused engine")
        started = time.perf_counter()
        if self.adapters is not None:
            await self.adapters.load(path, version)
            self._weights, self.version = path, version
            self.timings["load"] = time.perf_counter() - started
            self.stats["loads"] += 1
            return
        await self.loader.load(path)
        self.timings["load"] = time.perf_counter() - started
        self.stats["loads"] += 1
        log.info(
            "vllm_weights_loaded",
            version=version,
            transfer=self.transfer,
            load_ms=round(self.timings["load"] * 1e3, 1),
        )
        if self.pause_sync:  # frozen requests hold KV blocks, so no reset: salts keep versions apart
            await self._control("/update_weight_version", {"new_version": str(version)})
        else:
            await self._control("/reset_prefix_cache")
        self._weights, self.version = path, version

    async def resume(self) -> None:
        try:
            if self.adapters is None:
                await self._control("/resume")
        finally:  # even if the server is gone: the watchdog's restart comes back unpaused
            self._paused = False
            self._open.set()
            self.timings["pause"] = time.perf_counter() - self._paused_at
            log.info("vllm_resumed", version=self.version, pause_ms=round(self.timings["pause"] * 1e3, 1))

    async def _control(self, path: str, body: dict | None = None) -> None:
        reply = await self._ctl.post(path, json=body)
        reply.raise_for_status()


ENGINE = VLLMEngine
"""What `engine.type: vllm` runs (`engines.make_engine`)."""
