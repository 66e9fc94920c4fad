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
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "BLOCK", 61)  # changes decoded in blocks, each carrying on from the last
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


def reference_encode(old, new, itemsize: int) -> bytes:
    """AFD2 as first written: one pass over the whole buffers, elements compared one by one."""
    a, b = np.frombuffer(old, f"<u{itemsize}"), np.frombuffer(new, f"<u{itemsize}")
    index = np.flatnonzero(a != b)
    gaps = np.diff(index, prepend=-1) - 1
    gap_width = next(w for w in (1, 2, 4, 8) if not len(gaps) or int(gaps.max()) < 1 << (8 * w))
    diffs = (b[index] - a[index]).view(f"<i{itemsize}")
    diffs = ((diffs << 1) ^ (diffs >> (8 * itemsize - 1))).view(f"<u{itemsize}")
    planes = [gaps.astype(f"<u{gap_width}"), diffs]
    body = b"".join(p.view(np.uint8).reshape(-1, p.dtype.itemsize).T.tobytes() for p in planes)
    return codec.HEADER.pack(codec.MAGIC, itemsize, gap_width, len(b), len(index)) + zstandard.compress(body)


def body(delta: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(delta[codec.HEADER.size :])


def word_sized_changes(n: int, itemsize: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(old, new, changed mask): changes in every lane of a 64-bit word, whole words, the ragged end."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 2 ** (8 * itemsize), n, dtype=np.uint64).astype(f"<u{itemsize}")
    mask = rng.random(n) < rng.choice([0.001, 0.03, 0.5])
    lanes = 8 // itemsize
    for lane in range(lanes):  # one change in each lane position, alone in its word
        if (w := lanes * (lane + 2) + lane) < n:
            mask[w - lane : w - lane + lanes] = False
            mask[w] = True
    mask[-(n % lanes or lanes) :] = rng.random(n % lanes or lanes) < 0.5  # the tail past whole words
    new = old.copy()
    new[mask] ^= rng.integers(1, 2 ** (8 * itemsize), mask.sum(), dtype=np.uint64).astype(new.dtype)
    return old, new, mask


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 3000), st.integers(0, 2**32 - 1), st.booleans())
def test_word_compare_finds_exactly_the_changed_elements_in_any_lane_and_at_the_ragged_end(
    itemsize, n, seed, unaligned
):
    old, new, mask = word_sized_changes(n, itemsize, seed)
    if unaligned:  # views that start off a word boundary, as a slice of a bigger buffer can
        old = np.frombuffer(b"\0" + old.tobytes(), old.dtype, offset=1)
        new = np.frombuffer(b"\0" + new.tobytes(), new.dtype, offset=1)
    index, now, was = codec.compare(new, old)
    assert index.tolist() == np.flatnonzero(mask).tolist()
    assert now.tolist() == new[mask].tolist() and was.tolist() == old[mask].tolist()


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(PATTERNS), st.sampled_from([1, 2, 4, 8]), st.integers(1, 5000), st.integers(0, 2**32 - 1)
)
def test_deltas_made_stretch_by_stretch_are_the_deltas_of_one_pass(pattern, itemsize, n, seed):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 2 ** (8 * itemsize), n, dtype=np.uint64).astype(f"<u{itemsize}")
    new = old.copy()
    mask = changed_mask(pattern, n, rng)
    new[mask] ^= rng.integers(1, 2 ** (8 * itemsize), mask.sum(), dtype=np.uint64).astype(new.dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "CHUNK_ELEMENTS", 64)  # many stretches, most of them empty when sparse
        delta = codec.encode(old, new, itemsize)
    reference = reference_encode(old, new, itemsize)
    assert delta[: codec.HEADER.size] == reference[: codec.HEADER.size]  # AFD2: same header, same planes
    assert body(delta) == body(reference)


def test_gaps_wider_than_four_bytes_between_stretches_decode():
    """A stretch starting past 2^32 elements after the last change: the first gap needs 8 bytes."""
    far = (1 << 33) + 5
    first = codec.Part.of(0, np.array([3]), np.array([7], np.uint16), np.array([6], np.uint16))
    later = codec.Part.of(far, np.array([0, 2]), np.array([1, 9], np.uint16), np.array([2, 9 - 1], np.uint16))
    delta = codec.encode_parts([first, later], far + 10, 2)
    assert delta[5] == 8  # gap width
    index, diffs = codec.decode(delta)
    assert index.tolist() == [3, far, far + 2]
    assert diffs.tolist() == [1, 0xFFFF, 1]


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("with_base", [False, True])
def test_parallel_apply_patches_every_block_as_a_serial_apply_would(itemsize, with_base, monkeypatch):
    monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setattr(codec, "BLOCK", 97)  # blocks of changes decoded and patched in parallel
    rng = np.random.default_rng(itemsize)
    n = 50_000 + 3  # a last, short stretch
    old = rng.integers(0, 2 ** (8 * itemsize), n, dtype=np.uint64).astype(f"<u{itemsize}")
    new = old.copy()
    idx = rng.choice(n, n // 30, replace=False)
    new[idx] += rng.integers(1, 4, len(idx)).astype(new.dtype)
    new[[0, 999, 1000, n - 1]] ^= 1  # at stretch edges
    new[7000:9500] = old[7000:9500]  # stretches with nothing to patch, a block's long gap
    delta = codec.encode(old, new, itemsize)
    index, diffs = codec.decode(delta)
    serial = old.copy()
    with np.errstate(over="ignore"):  # modulo 2^bits, as the delta means it
        for i, d in zip(index.tolist(), diffs, strict=True):
            serial[i] += d
    target = bytearray(rng.bytes(old.nbytes)) if with_base else bytearray(old.tobytes())
    assert codec.apply(target, delta, old.tobytes() if with_base else None) == len(index)
    assert bytes(target) == serial.tobytes() == new.tobytes()


def test_a_refused_delta_with_a_base_still_leaves_the_base_copied():
    """The copy runs while the delta is decoded: a refusal waits for it, so nothing writes afterwards."""
    old = np.arange(100_000, dtype=np.uint16)
    target = bytearray(old.nbytes)
    with pytest.raises(WeightIntegrityError):
        codec.apply(target, b"XXXX" + bytes(40), old.tobytes())
    assert bytes(target) == old.tobytes()


def test_gaps_that_add_up_past_two_to_the_64_are_refused():
    """Each gap below the buffer's length, their sum wrapping round to an index inside it."""
    n, count = (1 << 62) - 1, 5
    gaps = np.full(count, (1 << 62) - 2, "<u8")
    planes = gaps.view(np.uint8).reshape(-1, 8).T.tobytes() + bytes(2 * count)
    delta = codec.HEADER.pack(codec.MAGIC, 2, 8, n, count) + zstandard.compress(planes)
    with pytest.raises(WeightIntegrityError, match="out of range"):
        codec.decode(delta)
