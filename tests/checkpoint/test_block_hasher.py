"""Block hashes of a part fed in pieces that straddle blocks (what a background save's
fenced pieces do: they are not block-aligned) equal XXH64 of each whole block: the
streaming state that replaced the staging copy hashes the same bytes."""

from __future__ import annotations

import numpy as np

from shardreplay._hashing import xxh64
from shardreplay.checkpoint.format import BLOCK_BYTES, _BlockHasher


def test_blocks_fed_in_unaligned_pieces_hash_as_whole_blocks() -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 * BLOCK_BYTES + 12_345, dtype=np.uint8).tobytes()
    hasher, at = _BlockHasher(), 0
    for n in (7, BLOCK_BYTES - 3, 100, 2 * BLOCK_BYTES, len(data)):
        hasher.feed(memoryview(data)[at:at + n])
        at += n
    want = [f"{xxh64(data[a:a + BLOCK_BYTES]):016x}" for a in range(0, len(data), BLOCK_BYTES)]
    assert hasher.finish() == want
