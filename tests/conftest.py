import pytest

from astraflow.streams.settings import StreamsSettings


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
