"""What an agent episode records is what its program was served: for every call, the completion's token
ids decode to exactly the text the client received, and the prompt's ids are the policy tokenizer's
template of the messages (and tools) the client sent. The real engine (hf) on a tiny random model."""

import itertools

import pytest

from astraflow.engines.base import SamplingParams
from astraflow.workflows.api import WorkflowContext, resolve_workflow
from astraflow.workflows.calculator import TOOL

openai = pytest.importorskip("openai")
pytest.importorskip("torch")
pytestmark = pytest.mark.slow

SENT = []
"""(kind, what the client sent, the text it received) per call, in order."""


async def chatter(client, sample):
    """Three chat turns (tools offered, the reply fed back with a user message), streamed once, and a
    plain completion."""
    messages = [{"role": "user", "content": sample["prompt"]}]
    for turn in range(3):
        kw = {"model": "policy", "messages": list(messages), "tools": [TOOL], "seed": turn}
        if turn == 1:
            stream = await client.chat.completions.create(stream=True, **kw)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            reply = (await client.chat.completions.create(**kw)).choices[0].message
            assert not reply.tool_calls  # (a random model writes no well-formed call)
            text = reply.content or ""
        SENT.append(("chat", kw, text))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "1+1="}]
    reply = await client.completions.create(model="policy", prompt="12*34=", max_tokens=8)
    SENT.append(("text", "12*34=", reply.choices[0].text))
    return 1.0


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    from astraflow import tiny

    return tiny.build(tmp_path_factory.mktemp("agent"), tokenizer_kind="char_agent", hidden=64, layers=2)


async def test_recorded_tokens_are_what_the_client_sent_and_received(agent_model):
    from transformers import AutoTokenizer

    from astraflow.agents.server import OpenAIEndpoint
    from astraflow.engines.hf import HFEngine
    from astraflow.engines.settings import EngineSettings

    tok = AutoTokenizer.from_pretrained(agent_model)
    engine = HFEngine(EngineSettings(type="hf", model=str(agent_model), max_model_len=256, threads=1))
    await engine.start()
    sampling = SamplingParams(max_new_tokens=12)
    endpoint = OpenAIEndpoint({"policy": engine}, {"policy": tok}, sampling)
    await endpoint.start()
    try:
        ctx = WorkflowContext({"policy": tok}, sampling, None, {"agent": f"{__name__}:chatter"}, endpoint)
        flow = resolve_workflow("agent")(ctx)
        SENT.clear()
        opened, open_episode = [], endpoint.episodes.open
        endpoint.episodes.open = lambda models: opened.append(open_episode(models)) or opened[-1]
        result = await flow.run_episode({"policy": engine}, {"prompt": "12*34=", "answer": "408"})
        [episode] = opened
    finally:
        await endpoint.close()
        await engine.close()
    calls = episode.ordered()
    assert len(calls) == len(SENT) == 4 and all(t.error is None for t in result.trajectories)
    for call, (kind, sent, received) in zip(calls, SENT, strict=True):
        assert tok.decode(call.response.token_ids, skip_special_tokens=True) == received
        if kind == "chat":
            text = tok.apply_chat_template(
                sent["messages"], tools=sent["tools"], add_generation_prompt=True, tokenize=False
            )
        else:
            text = sent
        assert call.prompt_ids == tok.encode(text, add_special_tokens=False)
        assert len(call.response.logprobs) == len(call.response.versions) == len(call.response.token_ids)
        assert all(lp <= 0 for lp in call.response.logprobs) and set(call.response.versions) == {0}
    # Every sampled token is trained on once; a call whose prompt extends the previous call's prompt and
    # completion joins its trajectory (a turn whose text held a special token the client never saw does
    # not: its history, re-templated, differs), the completion call starts its own.
    joins = [
        b.prompt_ids[: len(a.prompt_ids) + len(a.response.token_ids)] == a.prompt_ids + a.response.token_ids
        for a, b in itertools.pairwise(calls)
    ]
    assert not joins[-1] and len(result.trajectories) == 1 + joins.count(False)
    trained = sum(int(t.loss_mask.sum()) for t in result.trajectories)
    assert trained == sum(len(c.response.token_ids) for c in calls)
