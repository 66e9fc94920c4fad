"""What the publisher learns of a written half in one parallel pass, and a full pull verified as its
bytes arrive: the same digests as a plain sequential pass, no NaN served, no corrupt chunk accepted."""

import random

import numpy as np
import pytest

from astraflow.errors import WeightIntegrityError
from astraflow.messages import WeightManifest
from astraflow.weights import codec, layout, scan
from astraflow.weights.verify import ChunkVerifier

CHUNK = 1 << 12


def halves(n: int = 50_000, seed: int = 0):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 0x7F00, n, dtype=np.uint16)  # finite bf16 bit patterns
    new = old.copy()
    new[rng.choice(n, n // 100, replace=False)] += 1
    return old, new


def test_one_scan_gives_the_digests_and_the_delta_of_separate_passes():
    old, new = halves()
    seen = scan.scan(new, old, "bfloat16", CHUNK)
    assert (seen.digest, seen.chunk_digests) == layout.digests_of([new.tobytes()], CHUNK)
    assert seen.nonfinite == 0
    delta = codec.encode_parts(seen.parts, len(new), 2)
    assert np.array_equal(codec.decode(delta)[0], np.flatnonzero(old != new))
    assert codec.decode(delta)[0].tolist() == codec.decode(codec.encode(old, new, 2))[0].tolist()
    target = bytearray(old.tobytes())
    codec.apply(target, delta)
    assert bytes(target) == new.tobytes()


def test_a_chunk_equal_to_the_served_one_keeps_its_digest_and_a_changed_one_is_hashed():
    old, new = halves()
    new[:] = old
    per = CHUNK // 2
    new[3 * per + 5] += 1  # only the fourth chunk changed
    kept = [f"served-{i}" for i in range(-(-len(new) // per))]
    seen = scan.scan(new, old, "bfloat16", CHUNK, old_digests=kept)
    assert seen.chunk_digests[3] == layout.chunk_digest(new[3 * per : 4 * per])
    assert seen.chunk_digests[:3] + seen.chunk_digests[4:] == kept[:3] + kept[4:]


@pytest.mark.parametrize("bits", [0x7FC0, 0x7F80, 0xFF80])  # NaN, +inf, -inf
def test_a_nan_or_inf_among_the_changed_elements_or_in_a_first_version_is_counted(bits):
    old, new = halves()
    new[123] = bits
    assert scan.scan(new, old, "bfloat16", CHUNK).nonfinite == 1
    assert scan.scan(new, None, "bfloat16", CHUNK).nonfinite == 1


def manifest_of(data: bytes) -> WeightManifest:
    whole, chunks = layout.digests(data, CHUNK)
    fields = dict(uid="m:1:x", model="m", version=1, kind="full", base_version=None, endpoints=[])
    return WeightManifest(
        **fields, nbytes=len(data), digest=whole, chunk_digests=chunks, tensors=[], incarnation="x",
        chunk_bytes=CHUNK,
    )  # fmt: skip


def arrive(verifier: ChunkVerifier, target: memoryview, data: bytes, pieces: int, seed: int) -> None:
    """Copy `data` into `target` in shuffled ranges, telling the verifier of each, as parallel pulls do."""
    cuts = sorted(random.Random(seed).sample(range(1, len(data)), pieces - 1))
    ranges = list(zip([0, *cuts], [*cuts, len(data)], strict=True))
    random.Random(seed).shuffle(ranges)
    for s, e in ranges:
        target[s:e] = data[s:e]
        verifier.arrived(s, e)


def test_bytes_verified_as_they_arrive_in_any_order_pass():
    data = halves()[1].tobytes()
    target = memoryview(bytearray(len(data)))
    verifier = ChunkVerifier(target, manifest_of(data))
    arrive(verifier, target, data, 40, seed=1)
    verifier.check()


def test_a_corrupt_chunk_is_refused_and_a_chunk_rewritten_by_a_second_source_is_verified_again():
    data = halves()[1].tobytes()
    bad = bytearray(data)
    bad[5 * CHUNK + 7] ^= 1
    target = memoryview(bytearray(len(data)))
    verifier = ChunkVerifier(target, manifest_of(data))
    arrive(verifier, target, bytes(bad), 30, seed=2)  # a source sends one flipped bit
    with pytest.raises(WeightIntegrityError, match=f"1 of .* chunks differ .*at byte {5 * CHUNK}"):
        verifier.check()
    arrive(verifier, target, data, 7, seed=3)  # the next source rewrites every byte
    verifier.check()


def test_a_manifest_that_does_not_fit_the_buffer_is_refused():
    data = halves()[1].tobytes()
    with pytest.raises(WeightIntegrityError, match="chunks of"):
        ChunkVerifier(memoryview(bytearray(len(data) + CHUNK)), manifest_of(data))
