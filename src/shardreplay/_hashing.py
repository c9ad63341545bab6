"""Checksums from ``xxhash`` (low-level: checkpoint and transport both import it): XXH64,
the reference algorithm, which other tools can check checkpoint part blocks with, and
XXH3-64, the checksum of transport chunks. Either misses a random corruption with
probability 2^-64.
Why not zlib's CRC: it would make checked loads slower than ``np.load``.
"""

from __future__ import annotations

import numpy as np
import xxhash


def xxh64(data: bytes | bytearray | memoryview | np.ndarray, seed: int = 0) -> int:
    """XXH64 of a contiguous byte buffer (no copy).

    Raises:
        ValueError: ``data`` is not C-contiguous.
    """
    # ndarray is a buffer; numpy's stubs declare its __buffer__ only for Python >= 3.12.
    return xxhash.xxh64_intdigest(data, seed)  # type: ignore[arg-type]


class BlockHasher:
    """XXH64 of each ``block_bytes`` block of a byte stream (16 hex digits each), fed in
    arbitrary pieces: a block inside one piece is hashed in place, one that straddles
    pieces by a streaming state fed each of its parts (never gathered into a staging
    copy: ``update`` releases the GIL on large buffers, a copy into a ``bytearray`` holds
    it for the whole copy)."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.hashes: list[str] = []
        self._state: xxhash.xxh64 | None = None
        self._fill = 0

    def feed(self, data: memoryview) -> None:
        """Hash the next bytes (a contiguous buffer, not copied)."""
        block = self.block_bytes
        while len(data):
            if self._fill == 0 and len(data) >= block:
                self.hashes.append(f"{xxh64(data[:block]):016x}")
                data = data[block:]
                continue
            take = min(len(data), block - self._fill)
            if self._state is None:
                self._state = xxhash.xxh64()
            self._state.update(data[:take])
            self._fill += take
            data = data[take:]
            if self._fill == block:
                self._end_block()

    def _end_block(self) -> None:
        assert self._state is not None
        self.hashes.append(f"{self._state.intdigest():016x}")
        self._state, self._fill = None, 0

    def finish(self) -> list[str]:
        """The hashes of every block, the last one (possibly short) included."""
        if self._fill:
            self._end_block()
        return self.hashes


def xxh3_64(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """XXH3-64 (seed 0) of a contiguous byte buffer: the checksum of transport chunks."""
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]  # as in xxh64
