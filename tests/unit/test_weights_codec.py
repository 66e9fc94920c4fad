"""The delta codec: exact round trips for random and adversarial change patterns, and refusal of
corrupt deltas before anything is written."""

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from astraflow.errors import WeightIntegrityError
from astraflow.weights import codec

DTYPES = {"bf16": 2, "fp32": 4}
PATTERNS = ["none", "all", "first", "last", "first_and_last", "long_gaps", "every_other", "random"]


def changed_mask(pattern: str, n: int, rng: np.random.Generator) -> np.ndarray:
    mask = np.zeros(n, bool)
    if pattern == "all":
        mask[:] = True
    elif pattern == "first":
        mask[0] = True
    elif pattern == "last":
        mask[-1] = True
    elif pattern == "first_and_last":
        mask[[0, -1]] = True
    elif pattern == "long_gaps":  # gaps far beyond one varint byte
        mask[:: max(n // 3, 1)] = True
    elif pattern == "every_other":
        mask[::2] = True
    elif pattern == "random":
        mask[rng.random(n) < rng.random()] = True
    return mask


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(PATTERNS),
    st.sampled_from(list(DTYPES)),
    st.integers(1, 50_000),
    st.integers(0, 2**32 - 1),
)
def test_round_trip(pattern, dtype, n, seed):
    rng = np.random.default_rng(seed)
    itemsize = DTYPES[dtype]
    old = rng.integers(0, 2 ** (8 * itemsize), n, dtype=np.uint64).astype(f"<u{itemsize}")
    new = old.copy()
    mask = changed_mask(pattern, n, rng)
    new[mask] ^= rng.integers(1, 2 ** (8 * itemsize), mask.sum(), dtype=np.uint64).astype(new.dtype)
    delta = codec.encode(old.tobytes(), new.tobytes(), itemsize)
    target = bytearray(old.tobytes())
    assert codec.apply(target, delta) == mask.sum()
    assert bytes(target) == new.tobytes()


def test_one_percent_of_bf16_is_over_50x_smaller_than_full():
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, 4_000_000, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(len(old), len(old) // 100, replace=False)
    new[idx] ^= 1
    delta = codec.encode(old.tobytes(), new.tobytes(), 2)
    assert len(new.tobytes()) / len(delta) > 50


def test_a_one_ulp_step_on_three_percent_of_bf16_is_over_50x_smaller_than_full():
    """What a small optimizer step does: elements move by one unit in the last place, up or down."""
    rng = np.random.default_rng(0)
    sign = rng.integers(0, 2, 4_000_000) << 15
    old = (rng.integers(0x3C00, 0x3D00, 4_000_000) | sign).astype(np.uint16)
    new = old.copy()
    idx = rng.choice(len(old), 3 * len(old) // 100, replace=False)
    new[idx] += rng.choice(np.array([1, 0xFFFF], np.uint16), len(idx))
    delta = codec.encode(old.tobytes(), new.tobytes(), 2)
    assert len(new.tobytes()) / len(delta) > 50


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d[:-1],  # truncated
        lambda d: b"XXXX" + d[4:],  # not a delta
        lambda d: d[:16] + (3).to_bytes(8, "little") + d[24:],  # more changes than the body holds
        lambda d: d[: codec.HEADER.size] + zstandard.compress(bytes(1 << 20)),  # a body bigger than said
    ],
)
def test_corrupt_deltas_are_refused_before_writing(corrupt):
    old = np.arange(100, dtype=np.uint16)
    new = old.copy()
    new[[3, 50]] = 7
    delta = corrupt(codec.encode(old.tobytes(), new.tobytes(), 2))
    target = bytearray(old.tobytes())
    with pytest.raises(WeightIntegrityError):
        codec.apply(target, delta)
    assert bytes(target) == old.tobytes()


def test_a_delta_for_another_size_is_refused():
    delta = codec.encode(bytes(10), bytes(9) + b"\x01", 2)
    with pytest.raises(WeightIntegrityError, match="for 5 elements"):
        codec.apply(bytearray(12), delta)
