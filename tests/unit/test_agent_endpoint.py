"""The OpenAI-compatible endpoint and the `agent` workflow with the official `openai` client, a
scripted engine standing in for the model (its replies, and so the episode's tokens, are known)."""

import asyncio
import json
import math

import pytest

from astraflow.agents import toolcalls
from astraflow.agents.server import OpenAIEndpoint
from astraflow.engines.base import SamplingParams
from astraflow.workflows.api import WorkflowContext, resolve_workflow
from tests.unit.test_workflows import Scripted

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    from astraflow import tiny

    return tiny.build_char_tokenizer(tiny.AGENT_VOCAB)


@pytest.fixture
async def served(tokenizer):
    """(endpoint, engine): the endpoint started on a free port over a scripted engine."""
    engine = Scripted(tokenizer, [])
    endpoint = OpenAIEndpoint({"policy": engine}, {"policy": tokenizer}, SamplingParams(max_new_tokens=16))
    await endpoint.start()
    yield endpoint, engine
    await endpoint.close()


def flow(endpoint, tokenizer, **options):
    ctx = WorkflowContext({"policy": tokenizer}, SamplingParams(max_new_tokens=16), None, options, endpoint)
    return resolve_workflow("agent")(ctx)


def test_hermes_tool_calls_are_parsed_and_malformed_ones_stay_text():
    text, calls = toolcalls.parse(f"ok {CALL}{CALL}")
    assert (
        text == "ok"
        and [(c.name, json.loads(c.arguments)) for c in calls]
        == [("calculator", {"expression": "12*34"})] * 2
    )
    assert calls[0].id != calls[1].id
    bad = "<tool_call>{not json}</tool_call>"
    assert toolcalls.parse(bad) == (bad, [])
    sent = [{"role": "assistant", "tool_calls": [c.openai() for c in calls[:1]]}]
    assert toolcalls.for_template(sent)[0]["tool_calls"][0]["function"]["arguments"] == {
        "expression": "12*34"
    }


async def test_the_calculator_agent_trains_on_its_turns_not_on_the_tool_output(served, tokenizer):
    endpoint, engine = served
    engine.replies = [CALL, "408"]
    result = await flow(endpoint, tokenizer, agent="astraflow.workflows.calculator_agent:solve").run_episode(
        {"policy": engine}, {"prompt": "12*34=", "answer": "408"}
    )
    [traj] = result.trajectories  # the second prompt extends the first turn: one trajectory
    assert_calculator_episode(traj, engine, tokenizer)


def assert_calculator_episode(traj, engine, tokenizer):
    """`traj` is the tool call turn, the tool's reply (not trained on, no version), the answer `408`."""
    assert traj.reward == 1.0 and traj.error is None and traj.metrics == {"tool_call": 1.0, "calls": 2.0}
    first, second = engine.prompts
    turn = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    assert second[: len(first) + len(turn)] == first + turn
    observed = len(second) - len(first) - len(turn)
    answer = len(tokenizer.encode("408")) + 1
    assert traj.loss_mask.tolist() == [0] * len(first) + [1] * len(turn) + [0] * observed + [1] * answer
    assert set(traj.versions[traj.loss_mask == 1].tolist()) == {3}
    assert set(traj.versions[traj.loss_mask == 0].tolist()) == {-1}
    assert "<tool_response>408</tool_response>" in tokenizer.decode(second[len(first) + len(turn) :])


async def test_a_wrong_or_ended_key_is_refused(served, tokenizer):
    endpoint, engine = served
    engine.replies = ["1", "2"]
    episode = endpoint.episodes.open(["policy"])
    kw = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="af-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(**kw)
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=episode.key, max_retries=0) as good:
        assert (await good.chat.completions.create(**kw)).choices[0].message.content == "1"
        endpoint.episodes.close(episode)
        with pytest.raises(openai.AuthenticationError, match="ended"):
            await good.chat.completions.create(**kw)
    assert episode.late == 1 and len(episode.calls) == 1


async def _no_call(client, sample):
    return 1.0


async def _slow(client, sample):
    await client.completions.create(model="policy", prompt="1")
    await asyncio.sleep(30)


async def _nan(client, sample):
    await client.completions.create(model="policy", prompt="1")
    return math.nan


async def _raises(client, sample):
    await client.completions.create(model="policy", prompt="1")
    raise RuntimeError("boom")


async def _late(client, sample):
    await client.completions.create(model="policy", prompt="1")
    own = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    asyncio.get_running_loop().call_later(0.05, lambda: _LEFT.append(asyncio.ensure_future(_call_again(own))))
    return 1.0


_LEFT = []


async def _call_again(client):
    async with client:
        with pytest.raises(openai.AuthenticationError, match="ended"):
            await client.completions.create(model="policy", prompt="1")


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        ("_no_call", "made no call"),
        ("_slow", "timeout_s"),
        ("_nan", "not a finite number"),
        ("_raises", "RuntimeError: boom"),
    ],
)
async def test_a_failing_program_is_a_scored_failure_with_its_reason(served, tokenizer, agent, reason):
    endpoint, engine = served
    engine.replies = ["1", "2"]
    f = flow(endpoint, tokenizer, agent=f"{__name__}:{agent}", timeout_s=0.5)
    result = await f.run_episode({"policy": engine}, {"prompt": "1", "answer": "1"})
    assert result.trajectories and all(reason in t.error and t.reward == 0.0 for t in result.trajectories)
    assert endpoint.episodes.running == 0


async def test_a_call_after_the_episode_ended_is_refused_and_not_recorded(served, tokenizer):
    endpoint, engine = served
    engine.replies = ["1", "2"]
    f = flow(endpoint, tokenizer, agent=f"{__name__}:_late")
    result = await f.run_episode({"policy": engine}, {"prompt": "1", "answer": "1"})
    await asyncio.sleep(0.2)
    await _LEFT.pop()
    [traj] = result.trajectories
    assert len(engine.prompts) == 1 and traj.error is None  # refused (401) after the result was made


class Slow(Scripted):
    async def generate(self, request):
        await asyncio.sleep(0.5)
        return await super().generate(request)


async def _left_in_flight(client, sample):
    await client.completions.create(model="policy", prompt="1")
    _LEFT.append(asyncio.ensure_future(client.completions.create(model="policy", prompt="2")))
    await asyncio.sleep(0.2)  # the call has reached the engine
    return 1.0


async def test_a_call_still_running_when_the_program_returns_fails_the_episode(tokenizer):
    engine = Slow(tokenizer, ["1", "2"])
    endpoint = OpenAIEndpoint({"policy": engine}, {"policy": tokenizer}, SamplingParams(max_new_tokens=16))
    await endpoint.start()
    try:
        f = flow(endpoint, tokenizer, agent=f"{__name__}:_left_in_flight")
        result = await f.run_episode({"policy": engine}, {"prompt": "1", "answer": "1"})
        [traj] = result.trajectories
        assert "after its episode ended" in traj.error and traj.reward == 0.0
        with pytest.raises(openai.APIConnectionError):  # its client was closed with the episode
            await _LEFT.pop()
    finally:
        await endpoint.close()


async def test_streamed_chat_carries_the_text_and_the_tool_calls(served, tokenizer):
    endpoint, engine = served
    engine.replies = ["408", CALL]
    episode = endpoint.episodes.open(["policy"])
    messages = [{"role": "user", "content": "12*34="}]
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=episode.key, max_retries=0) as client:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="policy", messages=messages, stream=True
            )
        ]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "408"
        assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
        stream = await client.chat.completions.create(
            model="any-hosted-model",
            messages=messages,
            tools=[{"type": "function", "function": {"name": "calculator"}}],
            stream=True,
        )
        chunks = [c async for c in stream]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in calls] == [
        ("calculator", '{"expression": "12*34"}')
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [c.tool_calls for c in episode.ordered()] == [0, 1]


async def _answers(client, sample):
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": sample["prompt"]}]
    )


async def test_a_verifier_scores_the_last_reply_instead_of_the_program(served, tokenizer):
    from astraflow.workflows.rewards import RewardRunner

    endpoint, engine = served
    engine.replies = ["408", "407"]
    runner = RewardRunner(processes=1, timeout_s=20)
    try:
        ctx = WorkflowContext(
            {"policy": tokenizer},
            SamplingParams(),
            runner,
            {"agent": f"{__name__}:_answers", "reward": "exact_match"},
            endpoint,
        )
        f = resolve_workflow("agent")(ctx)
        got = [
            (await f.run_episode({"policy": engine}, {"prompt": "12*34=", "answer": "408"})).trajectories[0]
            for _ in "ab"
        ]
    finally:
        runner.close()
    assert [(t.reward, t.error) for t in got] == [(1.0, None), (0.0, None)]


async def test_a_stop_string_cuts_the_reply_and_the_record(served, tokenizer):
    endpoint, engine = served
    engine.replies = ["408|12*3", "408|12*3"]
    episode = endpoint.episodes.open(["policy"])
    kw = {"model": "policy", "prompt": "12*34=", "stop": ["|", "**"]}
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=episode.key, max_retries=0) as client:
        reply = (await client.completions.create(**kw)).choices[0]
        streamed = [c.choices[0].text async for c in await client.completions.create(stream=True, **kw)]
        with pytest.raises(openai.BadRequestError, match="stop"):
            await client.completions.create(**{**kw, "stop": ["a", "b", "c", "d", "e"]})
    assert (reply.text, reply.finish_reason, "".join(streamed)) == ("408", "stop", "408")
    for call in episode.ordered():
        assert tokenizer.decode(call.response.token_ids) == "408|" and call.response.finish_reason == "stop"


async def test_logprobs_are_the_sampling_logprobs_of_the_reply(served, tokenizer):
    endpoint, engine = served
    engine.replies = ["408", "408"]
    episode = endpoint.episodes.open(["policy"])
    messages = [{"role": "user", "content": "12*34="}]
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=episode.key, max_retries=0) as client:
        chat = await client.chat.completions.create(model="policy", messages=messages, logprobs=True)
        text = await client.completions.create(model="policy", prompt="12*34=", logprobs=0)
    assert [(t.token, t.logprob) for t in chat.choices[0].logprobs.content] == [
        ("4", -0.5),
        ("0", -0.5),
        ("8", -0.5),
        ("<|im_end|>", -0.5),
    ]
    assert text.choices[0].logprobs.token_logprobs == [-0.5] * 4
