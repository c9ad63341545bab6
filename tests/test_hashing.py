"""The block hash: reference XXH64 vectors, any alignment and length, every flip seen."""

from __future__ import annotations

import numpy as np
import pytest

from shardreplay._hashing import xxh64

# From the xxHash reference implementation (seed 0).
VECTORS = [(b"", 0xEF46DB3751D8E999), (b"a", 0xD24EC4F1A98C6E5B), (b"abc", 0x44BC2CF5AD770999),
           (b"Nobody inspects the spammish repetition", 0xFBCEA83C8A378BF1)]


@pytest.mark.parametrize(("data", "expected"), VECTORS)
def test_reference_vectors(data: bytes, expected: int) -> None:
    assert xxh64(data) == expected
    assert xxh64(bytearray(data)) == expected and xxh64(memoryview(data)) == expected


# Hashes the compiled XXH64 of earlier releases recorded (seeded random bytes), so blocks
# that older checkpoints hashed still verify.
RECORDED = [(32, 0xAAAF00AE03CA8CBC), (100, 0x2F9B3B4EC782B7C1), (4096, 0x4CE7DFF750A45BAB)]


@pytest.mark.parametrize(("length", "expected"), RECORDED)
def test_hashes_of_earlier_releases(length: int, expected: int) -> None:
    assert xxh64(np.random.default_rng(length).bytes(length)) == expected


def test_alignment_and_buffer_kind_do_not_matter() -> None:
    raw = bytearray(np.random.default_rng(0).bytes(4096 + 64))
    for length in (0, 1, 7, 8, 31, 32, 33, 63, 64, 100, 4096):
        expected = xxh64(bytes(raw[:length]))
        for offset in range(9):
            view = memoryview(raw)[offset:offset + length]
            assert xxh64(view) == xxh64(bytes(view))
            assert xxh64(np.frombuffer(view, np.uint8).copy()) == xxh64(bytes(view))
        assert xxh64(memoryview(raw)[:length]) == expected


def test_every_single_byte_change_changes_the_hash() -> None:
    data = bytearray(np.random.default_rng(1).bytes(3000))
    base = xxh64(data)
    seen = {base}
    for i in range(len(data)):
        for flip in (0x01, 0x80, 0xFF):
            data[i] ^= flip
            h = xxh64(data)
            assert h != base, f"flip {flip:#x} at {i} not seen"
            seen.add(h)
            data[i] ^= flip
    assert len(seen) == 1 + 3 * len(data)  # no two damaged versions collide either
