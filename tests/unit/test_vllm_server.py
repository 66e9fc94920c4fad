"""The vLLM server command line and environment for CPU and GPU, and the generate wire format (no server)."""

import importlib.util
import json
import sys
import tempfile

import pytest

from astraflow.config import Settings
from astraflow.engines import vllm_plugin
from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.settings import EngineSettings, resolve_device
from astraflow.engines.vllm_server import (
    PAUSE_SYNC_PATHS,
    SOCKET_PATH_MAX,
    GenerateStream,
    generate_body,
    missing_for_pause,
    planned_sync,
    served_sync,
    server_command,
    token_versions,
    weight_transfer,
)
from astraflow.errors import ConfigError

TUNED = {
    "model": "m",
    "dtype": "bfloat16",
    "max_model_len": 4096,
    "kv_cache_gb": 3.0,
    "vllm": {
        "gpu_memory_utilization": 0.85,
        "tensor_parallel_size": 2,
        "max_num_seqs": 128,
        "enable_prefix_caching": False,
        "extra_args": ["--max-num-batched-tokens", "8192"],
        "weight_sync": "pause",
    },
}


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def install_vllm(root, monkeypatch, scale_out: bool, weight_transfer: bool = False) -> None:
    """An installed `vllm` package, with or without the token-in/token-out server and pluggable
    weight-transfer engines, in place of the real one (if any) for this test."""
    package = root / "vllm"
    (package / "entrypoints").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if scale_out:
        (package / "entrypoints" / "scale_out" / "token_in_token_out").mkdir(parents=True)
    if weight_transfer:
        (package / "distributed" / "weight_transfer").mkdir(parents=True)
        (package / "distributed" / "weight_transfer" / "factory.py").write_text("")
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.syspath_prepend(str(root))


@pytest.fixture(autouse=True)
def no_inherited_vllm_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv(vllm_plugin.QUEUE_NAP_ENV, raising=False)


def test_a_gpu_server_gets_the_tuned_flags_and_no_cpu_settings(tmp_path, monkeypatch):
    install_vllm(tmp_path, monkeypatch, scale_out=True)
    cmd, env = server_command(EngineSettings(**TUNED), 8001, "cuda")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flag(cmd, "--port") == "8001" and flag(cmd, "--host") == "127.0.0.1"
    assert flag(cmd, "--dtype") == "bfloat16" and flag(cmd, "--max-model-len") == "4096"
    assert flag(cmd, "--gpu-memory-utilization") == "0.85"
    assert flag(cmd, "--tensor-parallel-size") == "2" and flag(cmd, "--max-num-seqs") == "128"
    assert "--no-enable-prefix-caching" in cmd and "--enable-prefix-caching" not in cmd
    assert cmd[-2:] == ["--max-num-batched-tokens", "8192"]  # last: they can override what came before
    assert "--enable-scale-out" in cmd  # weight_sync=pause needs the token-in/token-out endpoint
    assert flag(cmd, "--stream-interval") == "64"  # one event per 64 tokens, not one per token
    assert "--enforce-eager" not in cmd  # CUDA graphs on
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert vllm_plugin.QUEUE_NAP_ENV not in env  # a GPU server's processes spin as vLLM has them
    # logprobs of the distribution sampled from, with vLLM's neutral defaults (not the model's penalties)
    assert flag(cmd, "--logprobs-mode") == "processed_logprobs" and flag(cmd, "--generation-config") == "vllm"


def test_a_cpu_server_runs_eager_with_its_kv_cache_size_and_no_gpu_flags():
    settings = EngineSettings(**{**TUNED, "vllm": {**TUNED["vllm"], "weight_sync": "chunks"}})
    cmd, env = server_command(settings, 8001, "cpu")
    assert "--enforce-eager" in cmd and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env[vllm_plugin.QUEUE_NAP_ENV] == "200"  # its processes nap on their queues, not spin
    assert "--gpu-memory-utilization" not in cmd
    assert flag(cmd, "--max-num-seqs") == "128" and flag(cmd, "--dtype") == "bfloat16"
    assert "--enable-scale-out" not in cmd and "--stream-interval" not in cmd  # chunks: plain completions


def test_a_long_temporary_directory_gets_the_servers_sockets_a_short_one(monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    settings = EngineSettings(**{**TUNED, "vllm": {**TUNED["vllm"], "weight_sync": "chunks"}})
    monkeypatch.setattr(tempfile, "tempdir", "/" + "d" * (SOCKET_PATH_MAX - 37))  # + "/" + a uuid4: 1 over
    assert server_command(settings, 8001, "cpu")[1]["VLLM_RPC_BASE_PATH"] == "/tmp"
    monkeypatch.setattr(tempfile, "tempdir", "/" + "d" * (SOCKET_PATH_MAX - 38))
    assert "VLLM_RPC_BASE_PATH" not in server_command(settings, 8001, "cpu")[1]


def test_the_device_is_what_the_settings_say_unless_auto():
    assert resolve_device(EngineSettings(device="cuda")) == "cuda"
    assert resolve_device(EngineSettings(device="cpu")) == "cpu"
    torch = pytest.importorskip("torch")
    assert resolve_device(EngineSettings()) == ("cuda" if torch.cuda.is_available() else "cpu")


def test_vllm_settings_come_from_nested_env_vars(monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_ENGINE__VLLM__MAX_NUM_SEQS", "32")
    monkeypatch.setenv("ASTRAFLOW_ENGINE__VLLM__EXTRA_ARGS", '["--seed", "3"]')
    monkeypatch.setenv("ASTRAFLOW_ENGINE__DEVICE", "cuda")
    s = Settings()
    assert s.engine.vllm.max_num_seqs == 32 and s.engine.vllm.extra_args == ["--seed", "3"]
    assert s.engine.device == "cuda"
    with pytest.raises(ValueError):
        EngineSettings(vllm={"gpu_memory_utilization": 1.5})


@pytest.mark.vllm
@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_installed_vllm_server_accepts_the_command_line(device):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cmd, _ = server_command(EngineSettings(**TUNED), 8001, device)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    assert args.max_num_seqs == 128 and args.tensor_parallel_size == 2 and args.max_model_len == 4096
    assert args.enable_prefix_caching is False and args.max_num_batched_tokens == 8192
    assert args.enable_scale_out is True and args.stream_interval == 64
    assert args.logprobs_mode == "processed_logprobs" and args.generation_config == "vllm"
    assert "astraflow_buffer" in str(args.weight_transfer_config)  # the installed vLLM has the engines
    if device == "cuda":
        assert args.gpu_memory_utilization == 0.85
    else:
        assert args.enforce_eager is True


def test_versions_load_from_the_buffer_where_vllm_has_weight_transfer_engines(tmp_path, monkeypatch):
    install_vllm(tmp_path, monkeypatch, scale_out=True, weight_transfer=True)
    monkeypatch.setattr(vllm_plugin, "installed", lambda: False)
    cmd, _ = server_command(EngineSettings(), 8001, "cpu")
    assert json.loads(flag(cmd, "--weight-transfer-config")) == {"backend": "astraflow_buffer"}
    # no plugin in this environment: the workers import the engine as their extension, which registers it
    assert flag(cmd, "--worker-extension-cls") == "astraflow.engines.vllm_buffer.WorkerRegistration"
    monkeypatch.setattr(vllm_plugin, "installed", lambda: True)
    cmd, _ = server_command(EngineSettings(), 8001, "cpu")
    assert "--weight-transfer-config" in cmd and "--worker-extension-cls" not in cmd
    files = EngineSettings(vllm={"weight_transfer": "files"})
    assert (
        weight_transfer(files) == "files"
        and "--weight-transfer-config" not in server_command(files, 1, "cpu")[0]
    )


def test_an_installed_vllm_without_weight_transfer_engines_reloads_files(tmp_path, monkeypatch):
    install_vllm(tmp_path, monkeypatch, scale_out=True, weight_transfer=False)
    assert weight_transfer(EngineSettings()) == "files"
    assert "--weight-transfer-config" not in server_command(EngineSettings(), 8001, "cpu")[0]
    with pytest.raises(
        ConfigError, match="weight_transfer=buffer: the installed vllm has no weight-transfer"
    ):
        server_command(EngineSettings(vllm={"weight_transfer": "buffer"}), 8001, "cpu")


def test_pause_sync_needs_every_endpoint_and_version_spans():
    paths = {p: {} for p in PAUSE_SYNC_PATHS}
    schema = {"paths": paths, "components": {"schemas": {"WeightVersionSpan": {}}}}
    assert missing_for_pause(schema) == []
    older = {**schema, "components": {"schemas": {}}}  # a generate reply without version spans
    assert missing_for_pause(older) == ["weight-version spans"]
    del paths["/update_weight_version"]
    assert missing_for_pause(schema) == ["/update_weight_version"]


def test_an_installed_vllm_without_the_pause_endpoints_refuses_pause_and_auto_says_why(tmp_path, monkeypatch):
    install_vllm(tmp_path, monkeypatch, scale_out=False)
    pause = EngineSettings(vllm={"weight_sync": "pause"})
    with pytest.raises(ConfigError, match=r"^engine.vllm.weight_sync=pause: the installed vllm has no"):
        planned_sync(pause)
    with pytest.raises(ConfigError):  # before any server is started
        server_command(pause, 8001, "cpu")
    mode, reason = planned_sync(EngineSettings(vllm={"weight_sync": "auto"}))
    assert mode == "chunks" and "token-in/token-out" in reason
    assert planned_sync(EngineSettings(vllm={"weight_sync": "chunks"})) == ("chunks", "")


def test_a_server_without_the_pause_endpoints_refuses_pause_and_auto_says_why(tmp_path, monkeypatch):
    install_vllm(tmp_path, monkeypatch, scale_out=True)
    full = {"paths": {p: {} for p in PAUSE_SYNC_PATHS}, "components": {"schemas": {"WeightVersionSpan": {}}}}
    assert served_sync(EngineSettings(vllm={"weight_sync": "pause"}), full) == ("pause", "")
    assert served_sync(EngineSettings(vllm={"weight_sync": "auto"}), full) == ("pause", "")
    mode, reason = served_sync(EngineSettings(vllm={"weight_sync": "auto"}), {})
    assert mode == "chunks" and reason.startswith("the vllm server lacks /inference/v1/generate")
    with pytest.raises(ConfigError, match="weight_sync=pause: the vllm server lacks"):
        served_sync(EngineSettings(vllm={"weight_sync": "pause"}), {})


def sse(choice: dict) -> str:
    base = {"index": 0, "finish_reason": None, "weight_versions": None, "logprobs": None}
    return "data: " + json.dumps({"choices": [{**base, **choice}]})


def lp(*tokens):
    return {"content": [{"token_id": t, "logprob": -0.5, "top_logprobs": []} for t in tokens]}


def test_a_streamed_generation_takes_each_tokens_version_from_the_servers_spans():
    stream = GenerateStream()
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    lines = [
        sse({"token_ids": [7, 8], "logprobs": lp(7, 8)}),
        "",
        sse({"token_ids": [9], "logprobs": lp(9), "finish_reason": "length", "weight_versions": spans}),
        "data: [DONE]",
    ]
    assert [stream.feed(line) for line in lines] == [2, 0, 1, 0]
    (r,) = stream.responses()
    assert r.token_ids == [7, 8, 9] and r.versions == [3, 3, 4] and r.finish_reason == "length"
    assert r.logprobs == [-0.5] * 3


def test_a_generation_that_did_not_end_normally_or_is_not_fully_labelled_raises():
    aborted = GenerateStream()
    aborted.feed(sse({"token_ids": [], "finish_reason": "abort", "weight_versions": []}))
    with pytest.raises(RuntimeError, match="abort"):
        aborted.responses()
    with pytest.raises(ValueError, match="cover 2 of 3"):
        token_versions([{"version": "0", "start": 0, "end": 2}], 3)
    with pytest.raises(ValueError, match="gap"):
        token_versions([{"version": "0", "start": 1, "end": 3}], 3)


def test_a_generate_call_salts_the_prefix_cache_with_the_version_it_starts_under():
    request = GenerateRequest([1, 2], SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(0,)))
    a, b = generate_body(request, 5, 0), generate_body(request, 5, 1)
    assert a["token_ids"] == [1, 2] and a["stream"] and a["sampling_params"]["stop_token_ids"] == [0]
    assert a["cache_salt"] != b["cache_salt"]
