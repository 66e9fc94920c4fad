import pytest

from astraflow.streams.settings import StreamsSettings


@pytest.fixture
def streams_settings() -> StreamsSettings:
    """Short durations so lease and reclaim behaviour shows within a test."""
    return StreamsSettings(lease_ms=300, block_ms=100, max_deliveries=3, trim_interval_ms=200)
