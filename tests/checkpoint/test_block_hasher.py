"""Block hashes of a part fed in pieces that straddle blocks (what a background save's
fenced pieces do: they are not block-aligned).

Two observable properties: the hashes equal XXH64 of each ``BLOCK_BYTES`` block of the
file as written, for piece boundaries at every alignment against the blocks; and the
straddling pieces are hashed in place, never gathered into a block-sized copy (the
staging ``bytearray`` the streaming state replaced held the GIL for each copy, stalling
the learner during background saves): the hasher's and ``write_part``'s traced
allocations stay far below one block, let alone one piece.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from shardreplay._hashing import BlockHasher, xxh64
from shardreplay.checkpoint.format import BLOCK_BYTES, write_part

B = BLOCK_BYTES
# Piece lengths putting boundaries before, at and after block edges, inside a block and
# several blocks apart: every alignment of a piece's start and end against the blocks.
SIZES = [[7, B - 3, 100, 2 * B, B], [B, B, 1, B - 1, B + 1], [1, 1, B - 2, 3, B // 2, B // 2 + 5],
         [3 * B + 12_345], [B - 1, 2, B - 1, 2 * B - 2, 7], [64] * 40 + [B + 13, 5 * B // 3]]
ALLOC_LIMIT = B // 16  # a block-sized copy (or any piece-sized one) is far above


def _reference(data: bytes) -> list[str]:
    return [f"{xxh64(data[a:a + B]):016x}" for a in range(0, len(data), B)]


def _bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{len(s)}pieces")
def test_blocks_fed_in_unaligned_pieces_hash_as_whole_blocks(sizes: list[int]) -> None:
    data = _bytes(sum(sizes))
    hasher, at = BlockHasher(B), 0
    for n in sizes:
        hasher.feed(memoryview(data)[at:at + n])
        at += n
    assert hasher.finish() == _reference(data)


@pytest.mark.parametrize("lead", [1, 63, 4096 - 5, B - 8, B + 3])
def test_write_part_hashes_equal_those_of_the_file(tmp_path: Path, lead: int) -> None:
    """A part whose arrays come as unaligned pieces (as a fenced save gives them): its
    recorded block hashes are those of the file's bytes, block by block."""
    rows = _bytes(lead + 2 * B + 777, seed=lead)
    arr = np.frombuffer(rows, np.uint8)
    pieces = [arr[:lead], arr[lead:lead + B + 11], arr[lead + B + 11:]]
    size, hashes = write_part(tmp_path / "p.safetensors", {"a": pieces, "b": arr[5:B + 9]}, {"k": "v"})
    data = (tmp_path / "p.safetensors").read_bytes()
    assert size == len(data)
    assert list(hashes) == _reference(data)


def _peak(run: object) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        run()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_straddling_pieces_are_hashed_without_a_copy(tmp_path: Path) -> None:
    """Feeding blocks that straddle pieces, and writing a part of unaligned pieces,
    allocate nothing near a block: the pieces are hashed where they lie."""
    sizes = SIZES[0] + SIZES[2]
    data = _bytes(sum(sizes))
    views, at = [], 0
    for n in sizes:
        views.append(memoryview(data)[at:at + n])
        at += n

    def feed() -> None:
        hasher = BlockHasher(B)
        for v in views:
            hasher.feed(v)
        hasher.finish()

    assert _peak(feed) < ALLOC_LIMIT
    arr = np.frombuffer(data, np.uint8)
    pieces = [arr[:B - 3], arr[B - 3:3 * B + 1], arr[3 * B + 1:]]
    assert _peak(lambda: write_part(tmp_path / "p.safetensors", {"a": pieces}, {})) < ALLOC_LIMIT
