"""LoRA versions on vLLM (`engines.vllm_lora`): new requests take the newest adapter, an older one is
unloaded once the last request generating with it ends, and the server's rank ceiling is one vLLM takes."""

from __future__ import annotations

import pytest

from astraflow.engines import vllm_lora
from astraflow.weights import adapters


@pytest.fixture
def adapter_dir(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    adapters.make_adapter_dir(tmp_path, "{}", "model.safetensors")
    return str(tmp_path)


async def test_an_adapter_in_use_is_unloaded_only_when_its_last_request_ends(adapter_dir):
    calls = []

    async def control(path, body):
        calls.append((path, body["lora_name"]))

    held = vllm_lora.Adapters(control)
    assert held.acquire() is None  # before any adapter: the base (version 0)
    await held.release(None)
    await held.load(adapter_dir, 1)
    first = held.acquire()
    await held.load(adapter_dir, 2)
    second = held.acquire()
    assert (first, second) == (1, 2)
    assert calls == [("/v1/load_lora_adapter", "v1"), ("/v1/load_lora_adapter", "v2")]  # v1 still in use
    await held.release(second)
    assert calls[-1] == ("/v1/load_lora_adapter", "v2")  # the newest stays
    await held.release(first)
    assert calls[-1] == ("/v1/unload_lora_adapter", "v1")
    assert sorted(p.name for p in held.spool.iterdir()) == ["v2"]  # v1's copy went with it
    await held.load(adapter_dir, 3)
    assert calls[-1] == ("/v1/unload_lora_adapter", "v2")  # unused: unloaded at once
    held.close()


async def test_a_directory_without_an_adapter_is_refused(tmp_path):
    async def control(path, body):
        raise AssertionError("nothing is sent")

    with pytest.raises(ValueError, match="not a LoRA adapter"):
        await vllm_lora.Adapters(control).load(str(tmp_path), 1)


def test_the_rank_ceiling_is_one_vllm_takes():
    assert vllm_lora.server_flags(4)[:3] == ["--enable-lora", "--max-lora-rank", "8"]
    assert vllm_lora.server_flags(64)[2] == "64"
    with pytest.raises(ValueError, match="above vLLM's largest"):
        vllm_lora.server_flags(1000)
