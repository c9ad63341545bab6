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


class Xxh64Stream:
    """XXH64 (seed 0) of bytes fed in pieces: the same value as :func:`xxh64` of their
    concatenation, without gathering them (``update`` releases the GIL on large
    buffers, where copying into a ``bytearray`` holds it for the whole copy)."""

    def __init__(self) -> None:
        self._state = xxhash.xxh64()

    def update(self, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Feed the next bytes (a contiguous buffer, not copied)."""
        self._state.update(data)  # type: ignore[arg-type]  # as in xxh64

    def intdigest(self) -> int:
        """XXH64 of everything fed so far."""
        return int(self._state.intdigest())


def xxh3_64(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """XXH3-64 (seed 0) of a contiguous byte buffer: the checksum of transport chunks."""
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]  # as in xxh64
