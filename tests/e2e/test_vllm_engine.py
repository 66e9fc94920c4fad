"""The real vLLM engine on a tiny local model: generation, versioned weight loads, restart on death; the
server ends with its RaaS, even one killed with SIGKILL."""

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.settings import EngineSettings
from tests.conftest import served_half
from tests.e2e.test_chaos import running_in_group, wait_for

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
        reason="vllm not installed (make setup EXTRAS=dev,cpu)",
    ),
]


@pytest.fixture
async def engine(tiny_model_sharded, tmp_path_factory):
    """The tiny model's server, started from its shards (as a 7B checkpoint is)."""
    from astraflow.engines.vllm import VLLMEngine

    e = VLLMEngine(
        EngineSettings(type="vllm", model=tiny_model_sharded, dtype="bfloat16", chunk_tokens=8),
        log_path=tmp_path_factory.mktemp("vllm") / "server.log",
    )
    await e.start()
    yield e
    await e.close()


GREEDY = GenerateRequest([5, 17, 42, 9], SamplingParams(temperature=0.0, max_new_tokens=24, seed=0))


async def load(engine, path, version: int) -> list[int]:
    """Load `path` as `version`; the greedy tokens the engine generates then, each tagged `version`."""
    await engine.pause()
    await engine.load_weights(str(path), version)
    await engine.resume()
    out = await engine.generate(GREEDY)
    assert set(out.versions) == {version}
    return out.token_ids


async def checksums(engine) -> dict[str, str]:
    """A digest of every parameter of the served model, as the server computes it."""
    reply = await engine._ctl.post("/weight_checker", json={"action": "checksum"})
    reply.raise_for_status()
    return reply.json()["checksums"]


async def loads_from_shared_memory(engine, first: list[int], v1: str, v2: str, root) -> None:
    """Versions load through astraflow's weight-transfer engine from a double buffer as a receiver fills
    it (in a run it lies in shared memory): every parameter ends exactly as vLLM's own loader (`files`)
    sets it from the same half (of a sharded model: `files` then needs a half without the weight index),
    and greedy tokens follow the loaded weights.

    No file is opened during a load: once each half has been loaded (mapped by the workers), every file of
    both halves is made unreadable (mode 000: the weights and the config files the receiver copies beside
    them), and the next versions, written into the same halves, still load from them. A loader that
    opened a checkpoint file (vLLM's, or ours reading the file instead of its mapping) fails with a
    permission error there."""
    from astraflow.engines.vllm_weights import FileReload
    from astraflow.weights import files, layout
    from astraflow.weights.buffer import DoubleBuffer

    assert engine.transfer == "buffer"
    state1, state2 = (transformers_state(m) for m in (v1, v2))
    buffer = DoubleBuffer(root, layout.layout(state1, "bfloat16"))
    buffer.add_files(files.checkpoint_files(Path(v1)))
    a = buffer.write_state(state2)
    buffer.flip(1)
    b = buffer.write_state(state1)
    buffer.flip(2)
    loads = engine.stats["loads"]

    tokens2 = await load(engine, a.dir, 1)
    assert tokens2 != first and engine.timings["load"] > 0 and engine.timings["pause"] > 0
    mapped = await checksums(engine)
    await engine.pause()
    await FileReload(engine._control).load(str(a.dir))  # vLLM's own loader, from the file
    await engine.resume()
    assert await checksums(engine) == mapped
    assert await load(engine, b.dir, 2) == first

    for f in [*a.dir.iterdir(), *b.dir.iterdir()]:
        f.chmod(0)
    # The next versions are written into the same halves (the receiver's mapping): the workers' mappings
    # see them, no file is opened.
    assert buffer.write_state(state1) is a and buffer.flip(3) is a
    assert await load(engine, a.dir, 3) == first
    assert buffer.write_state(state2) is b and buffer.flip(4) is b
    assert await load(engine, b.dir, 4) == tokens2
    assert engine.stats["loads"] - loads == 4
    print(
        f"pause per load {engine.timings['pause'] * 1e3:.0f} ms, load {engine.timings['load'] * 1e3:.0f} ms"
    )
    buffer.close()


def transformers_state(model_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


@pytest.mark.timeout(900)
async def test_generation_load_and_restart(engine, tiny_model_v2, tiny_model, tiny_model_sharded, tmp_path):
    first = await engine.generate(GREEDY)
    assert len(first.token_ids) == len(first.logprobs) == len(first.versions) > 0
    assert set(first.versions) == {0} and all(lp <= 0 for lp in first.logprobs)
    assert (await engine.generate(GREEDY)).token_ids == first.token_ids  # greedy is deterministic
    await loads_from_shared_memory(
        engine, first.token_ids, tiny_model_sharded, tiny_model_v2, tmp_path / "shm"
    )

    sampled = await asyncio.gather(
        *[
            engine.generate(GenerateRequest([5, 17, 42, 9], SamplingParams(max_new_tokens=8, seed=s)))
            for s in range(16)
        ]
    )
    assert len({tuple(r.token_ids) for r in sampled}) > 1
    calls, sample = engine.stats["calls"], GenerateRequest([5, 17, 42, 9], SamplingParams(max_new_tokens=8))
    group = await asyncio.gather(*[engine.generate(sample) for _ in range(8)])
    assert engine.stats["calls"] == calls + 1  # a prompt group's samples: one call, a completion each
    assert len({tuple(r.token_ids) for r in group}) > 1
    assert all(len(r.logprobs) == r.versions.count(engine.version) == len(r.token_ids) > 0 for r in group)
    greedy = GenerateRequest([5, 17, 42, 9], SamplingParams(temperature=0.0, max_new_tokens=8))
    twins = await asyncio.gather(engine.generate(greedy), engine.generate(greedy))  # two calls of n=1
    assert twins[0].token_ids == twins[1].token_ids

    # The installed vLLM has the endpoints to pause requests in place: no chunks, versions from the server.
    assert engine.pause_sync and engine.stats["chunks"] == 0

    # A load in the middle of a long generation: earlier tokens the old version, later ones the new. Paused
    # on the first streamed token; the server may still have run the whole request by then (it runs ahead
    # of what the client has read), so this is tried until a load lands inside one (a few tries at most).
    long = GenerateRequest([5, 17, 42, 9], SamplingParams(temperature=0.0, max_new_tokens=500, seed=0))
    for version in range(5, 13):
        tokens, events = engine.stats["tokens"], engine.stats["events"]
        task = asyncio.create_task(engine.generate(long))
        while engine.stats["tokens"] == tokens:  # streamed: counted as they arrive
            await asyncio.sleep(0.001)
        await engine.pause()
        seen = engine.stats["tokens"] - tokens  # all received before the load: the old version's
        await engine.load_weights(tiny_model_v2, version=version)
        await engine.resume()
        during = await task
        v, n = during.versions, len(during.versions)
        k = v.index(version) if version in v else n
        assert seen <= k and set(v[:k]) == {version - 1} and set(v[k:]) <= {version}
        # Streamed one event per `engine.vllm.stream_interval` (64) tokens, the first and the last at once.
        assert engine.stats["events"] - events <= n // 64 + 3
        if k < n:  # 0 < k: its first token came before the load
            break
    else:
        pytest.fail("no load landed inside a running request")
    after = await engine.generate(GREEDY)
    assert set(after.versions) == {engine.version} and after.token_ids != first.token_ids

    # The same server as a fixed OpenAI-compatible endpoint (a judge): same tokens, no version.
    from astraflow.engines.openai import OpenAIEngine

    judge = OpenAIEngine(EngineSettings(type="openai", base_url=f"{engine.url}/v1", model="policy"))
    await judge.start()
    try:
        judged = await judge.generate(GREEDY)
        assert judged.token_ids[: len(after.token_ids)] == after.token_ids[: len(judged.token_ids)]
        assert set(judged.versions) == {-1} and await judge.healthy()
        with pytest.raises(NotImplementedError):
            await judge.load_weights(tiny_model, 2)
    finally:
        await judge.close()

    # The server dies: the engine restarts it with the weights it last loaded (v2's, not the initial ones).
    os.killpg(engine._proc.pid, signal.SIGKILL)
    again = await asyncio.wait_for(engine.generate(GREEDY), 300)
    assert again.token_ids == after.token_ids and set(again.versions) == {engine.version}
    assert engine.stats["restarts"] == 1

    # A version of a sharded model, served from a half as a receiver builds it: the first weights again; and
    # the sharded checkpoint directory itself, after other weights.
    assert await load(engine, served_half(tiny_model_sharded, tmp_path / "buffers"), 20) == first.token_ids
    assert await load(engine, tiny_model_v2, 21) == after.token_ids
    assert await load(engine, tiny_model_sharded, 22) == first.token_ids


RAAS = """
import asyncio, sys
from astraflow.engines.settings import EngineSettings
from astraflow.engines.vllm import VLLMEngine

async def main():
    settings = EngineSettings(type="vllm", model=sys.argv[1], dtype="bfloat16", chunk_tokens=8)
    engine = VLLMEngine(settings, log_path=sys.argv[2])
    await engine.start()
    print("server", engine._proc.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.timeout(600)
def test_the_vllm_server_ends_when_its_raas_is_killed(tiny_model, tmp_path):
    raas = subprocess.Popen(
        [sys.executable, "-c", RAAS, tiny_model, str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    server = None
    try:
        line = ""
        while not line.startswith("server "):  # past the engine's own log lines
            line = raas.stdout.readline()
            assert line, "the RaaS ended before its server was up"
        server = int(line.split()[1])
        assert running_in_group(server)  # the server leads its own session, with its engine processes
        raas.kill()  # SIGKILL: the RaaS's own clean-up never runs
        raas.wait()
        wait_for(lambda: not running_in_group(server), 120, "the vLLM server's session gone")
    finally:
        if raas.poll() is None:
            raas.kill()
            raas.wait()
        if server is not None and running_in_group(server):
            os.killpg(server, signal.SIGKILL)


@pytest.mark.timeout(600)
async def test_vllms_logprobs_are_the_trainers_at_the_same_weights(tiny_model, tmp_path, monkeypatch):
    """The server reports the processed distribution (after temperature, top-k, top-p) with vLLM's neutral
    sampling defaults, and the trainer scores through the same processing: at the same weights its
    proximal logprobs are the engine's to 1e-5 nats on average (2e-7 measured, float32 on both sides)."""
    from astraflow.engines.vllm import VLLMEngine
    from tests.unit.test_scored_as_sampled import proximal_gaps, sampled_group

    settings = EngineSettings(type="vllm", model=tiny_model, dtype="float32")
    engine = VLLMEngine(settings, log_path=tmp_path / "server.log")
    await engine.start()
    groups = {}
    try:
        for t, p, k in ((1.0, 1.0, 0), (0.7, 0.9, 0), (0.7, 1.0, 8)):
            params = [SamplingParams(t, p, k, max_new_tokens=12, seed=40 + i) for i in range(6)]
            groups[(t, p, k)] = await sampled_group(engine, params, [5, 17, 42])
    finally:
        await engine.close()
    for setting, group in groups.items():
        gaps = proximal_gaps(tiny_model, group, True, monkeypatch)
        assert float(gaps.mean()) < 1e-5, f"{setting}: mean |prox - behav| = {float(gaps.mean()):.3g} nats"
