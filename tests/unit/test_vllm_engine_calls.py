"""The vLLM engine's calls to its server in either weight-sync mode, against a fake server on 127.0.0.1
(no vLLM)."""

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from astraflow.engines.base import GenerateRequest, SamplingParams, WeightLoader
from astraflow.engines.settings import EngineSettings
from astraflow.engines.vllm import VLLMEngine
from astraflow.engines.vllm_server import PAUSE_SYNC_PATHS
from astraflow.errors import ConfigError
from tests.unit.test_vllm_server import install_vllm


class FakeServer:
    """Answers completions with the context length as token id; records the control calls."""

    def __init__(self) -> None:
        self.controls: list[str] = []
        self.control_bodies: list[dict | None] = []
        self.generate_bodies: list[dict] = []
        self.completion_bodies: list[dict] = []
        self.openapi: dict = {"paths": {}, "components": {"schemas": {}}}
        """What the server says it serves: no pause endpoints unless a test adds them."""
        self.engines: list[VLLMEngine] = []

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for e in self.engines:
            await e._http.close()
            await e._ctl.aclose()
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        reply = self.answer(request.path_qs, body)
        if isinstance(reply, web.Response):
            return reply
        return web.Response(text=reply) if isinstance(reply, str) else web.json_response(reply)

    def answer(self, path: str, body: dict | None) -> dict | str | web.Response:
        if path == "/v1/completions":
            self.completion_bodies.append(body)
            if body["n"] > 1 and body["temperature"] < 1e-5:  # as vLLM refuses it
                return web.Response(status=400, text="n must be 1 when using greedy sampling")
            n, start = body["max_tokens"], len(body["prompt"])
            logprobs = {"token_logprobs": [-1.0] * n}
            choices = [  # choice i's tokens count up from the context's length plus 100 i
                {
                    "index": i,
                    "token_ids": list(range(start + 100 * i, start + 100 * i + n)),
                    "logprobs": logprobs,
                }
                | {"finish_reason": "length"}
                for i in reversed(range(body["n"]))  # in any order: the index says which
            ]
            return {"choices": choices}
        if path == "/openapi.json":
            return self.openapi
        if path == "/inference/v1/generate":
            self.generate_bodies.append(body)
            if body["sampling_params"]["n"] > 1 and body["sampling_params"]["temperature"] < 1e-5:
                return web.Response(status=400, text="n must be 1 when using greedy sampling")
            spans = [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}]
            lines = []
            for last in (False, True):  # the n completions' events interleaved, choice i's tokens + 10 i
                for i in range(body["sampling_params"]["n"]):
                    t, lp = ([2, 3], [-0.2, -0.3]) if last else ([1], [-0.1])
                    choice = {"index": i, "token_ids": [x + 10 * i for x in t], "weight_versions": None}
                    choice |= {"logprobs": {"content": [{"logprob": x} for x in lp]}, "finish_reason": None}
                    if last:
                        choice |= {"finish_reason": "length", "weight_versions": spans}
                    lines.append(f"data: {json.dumps({'choices': [choice]})}\n\n")
            return "".join(lines) + "data: [DONE]\n\n"
        self.controls.append(path)
        self.control_bodies.append(body)
        return {}

    def engine(self, pause_sync: bool, **settings) -> VLLMEngine:
        """An engine on this server, its loads by `files` unless `vllm` says otherwise."""
        vllm = {"weight_transfer": "files", **settings.pop("vllm", {})}
        s = EngineSettings(type="vllm", model="m", chunk_tokens=4, port=self.port, vllm=vllm, **settings)
        e = VLLMEngine(s)
        e._open_clients()
        e.pause_sync = pause_sync
        e._open.set()  # as after a start
        self.engines.append(e)
        return e


@pytest.fixture
async def server():
    s = FakeServer()
    await s.start()
    yield s
    await s.stop()


async def test_chunked_generation_tags_each_chunk_with_the_version_it_ran_under(server):
    e = server.engine(False)
    request = GenerateRequest([0, 0], SamplingParams(max_new_tokens=10))
    first = await e.generate(request)
    assert first.token_ids == list(range(2, 12)) and e.stats["chunks"] == 3  # 4 + 4 + 2
    await e.pause()
    await e.load_weights("w", version=3)
    await e.resume()
    assert server.controls == ["/pause?mode=keep", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert set((await e.generate(request)).versions) == {3} and set(first.versions) == {0}


async def test_paused_sync_takes_versions_from_the_server_and_relabels_on_load(server):
    e = server.engine(True)
    e.version = 4
    r = await e.generate(GenerateRequest([7, 8], SamplingParams(max_new_tokens=3, seed=1)))
    assert r.token_ids == [1, 2, 3] and r.versions == [4, 5, 5] and r.logprobs == [-0.1, -0.2, -0.3]
    assert e.stats["tokens"] == 3 and e.stats["chunks"] == 0  # one call, no chunks
    body = server.generate_bodies[0]
    assert body["token_ids"] == [7, 8] and body["sampling_params"]["max_tokens"] == 3
    await e.pause()
    await e.load_weights("w", version=5)
    await e.resume()
    # No prefix-cache reset (frozen requests hold blocks): the next call gets another salt instead.
    assert server.controls == ["/pause?mode=keep", "/collective_rpc", "/update_weight_version", "/resume"]
    await e.generate(GenerateRequest([7, 8], SamplingParams(max_new_tokens=3)))
    assert server.generate_bodies[1]["cache_salt"] != body["cache_salt"]


async def test_a_load_needs_a_pause(server):
    e = server.engine(True)
    with pytest.raises(RuntimeError, match="paused"):
        await e.load_weights("w", version=1)


async def test_another_weight_loader_replaces_the_file_reload_and_the_engine_keeps_the_versions(server):
    class Received(WeightLoader):  # what a native weight transfer backend would be
        def __init__(self) -> None:
            self.loaded: list[str] = []

        async def load(self, path: str) -> None:
            self.loaded.append(path)

    e = server.engine(True)
    e.loader = Received()
    await e.pause()
    await e.load_weights("/weights/v2", version=2)
    await e.resume()
    assert e.loader.loaded == ["/weights/v2"] and e.version == 2
    assert server.controls == ["/pause?mode=keep", "/update_weight_version", "/resume"]  # no file reload


async def test_a_buffer_load_names_the_halfs_files_to_the_servers_weight_transfer_engine(
    server, tmp_path, monkeypatch
):
    install_vllm(tmp_path, monkeypatch, scale_out=True, weight_transfer=True)
    half = tmp_path / "a"
    half.mkdir()
    for name in ("model.safetensors", "config.json"):
        (half / name).write_bytes(b"")
    e = server.engine(True, vllm={"weight_transfer": "buffer"})
    await e.loader.setup()  # once per server start
    await e.pause()
    await e.load_weights(str(half), version=2)
    await e.resume()
    assert server.controls == [
        "/init_weight_transfer_engine",
        "/pause?mode=keep",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/resume",
    ]
    update = server.control_bodies[server.controls.index("/update_weights")]
    assert update == {"update_info": {"files": [str(half.resolve() / "model.safetensors")]}}
    assert e.stats["loads"] == 1 and set(e.timings) == {"load", "pause"}


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_a_native_weight_transfer_backend_is_refused_until_it_is_built(backend):
    with pytest.raises(ConfigError, match=f"weight_transfer={backend}: .* not built"):
        VLLMEngine(EngineSettings(type="vllm", model="m", vllm={"weight_transfer": backend}))


async def test_the_weight_sync_in_effect_is_logged_and_a_fallback_warns_why(server, tmp_path, monkeypatch):
    install_vllm(tmp_path, monkeypatch, scale_out=True)
    with capture_logs() as logs:
        assert await server.engine(False, vllm={"weight_sync": "auto"})._sync_mode() == "chunks"
        server.openapi = {
            "paths": {p: {} for p in PAUSE_SYNC_PATHS},
            "components": {"schemas": {"WeightVersionSpan": {}}},
        }
        assert await server.engine(False, vllm={"weight_sync": "auto"})._sync_mode() == "pause"
        assert await server.engine(False, vllm={"weight_sync": "chunks"})._sync_mode() == "chunks"
    fallback, pause, chunks = logs
    assert fallback["log_level"] == "warning" and fallback["mode"] == "chunks"
    assert "/pause" in fallback["reason"] and "weight-version spans" in fallback["reason"]
    assert (pause["log_level"], pause["mode"]) == ("info", "pause")
    assert (chunks["log_level"], chunks["mode"], chunks["requested"]) == ("info", "chunks", "chunks")


async def test_pause_is_refused_where_the_server_lacks_its_endpoints(server, tmp_path, monkeypatch):
    install_vllm(tmp_path, monkeypatch, scale_out=True)
    e = server.engine(False, vllm={"weight_sync": "pause"})
    with pytest.raises(ConfigError, match="weight_sync=pause: the vllm server lacks /inference/v1/generate"):
        await e._sync_mode()


async def test_a_start_with_pause_on_a_vllm_without_its_endpoints_fails_before_a_server_is_spawned(
    tmp_path, monkeypatch
):
    install_vllm(tmp_path, monkeypatch, scale_out=False)
    e = VLLMEngine(EngineSettings(type="vllm", model="m", vllm={"weight_sync": "pause"}))
    try:
        with pytest.raises(ConfigError, match="weight_sync=pause"):
            await e.start()
        assert e._proc is None
    finally:
        await e.close()


async def test_lora_versions_load_as_adapters_and_requests_run_whole_on_the_newest(server, tmp_path):
    from astraflow.weights import adapters

    e = server.engine(True, vllm={"max_lora_rank": 8})
    (tmp_path / "model.safetensors").write_bytes(b"")
    adapters.make_adapter_dir(tmp_path, "{}", "model.safetensors")
    request = GenerateRequest([1, 2], SamplingParams(max_new_tokens=6))
    before = await e.generate(request)
    await e.pause()
    await e.load_weights(str(tmp_path), 3)
    await e.resume()
    after = await e.generate(request)
    assert (before.versions, after.versions) == ([0] * 6, [3] * 6)  # one call each, whole
    assert [b["model"] for b in server.completion_bodies] == ["policy", "v3"]
    assert server.controls == ["/v1/load_lora_adapter"]  # no pause, no weight reload
    copy = Path(server.control_bodies[0]["lora_path"])  # its own copy: the half is rewritten later
    assert copy != tmp_path and (copy / "adapter_config.json").read_text() == "{}"
    e.adapters.close()  # (a started engine's `close` does it)


@pytest.mark.parametrize("mode", ["chunks", "pause", "lora"])
async def test_a_groups_samples_go_as_one_call_and_each_gets_its_own_completion(server, mode):
    vllm = {"max_num_seqs": 3} | ({"max_lora_rank": 8} if mode == "lora" else {})
    e = server.engine(mode == "pause", vllm=vllm)
    group = GenerateRequest([7, 8], SamplingParams(max_new_tokens=3))
    replies = await asyncio.gather(*[e.generate(group) for _ in range(4)])
    bodies = server.generate_bodies if mode == "pause" else server.completion_bodies
    n = [b.get("n") or b["sampling_params"]["n"] for b in bodies]
    assert n == [3, 1] and e.stats["calls"] == 2  # at most the server's sequences a step in one call
    # Each reply is one completion of the server's, whole (choice i: its own tokens, logprobs, versions).
    if mode == "pause":
        choices = [([1 + 10 * i, 2 + 10 * i, 3 + 10 * i], [-0.1, -0.2, -0.3], [4, 5, 5]) for i in range(3)]
    else:
        choices = [(list(range(2 + 100 * i, 5 + 100 * i)), [-1.0] * 3, [0] * 3) for i in range(3)]
    got = sorted((r.token_ids, r.logprobs, r.versions) for r in replies)
    assert got == sorted(choices + choices[:1])  # the call of one carried choice 0 again
    seeded = [GenerateRequest([7, 8], SamplingParams(max_new_tokens=3, seed=s)) for s in range(3)]
    await asyncio.gather(*[e.generate(r) for r in seeded])  # a seed names one sample: never merged
    greedy = GenerateRequest([7, 8], SamplingParams(temperature=1e-6, max_new_tokens=3))
    await asyncio.gather(*[e.generate(greedy) for _ in range(2)])  # vLLM takes one greedy sample a call
    assert [b.get("n") or b["sampling_params"]["n"] for b in bodies][2:] == [1] * 5
    if mode == "lora":
        e.adapters.close()


def test_calls_merge_only_on_equal_context_sampling_and_cap_and_never_when_seeded_or_greedy():
    from astraflow.engines.vllm_generate import merge_key

    p = SamplingParams(temperature=0.6, max_new_tokens=8, stop_token_ids=[3, 4])  # a list, as JSON gives
    key = merge_key(GenerateRequest([1, 2], p), [1, 2], 8)
    hash(key)  # raises for a key holding a list
    assert key == merge_key(GenerateRequest([1, 2], SamplingParams(0.6, stop_token_ids=(3, 4))), [1, 2], 8)
    for other in (
        merge_key(GenerateRequest([1, 2], p), [1, 2, 5], 8),  # another context
        merge_key(GenerateRequest([1, 2], p), [1, 2], 7),  # another cap
        merge_key(GenerateRequest([1, 2], SamplingParams(0.6, top_k=5, stop_token_ids=(3, 4))), [1, 2], 8),
        merge_key(GenerateRequest([1, 2], SamplingParams(0.6, stop_token_ids=(3,))), [1, 2], 8),
    ):
        assert other != key
    assert merge_key(GenerateRequest([1, 2], SamplingParams(0.6, seed=1)), [1, 2], 8) is None
    assert merge_key(GenerateRequest([1, 2], SamplingParams(0.0)), [1, 2], 8) is None
