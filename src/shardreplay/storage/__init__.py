"""Where steps live: per-stream rings in RAM or memory-mapped files."""

from __future__ import annotations

from shardreplay.storage.allocate import STORAGE_KINDS, ArrayAllocator
from shardreplay.storage.streams import SEQUENCE_STEP_ARRAYS, STEP_ARRAYS, StreamStorage

__all__ = ["SEQUENCE_STEP_ARRAYS", "STEP_ARRAYS", "STORAGE_KINDS", "ArrayAllocator", "StreamStorage"]
