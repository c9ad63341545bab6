"""XXH64 for part files: the kernel lives in :mod:`shardreplay._hashing` (transports use it too)."""

from __future__ import annotations

from shardreplay._hashing import xxh64

__all__ = ["xxh64"]
