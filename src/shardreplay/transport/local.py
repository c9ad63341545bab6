"""``local`` transport: a bounded shared-memory ring between processes of one machine.

Every chunk is written as ``[uint64 length][encoded bytes]`` into one ring of
``capacity_bytes`` in shared memory, guarded by one lock and two conditions. A writer
waits while the ring lacks room (back-pressure, bounded memory); the reader copies
records out under the lock and decodes them outside it. No pickle: only raw bytes travel.

The ring and its lock are created with the ``spawn`` context, so a :class:`LocalTransport`
can be handed to children started with ``spawn`` (or ``fork``) as a ``Process`` argument.
The medium is not durable: ``ack`` only counts, and chunks in the ring die with the
processes.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from shardreplay.errors import ConfigError, TransportTimeout
from shardreplay.spec import Spec
from shardreplay.transport.base import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_SEND_TIMEOUT_S,
    Intake,
    ReaderStats,
)
from shardreplay.transport.codec import Chunk, encode

__all__ = ["LocalReader", "LocalTransport", "LocalWriter"]

_LEN = struct.Struct("<Q")
_HEAD, _TAIL = 0, 1  # absolute byte counters in the shared meta array: used = head - tail


class _Ring:
    """Byte records in a shared ring; every method takes the lock itself."""

    def __init__(self, capacity_bytes: int, ctx: Any) -> None:
        self.capacity = capacity_bytes
        self._raw = ctx.RawArray("B", capacity_bytes)
        self._meta = ctx.RawArray("q", 2)
        self._lock = ctx.Lock()
        self._not_empty = ctx.Condition(self._lock)
        self._not_full = ctx.Condition(self._lock)
        self._view: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_view"] = None  # numpy views are rebuilt in the receiving process
        return state

    @property
    def _buf(self) -> np.ndarray:
        if self._view is None:
            self._view = np.frombuffer(self._raw, dtype=np.uint8)
        return self._view

    def _used(self) -> int:
        return self._meta[_HEAD] - self._meta[_TAIL]

    def put(self, data: bytes, deadline: float | None) -> bool:
        """Append one record; False when ``deadline`` passed before there was room."""
        need = _LEN.size + len(data)
        with self._not_full:
            while self.capacity - self._used() < need:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._not_full.wait(left)
            head = self._meta[_HEAD]
            self._write(head, _LEN.pack(len(data)))
            self._write(head + _LEN.size, data)
            self._meta[_HEAD] = head + need
            self._not_empty.notify()
        return True

    def take(self, max_records: int, deadline: float) -> list[bytes]:
        """Pop up to ``max_records`` records, waiting until ``deadline`` for the first."""
        out: list[bytes] = []
        with self._not_empty:
            while self._used() == 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return out
                self._not_empty.wait(left)
            tail = self._meta[_TAIL]
            while len(out) < max_records and self._meta[_HEAD] > tail:
                (n,) = _LEN.unpack(self._read(tail, _LEN.size))
                out.append(self._read(tail + _LEN.size, n))
                tail += _LEN.size + n
            self._meta[_TAIL] = tail
            self._not_full.notify_all()
        return out

    def _write(self, pos: int, data: bytes) -> None:
        start = pos % self.capacity
        first = min(len(data), self.capacity - start)
        src = np.frombuffer(data, dtype=np.uint8)
        self._buf[start:start + first] = src[:first]
        if first < len(data):
            self._buf[:len(data) - first] = src[first:]

    def _read(self, pos: int, n: int) -> bytes:
        start = pos % self.capacity
        if start + n <= self.capacity:
            return self._buf[start:start + n].tobytes()
        first = self.capacity - start
        return self._buf[start:].tobytes() + self._buf[:n - first].tobytes()


class LocalTransport:
    """Chunks between processes of one machine through shared memory.

    Args:
        spec: the spec every chunk must follow.
        capacity_bytes: ring size; writers wait while it is full. A chunk that cannot
            fit even an empty ring is a ``ConfigError`` at ``send``.
        max_chunk_bytes: the reader rejects longer chunks.
        dedup_window: sequences remembered per actor for duplicate detection.

    Raises:
        ConfigError: a non-positive capacity.
    """

    def __init__(self, spec: Spec, *, capacity_bytes: int = 64 << 20,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, dedup_window: int = 4096) -> None:
        if capacity_bytes < 1024:
            raise ConfigError(f"capacity_bytes must be >= 1024, got {capacity_bytes}")
        self.url = "local"
        self.spec = spec
        self.max_chunk_bytes = max_chunk_bytes
        self.dedup_window = dedup_window
        self._ring = _Ring(capacity_bytes, mp.get_context("spawn"))

    def writer(self) -> LocalWriter:
        """A writer end; call it in the actor process."""
        return LocalWriter(self._ring, self.spec)

    def reader(self) -> LocalReader:
        """The reader end; call it in the learner process (one reader per transport)."""
        return LocalReader(self._ring, Intake(self.spec, max_chunk_bytes=self.max_chunk_bytes,
                                              dedup_window=self.dedup_window, medium="local"))


class LocalWriter:
    """Actor end of a :class:`LocalTransport`."""

    def __init__(self, ring: _Ring, spec: Spec) -> None:
        self._ring = ring
        self._spec = spec

    def send(self, chunk: Chunk, *, timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        """Encode ``chunk`` and append it to the ring, waiting for room.

        Raises:
            SpecMismatchError: the chunk does not fit the spec.
            ConfigError: the encoded chunk is larger than the whole ring.
            TransportTimeout: the ring stayed full for ``timeout_s``.
        """
        data = encode(chunk, self._spec)
        if len(data) + _LEN.size > self._ring.capacity:
            raise ConfigError(f"a chunk of {len(data)} bytes never fits the local ring of "
                              f"{self._ring.capacity} bytes: raise capacity_bytes or send smaller chunks")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._ring.put(data, deadline):
            raise TransportTimeout(f"local transport full for {timeout_s} s: the learner is not "
                                   "draining it (is it alive and receiving?)")

    def close(self) -> None:
        """Nothing to release; present for the interface."""


class LocalReader:
    """Learner end of a :class:`LocalTransport`."""

    def __init__(self, ring: _Ring, intake: Intake) -> None:
        self._ring = ring
        self._intake = intake

    @property
    def stats(self) -> ReaderStats:
        """Counters of received, duplicate and rejected chunks."""
        return self._intake.stats

    def receive(self, max_chunks: int = 64, timeout_s: float = 0.0) -> list[Chunk]:
        """Up to ``max_chunks`` valid chunks, waiting up to ``timeout_s`` for the first."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:  # rejected or duplicate records do not end the wait
            records = self._ring.take(max_chunks, deadline)
            chunks = [c for c in (self._intake.admit(r, "local ring") for r in records)
                      if isinstance(c, Chunk)]
            if chunks or not records or time.monotonic() >= deadline:
                return chunks

    def ack(self, chunks: Iterable[Chunk]) -> None:
        """Count acknowledgements; the local medium keeps nothing to forget."""
        self._intake.stats.acked += sum(1 for _ in chunks)

    def close(self) -> None:
        """Nothing to release; present for the interface."""
