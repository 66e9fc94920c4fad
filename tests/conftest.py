from pathlib import Path

import pytest

from astraflow.streams.settings import StreamsSettings
from tests.redis7 import INSTALL, NO_REDIS7

NO_REDIS7_STAT = "skipped: no redis-server 7"


def pytest_terminal_summary(terminalreporter):
    """The tests skipped for want of a system redis-server (`tests.redis7`) in one line naming what to
    install, instead of one `SKIPPED` line each; the final count shows them as
    `skipped: no redis-server 7`."""
    skipped = terminalreporter.stats.get("skipped", [])
    missing = [r for r in skipped if isinstance(r.longrepr, tuple) and NO_REDIS7 in r.longrepr[2]]
    if not missing:
        return
    terminalreporter.stats["skipped"] = [r for r in skipped if r not in missing]
    terminalreporter.stats[NO_REDIS7_STAT] = missing
    terminalreporter.write_line(f"{len(missing)} tests skipped: {NO_REDIS7} ({INSTALL})", yellow=True)


@pytest.fixture(autouse=True)
def _logging_restored():
    """A test that configures structlog (`launcher.main` does: warnings only) leaves the next test the
    configuration it found, so `capture_logs` there still sees every level."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def streams_settings() -> StreamsSettings:
    """Short durations so lease and reclaim behaviour shows within a test."""
    return StreamsSettings(lease_ms=300, block_ms=100, max_deliveries=3, trim_interval_ms=200)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A small random Qwen2 model directory (built locally, deterministic)."""
    pytest.importorskip("torch")
    from astraflow import tiny

    return str(
        tiny.build(
            tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128
        )
    )


@pytest.fixture(scope="session")
def tiny_model_v2(tmp_path_factory, tiny_model):
    """The same architecture with other weights (a different seed): a 'new version' to load."""
    from astraflow import tiny

    return str(
        tiny.build(
            tmp_path_factory.mktemp("tiny-v2"),
            hidden=64,
            layers=2,
            heads=2,
            kv_heads=1,
            intermediate=128,
            seed=1,
        )
    )


@pytest.fixture(scope="session")
def tiny_model_sharded(tmp_path_factory, tiny_model):
    """`tiny_model` saved in shards, as a 7B checkpoint is: `model.safetensors.index.json` and its shards
    beside the config and tokenizer files."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny-sharded")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="60KB")
    for f in Path(tiny_model).iterdir():
        if not (out / f.name).exists() and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out / f.name)
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 2
    return str(out)


def served_half(model_dir: str, root: Path) -> Path:
    """The directory an engine loads a version from: a half of the double buffer holding the model's
    weights in bf16, with the files a receiver copies beside them."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.weights import files, layout
    from astraflow.weights.buffer import DoubleBuffer

    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    buffer = DoubleBuffer(root, layout.layout(state, "bfloat16"))
    buffer.add_files(files.checkpoint_files(Path(model_dir)))
    return buffer.write_state(state).dir
