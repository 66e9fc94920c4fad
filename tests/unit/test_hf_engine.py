"""The built-in hf engine: exact logprobs, real batching, seeded determinism, versioned weight loads."""

import asyncio
import contextlib

import pytest

from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.hf import HFEngine
from astraflow.engines.settings import EngineSettings

torch = pytest.importorskip("torch")
LOGPROB_TOL = 1e-4  # float32 incremental decoding vs one full forward pass


@contextlib.asynccontextmanager
async def started(tiny_model, **settings):
    e = HFEngine(EngineSettings(type="hf", model=tiny_model, **settings))
    await e.start()
    try:
        yield e
    finally:
        await e.close()


@pytest.fixture
async def engine(tiny_model):
    async with started(tiny_model, batch_window_ms=20) as e:
        yield e


def requests(n, max_new=12, **kw):
    return [
        GenerateRequest([5 + i, 17, 42 + i], SamplingParams(max_new_tokens=max_new, seed=100 + i, **kw))
        for i in range(n)
    ]


@pytest.fixture
async def idle_start(tiny_model):
    """An engine with no batching window (the default): an idle engine starts at once."""
    async with started(tiny_model, batch_window_ms=0) as e:
        yield e


def teacher_forced(model, req: GenerateRequest, resp) -> list[float]:
    """The logprobs of `resp`'s tokens from one full forward pass of prompt + completion."""
    full = torch.tensor([req.prompt_ids + resp.token_ids])
    with torch.no_grad():
        logits = model(full).logits[0].float() / (req.params.temperature or 1.0)
    logp = torch.log_softmax(logits, -1)
    p = len(req.prompt_ids)
    return [float(logp[p - 1 + j, t]) for j, t in enumerate(resp.token_ids)]


async def test_logprobs_match_a_teacher_forced_forward_pass(engine, tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for temperature in (1.0, 0.7):
        for req in requests(3, temperature=temperature):
            resp = await engine.generate(req)
            assert resp.logprobs == pytest.approx(teacher_forced(model, req, resp), abs=LOGPROB_TOL)


async def test_a_groups_samples_share_one_prefill_and_sample_as_alone(idle_start, tiny_model):
    """Two prompt groups of 4 samples in one batch: two prompts prefilled, each sample's cache its own
    (the logprobs of a full forward pass), and each seeded sample the same as when run alone."""
    from transformers import AutoModelForCausalLM

    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4]]  # different lengths: the shared prefill is left-padded
    reqs = [
        GenerateRequest(p, SamplingParams(max_new_tokens=12, seed=10 * g + i))
        for g, p in enumerate(prompts)
        for i in range(4)
    ]
    together = await asyncio.gather(*[idle_start.generate(r) for r in reqs])
    assert idle_start.stats["batches"] == 1 and idle_start.stats["prefilled"] == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for req, resp in zip(reqs, together, strict=True):
        assert resp.logprobs == pytest.approx(teacher_forced(model, req, resp), abs=LOGPROB_TOL)
    assert len({tuple(r.token_ids) for r in together[:4]}) > 1  # the samples of a group differ
    alone = [await idle_start.generate(r) for r in reqs]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


async def test_requests_that_arrive_during_a_batch_make_up_the_next_one(idle_start):
    """No batching window: groups that arrive one by one while a batch runs are generated together next."""
    engine = idle_start
    first = asyncio.create_task(
        engine.generate(GenerateRequest([7, 8, 9], SamplingParams(temperature=0.0, max_new_tokens=20)))
    )
    while engine.stats["steps"] < 1:  # the first batch runs
        await asyncio.sleep(0.001)
    await engine.pause()  # hold it mid-batch while the groups arrive, one event-loop turn apart
    group_a = [asyncio.create_task(engine.generate(r)) for r in requests(4, max_new=3)]
    await asyncio.sleep(0.01)
    group_b = [asyncio.create_task(engine.generate(r)) for r in requests(4, max_new=3)]
    await asyncio.sleep(0.01)
    await engine.resume()
    await asyncio.gather(first, *group_a, *group_b)
    assert engine.stats["batches"] == 2 and engine.stats["max_batch"] == 8


async def test_concurrent_requests_are_batched_and_equal_one_by_one(engine):
    reqs = requests(8, top_k=50, top_p=0.9)
    together = await asyncio.gather(*[engine.generate(r) for r in reqs])
    assert engine.stats["max_batch"] == 8 and engine.stats["batches"] == 1
    alone = [await engine.generate(r) for r in reqs]
    assert engine.stats["batches"] == 9
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in together}) > 1  # different seeds, different samples


async def test_stop_tokens_end_generation_and_are_kept(engine):
    [free] = requests(1, temperature=0.0)
    first = await engine.generate(free)
    assert first.finish_reason in ("length", "stop")
    stop_at = first.token_ids[2]
    stopped = await engine.generate(
        GenerateRequest(
            free.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_at,))
        )
    )
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]


async def test_load_mid_generation_tags_tokens_with_the_new_version(engine, tiny_model_v2):
    req = GenerateRequest([7, 8, 9], SamplingParams(temperature=0.0, max_new_tokens=150, seed=1))
    before = await engine.generate(req)
    steps = engine.stats["steps"]
    task = asyncio.create_task(engine.generate(req))
    while engine.stats["steps"] < steps + 5:  # some tokens of this generation exist
        await asyncio.sleep(0.001)
    await engine.pause()
    await engine.load_weights(tiny_model_v2, version=1)
    await engine.resume()
    during = await task
    k = during.versions.index(1)
    assert 0 < k and set(during.versions[:k]) == {0} and set(during.versions[k:]) == {1}
    assert during.token_ids[:k] == before.token_ids[:k]
    after = await engine.generate(req)
    assert set(after.versions) == {1} and after.token_ids != before.token_ids


async def test_load_needs_a_pause_and_matching_weights(engine, tmp_path):
    with pytest.raises(RuntimeError, match="paused"):
        await engine.load_weights(str(tmp_path), 1)
    await engine.pause()
    with pytest.raises(FileNotFoundError):
        await engine.load_weights(str(tmp_path), 1)
    await engine.resume()
    assert engine.version == 0


def test_the_device_is_the_one_engine_devices_names():
    """`engine.devices` names the hf engine's GPU as a CUDA_VISIBLE_DEVICES id, mapped to this process's
    torch index; a list, or a GPU this process does not see, is a ConfigError naming the setting."""
    from astraflow.engines.settings import gpu_index
    from astraflow.errors import ConfigError

    assert gpu_index("2", None, count=4) == 2
    assert gpu_index(" 5 ", "4,5", count=2) == 1  # the process already sees physical GPUs 4 and 5 only
    for devices, visible, count in (("0,1", None, 2), ("3", None, 2), ("0", "3", 1), ("1", "0,1", 1)):
        with pytest.raises(ConfigError, match=r"engine\.devices"):
            gpu_index(devices, visible, count)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rules for a machine without a GPU")
async def test_without_a_gpu_devices_mean_the_cpu_and_cuda_is_a_config_error(tiny_model):
    from astraflow.engines.settings import hf_device
    from astraflow.errors import ConfigError

    assert hf_device(EngineSettings(devices="1")) == "cpu"  # auto: torch sees no GPU, the CPU it is
    engine = HFEngine(EngineSettings(type="hf", model=tiny_model, device="cuda", devices="0"))
    with pytest.raises(ConfigError, match=r"engine\.device is 'cuda' but torch sees no CUDA device"):
        await engine.start()
