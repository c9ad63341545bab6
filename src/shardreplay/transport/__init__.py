"""Shipping chunks of steps from actors to learners: ``local``, ``file://`` and ``redis://``.

See :mod:`shardreplay.transport.base` for the interface and :mod:`.codec` for the wire
format. Importing this package does not import redis.
"""

from __future__ import annotations

from shardreplay.transport.base import (
    ChunkReader,
    ChunkWriter,
    ReaderStats,
    Transport,
)
from shardreplay.transport.codec import Chunk, decode, encode
from shardreplay.transport.urls import open_transport

__all__ = [
    "Chunk",
    "ChunkReader",
    "ChunkWriter",
    "ReaderStats",
    "Transport",
    "decode",
    "encode",
    "open_transport",
]
