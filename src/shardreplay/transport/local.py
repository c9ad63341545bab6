"""``local`` transport: a bounded shared-memory ring between processes of one machine.

Every encoded chunk is one record of a :class:`~shardreplay.transport.shm_ring.ShmRing`.
A writer waits while the ring lacks room, checks its chunk's structure, then encodes it
straight into the ring (:meth:`ShmRing.put_with`), where the values of exact-dtype steps
are checked in one compiled pass before the record is published. The reader copies a
batch of records out and decodes them outside the ring's lock, or with
``receive(borrow=True)`` decodes them in place. Only raw bytes travel; a process killed
at any point does not wedge the others. Ring and lock come from the ``spawn`` context,
so a :class:`LocalTransport` can be a ``Process`` argument. Not durable: ``ack`` only
counts.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterable

from shardreplay.errors import ConfigError, TransportTimeout
from shardreplay.spec import Spec
from shardreplay.transport.base import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_SEND_TIMEOUT_S,
    Backlog,
    Intake,
    IntakeReader,
)
from shardreplay.transport.codec import Chunk, Encoding
from shardreplay.transport.shm_ring import ShmRing

__all__ = ["LocalReader", "LocalTransport", "LocalWriter"]

_LEN_SIZE = 8  # each record in the ring carries a uint64 length
# A receive takes about this many bytes at most, so the batch copied out of the ring
# stays in cache while it is decoded and stored.
_BATCH_BYTES = 1 << 20


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
        self._ring = ShmRing(capacity_bytes, mp.get_context("spawn"))

    def channel(self, shard: int, run_id: str = "") -> str:
        """``local:shard-<k>``: each shard has its own ring, which no other run can reach."""
        return f"local:shard-{shard}"

    def channels(self, shard: int) -> list[str]:
        """None to list: another run's rings live in its own processes."""
        return []

    def backlog(self, channel: str | None = None) -> Backlog:
        """Chunks waiting in this transport's ring (``channel`` must be None: a ring of
        another transport is not reachable from this one).

        Raises:
            ConfigError: ``channel`` given.
        """
        if channel is not None:
            raise ConfigError(f"the local transport reports only its own ring's backlog, not {channel!r}")
        chunks, nbytes = self._ring.backlog()
        return Backlog(chunks, nbytes)

    def writer(self) -> LocalWriter:
        """A writer end; call it in the actor process."""
        return LocalWriter(self._ring, self.spec)

    def reader(self) -> LocalReader:
        """The reader end; call it in the learner process (one reader per transport)."""
        return LocalReader(self._ring, Intake(self.spec, max_chunk_bytes=self.max_chunk_bytes,
                                              dedup_window=self.dedup_window, medium="local"))


class LocalWriter:
    """Actor end of a :class:`LocalTransport`."""

    def __init__(self, ring: ShmRing, spec: Spec) -> None:
        self._ring = ring
        self._spec = spec

    def send(self, chunk: Chunk, *, timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        """Encode ``chunk`` and append it to the ring, waiting for room.

        Raises:
            SpecMismatchError: the chunk does not fit the spec.
            ConfigError: the encoded chunk is larger than the whole ring.
            TransportTimeout: the ring stayed full for ``timeout_s``.
        """
        enc = Encoding(chunk, self._spec)  # structure checked here, outside the ring lock
        if enc.nbytes + _LEN_SIZE > self._ring.capacity:
            raise ConfigError(f"a chunk of {enc.nbytes} bytes never fits the local ring of "
                              f"{self._ring.capacity} bytes: raise capacity_bytes or send smaller chunks")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._ring.put_with(enc.nbytes, enc.write_into, deadline):  # encoded in place
            raise TransportTimeout(f"local transport full for {timeout_s} s: the learner is not "
                                   "draining it (is it alive and receiving?)")

    def close(self) -> None:
        """Nothing to release; present for the interface."""


class LocalReader(IntakeReader):
    """Learner end of a :class:`LocalTransport`."""

    def __init__(self, ring: ShmRing, intake: Intake) -> None:
        self._ring = ring
        self._intake = intake

    def _receive(self, max_chunks: int, deadline: float, borrow: bool) -> list[Chunk]:
        # borrow: decoded where they lie in the ring, which keeps their room until the
        # next receive or close (one copy of every chunk less).
        while True:  # rejected or duplicate records do not end the wait
            records = self._ring.take(max_chunks, deadline, _BATCH_BYTES, borrow=borrow)
            chunks = [c for c in (self._intake.admit(r, "local ring") for r in records)
                      if isinstance(c, Chunk)]
            if chunks or not records or time.monotonic() >= deadline:
                return chunks

    def ack(self, chunks: Iterable[Chunk]) -> None:
        """Count acknowledgements; the local medium keeps nothing to forget."""
        self._intake.stats.acked += sum(1 for _ in chunks)

    def close(self) -> None:
        """Give back borrowed chunks' room (see :meth:`receive`)."""
        self._ring.give_back()
