"""The RaaS's OpenAI-compatible endpoint (`raas.openai_api`): `POST /v1/chat/completions` and
`POST /v1/completions`, streamed or not, served by the RaaS's own engines in its own event loop.

Every request needs the key of a running episode (`Authorization: Bearer <key>`, what the `openai`
client sends for its `api_key`); the reply to any other is 401. The request's `model` names a policy of
the episode (`Episode.policy`). A chat is templated with the policy's tokenizer (its chat template, the
request's `tools`), the engine samples from those exact token ids, and the call is recorded under the
episode (`recording`) before the reply is sent. Tool calls are read in the model's Hermes-style format
(`toolcalls`) and returned as the API's `tool_calls`.

A stream is sent once the engine has produced the turn (the engine protocol returns whole turns): the
same chunks an OpenAI server sends, then `data: [DONE]`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import structlog
from aiohttp import web

from astraflow.agents import replies, stops, toolcalls
from astraflow.agents.recording import Call, Episode, Episodes, Refused
from astraflow.agents.replies import BadRequest
from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse, SamplingParams

log = structlog.get_logger(__name__)
MAX_REQUEST_BYTES = 8 * 1024 * 1024
ENDPOINT: web.AppKey[OpenAIEndpoint] = web.AppKey("endpoint")


class OpenAIEndpoint:
    """The endpoint of one RaaS: `start` binds it, `base_url` is what an agent's client is pointed at."""

    def __init__(
        self,
        engines: Mapping[str, Engine],
        tokenizers: Mapping[str, Any],
        sampling: SamplingParams,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.engines, self.tokenizers, self.sampling = engines, tokenizers, sampling
        self.host, self.port = host, port
        self.episodes = Episodes()
        self._private = tempfile.mkdtemp(prefix="astraflow-openai-")  # 0700: the worker's user only
        self.socket_path = os.path.join(self._private, "api.sock")
        """The endpoint on a Unix socket too: what a sandboxed agent command reaches (`agent_sandbox`)."""
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.get("/v1/models", self._models),
            ]
        )
        app[ENDPOINT] = self
        self._runner = web.AppRunner(app, access_log=None)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]  # the port chosen when 0 was asked for
        await web.UnixSite(self._runner, self.socket_path).start()
        log.info("openai_api_started", url=self.base_url, models=list(self.engines))

    async def close(self) -> None:
        await self._runner.cleanup()
        shutil.rmtree(self._private, ignore_errors=True)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return await _guarded(request, self._list_models)

    async def _list_models(self, request: web.Request, episode: Episode) -> web.StreamResponse:
        data = [{"id": m, "object": "model", "owned_by": "astraflow"} for m in episode.models]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await _guarded(request, self._serve_chat)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await _guarded(request, self._serve_completion)

    async def _serve_chat(self, request: web.Request, episode: Episode) -> web.StreamResponse:
        body = await _body(request)
        model, tokenizer = self._policy(episode, body)
        tools = replies.tools(body)
        try:
            text = tokenizer.apply_chat_template(
                toolcalls.for_template(replies.messages(body)),
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as e:  # a template that rejects the conversation: the request's fault
            raise BadRequest(f"the chat template refused the messages: {e}") from None
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        seq, resp, out = await self._generate(episode, model, prompt_ids, body)
        content, calls = toolcalls.parse(out) if tools else (out, [])  # (parsing cannot raise)
        call = _record(episode, Call(seq, model, prompt_ids, resp, len(calls)))
        n, reason = (len(prompt_ids), len(call.response.token_ids)), call.response.finish_reason
        if not body.get("stream"):
            scores = _scores(tokenizer, call.response) if replies.wants_logprobs(body) else None
            return web.json_response(replies.chat(model, content, calls, reason, n, scores))
        pieces = [content] if calls else _pieces(tokenizer, call.response.token_ids, content)
        return await _stream(request, replies.chat_chunks(model, pieces, calls, reason, _usage(body, n)))

    async def _serve_completion(self, request: web.Request, episode: Episode) -> web.StreamResponse:
        body = await _body(request)
        model, tokenizer = self._policy(episode, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(type(t) is int and 0 <= t < len(tokenizer) for t in prompt)
        ):
            prompt_ids = list(prompt)
        else:
            raise BadRequest(
                "prompt: a string or a list of the policy's token ids expected (one prompt per request)"
            )
        if body.get("echo") or body.get("suffix"):
            raise BadRequest("echo and suffix are not served")
        seq, resp, text = await self._generate(episode, model, prompt_ids, body)
        call = _record(episode, Call(seq, model, prompt_ids, resp))
        n, reason = (len(prompt_ids), len(call.response.token_ids)), call.response.finish_reason
        if not body.get("stream"):
            scores = _scores(tokenizer, call.response) if replies.wants_logprobs(body) else None
            return web.json_response(replies.completion(model, text, reason, n, scores))
        pieces = _pieces(tokenizer, call.response.token_ids, text)
        return await _stream(request, replies.completion_chunks(model, pieces, reason, _usage(body, n)))

    def _policy(self, episode: Episode, body: dict[str, Any]) -> tuple[str, Any]:
        model = episode.policy(body.get("model"))
        if model is None:
            raise BadRequest(f"model: {body.get('model')!r} is none of this episode's {list(episode.models)}")
        return model, self.tokenizers[model]

    async def _generate(
        self, episode: Episode, model: str, prompt_ids: list[int], body: dict
    ) -> tuple[int, GenerateResponse, str]:
        """The call's place in `episode`, the engine's turn for `prompt_ids` (cut after a stop string)
        and its text as the client gets it."""
        params = replies.sampling(body, self.sampling)
        try:
            found = stops.stops(body)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        seq = episode.ticket()
        try:
            resp = await self.engines[model].generate(GenerateRequest(prompt_ids, params))
        except BaseException:
            episode.drop()
            raise
        tokenizer = self.tokenizers[model]
        stopped = stops.cut(tokenizer, resp.token_ids, found)
        if stopped is None:
            return seq, resp, tokenizer.decode(resp.token_ids, skip_special_tokens=True)
        k, text = stopped
        kept = GenerateResponse(
            resp.token_ids[:k], resp.logprobs[:k], resp.versions[:k], "stop", resp.timings
        )
        return seq, kept, text


def _record(episode: Episode, call: Call) -> Call:
    """Keep `call` in `episode`'s record; Refused if the episode ended while it was generated."""
    if not episode.record(call):
        raise Refused("this episode ended while the call was served: it is not recorded")
    return call


async def _guarded(request: web.Request, serve) -> web.StreamResponse:
    """Authorize the request, then serve it; refused keys get 401 and bad requests 400, in the API's
    error shape (what the `openai` client raises as AuthenticationError / BadRequestError)."""
    endpoint = request.app[ENDPOINT]
    try:
        episode = endpoint.episodes.authorize(request.headers.get("Authorization"))
        return await serve(request, episode)
    except Refused as e:
        return web.json_response(replies.error(str(e), "authentication_error"), status=401)
    except BadRequest as e:
        return web.json_response(replies.error(str(e)), status=400)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _usage(body: dict[str, Any], n: tuple[int, int]) -> tuple[int, int] | None:
    options = body.get("stream_options")
    return n if isinstance(options, dict) and options.get("include_usage") else None


def _scores(tokenizer: Any, resp: GenerateResponse) -> list[tuple[str, float]]:
    """Each sampled token's text and its sampling logprob."""
    return [(tokenizer.decode([t]), float(lp)) for t, lp in zip(resp.token_ids, resp.logprobs, strict=True)]


def _pieces(tokenizer: Any, token_ids: list[int], text: str) -> list[str]:
    """`text` (the reply's text, maybe cut at a stop string) as it grew token by token; a token that
    ends inside a character waits for the next."""
    pieces, done = [], ""
    for k in range(1, len(token_ids) + 1):
        grown = tokenizer.decode(token_ids[:k], skip_special_tokens=True)[: len(text)]
        if grown.endswith("\ufffd") and k < len(token_ids):
            continue
        if len(grown) > len(done) and grown.startswith(done):
            pieces.append(grown[len(done) :])
            done = grown
    return pieces


async def _stream(request: web.Request, events: Iterator[dict]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in events:
        await response.write(replies.sse(event))
    await response.write(replies.sse(None))
    await response.write_eof()
    return response
