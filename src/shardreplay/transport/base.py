"""The transport interface: how actors' chunks reach a learner through a medium chosen by
URL (:func:`~shardreplay.transport.urls.open_transport`; a :class:`Transport` is
configuration, its ends are opened where they are used: docs/transports.md, "Ends").
``send`` blocks while the medium holds its cap of unconsumed chunks. Delivery, duplicates
and malformed chunks (never raised: logged, counted in :attr:`ChunkReader.stats`, set
aside): docs/semantics.md, "Delivery".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from shardreplay.errors import ConfigError, CorruptChunkError
from shardreplay.spec import Spec
from shardreplay.transport.codec import Chunk, decode, peek_identity

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "DEFAULT_SEND_TIMEOUT_S",
    "DUPLICATE",
    "Backlog",
    "ChunkReader",
    "ChunkWriter",
    "IntakeReader",
    "ReaderStats",
    "Transport",
]

logger = logging.getLogger("shardreplay.transport")

DEFAULT_MAX_CHUNK_BYTES = 256 << 20
DEFAULT_SEND_TIMEOUT_S = 60.0
DUPLICATE = "duplicate"


@runtime_checkable
class ChunkWriter(Protocol):
    """The actor's end of a transport."""

    def send(self, chunk: Chunk, *, timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        """Encode and ship one chunk, waiting up to ``timeout_s`` (None: for ever) while the
        medium is full.

        Raises:
            SpecMismatchError: the chunk does not fit the transport's spec.
            TransportTimeout: no room (or no server) within ``timeout_s``.
            TransportError: the medium failed for good.
        """
        ...

    def close(self) -> None:
        """Release the writer's resources. Idempotent."""
        ...


@runtime_checkable
class ChunkReader(Protocol):
    """The learner's end of a transport; ``spec`` is the one its chunks are decoded with."""

    spec: Spec

    @property
    def stats(self) -> ReaderStats:
        """Counters of what this reader received, rejected and dropped."""
        ...

    def receive(self, max_chunks: int = 64, timeout_s: float = 0.0, *, borrow: bool = False) -> list[Chunk]:
        """Up to ``max_chunks`` valid chunks; waits up to ``timeout_s`` for the first.
        ``borrow=True`` allows arrays into the medium's own memory, valid until the next
        ``receive`` or ``close`` (the local ring then saves a copy; other media ignore it).

        Raises:
            ConfigError: ``max_chunks`` is not an integer >= 1.
            TransportTimeout / TransportError: only for a medium that failed for good
                (rejected chunks are counted, never raised).
        """
        ...

    def ack(self, chunks: Iterable[Chunk]) -> None:
        """Mark received chunks as stored, so durable media drop them. Idempotent."""
        ...

    def close(self) -> None:
        """Release the reader's resources; unacknowledged chunks stay for the next reader."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Configuration of one medium; opens writer and reader ends."""

    url: str
    spec: Spec

    def channel(self, shard: int, run_id: str = "") -> str:
        """The name of shard ``shard``'s channel in run ``run_id`` ("": none); nothing is created."""
        ...

    def channels(self, shard: int) -> list[str]:
        """Every channel of ``shard`` on this medium, of any run (chunks others left).

        Raises:
            TransportError / TransportTimeout: the medium could not be asked.
        """
        ...

    def backlog(self, channel: str | None = None) -> Backlog:
        """The chunks waiting unconsumed in ``channel`` (None: this transport's own).

        Raises:
            TransportError / TransportTimeout: the medium could not be asked.
        """
        ...

    def writer(self) -> ChunkWriter:
        """A new writer end (call it in the actor process)."""
        ...

    def reader(self) -> ChunkReader:
        """A new reader end (call it in the learner process)."""
        ...


@dataclass(frozen=True)
class Backlog:
    """What waits in a channel: ``chunks``, and their encoded ``bytes`` where the medium
    can tell cheaply (None: Redis)."""

    chunks: int
    bytes: int | None


@dataclass
class ReaderStats:
    """What a reader has seen: chunks ``received`` (decoded, validated, returned),
    ``duplicates`` dropped (their ``(actor_id, sequence)`` seen), ``acked``, ``lost`` by
    the medium itself (a Redis server restarted without its data), ``rejected`` by reason
    (``checksum``, ``spec``, ``too_large``, ...), and ``(actor_id, sequence, chunks,
    reason)`` of the newest 4096 rejections and losses ``dropped``, popped by the consumer
    (into ``lost_chunks.jsonl``; -1: unknown id)."""

    received: int = 0
    duplicates: int = 0
    acked: int = 0
    lost: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    dropped: deque[tuple[int, int, int, str]] = field(default_factory=lambda: deque(maxlen=4096))

    @property
    def total_rejected(self) -> int:
        """Sum of ``rejected`` over all reasons."""
        return sum(self.rejected.values())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot."""
        return {"received": self.received, "duplicates": self.duplicates, "acked": self.acked,
                "lost": self.lost, "rejected": dict(self.rejected)}


class RecentIds:
    """The last ``window`` sequence numbers of each actor (duplicates come close in sequence
    to the original)."""

    def __init__(self, window: int = 4096) -> None:
        if window < 1:
            raise ConfigError(f"dedup window must be >= 1, got {window}")
        self._window = window
        self._seen: dict[int, tuple[set[int], deque[int]]] = {}

    def check_and_add(self, actor_id: int, sequence: int) -> bool:
        """True when ``(actor_id, sequence)`` was seen already; records it otherwise."""
        entry = self._seen.get(actor_id)
        if entry is None:  # not setdefault: that builds a set and a deque on every call
            entry = self._seen[actor_id] = (set(), deque())
        seen, order = entry
        if sequence in seen:
            return True
        seen.add(sequence)
        order.append(sequence)
        if len(order) > self._window:
            seen.discard(order.popleft())
        return False


class IntakeReader:
    """What every reader end shares: decoding, validation, de-duplication and counting
    (:attr:`stats`), and :meth:`receive`, which hands the medium's ``_receive`` a deadline;
    ``medium`` labels log lines.

    Raises:
        ConfigError: ``max_chunk_bytes`` < 64 or ``dedup_window`` < 1.
    """

    def __init__(self, spec: Spec, max_chunk_bytes: int, dedup_window: int, medium: str) -> None:
        if max_chunk_bytes < 64:
            raise ConfigError(f"max_chunk_bytes must be >= 64, got {max_chunk_bytes}")
        self.spec = spec
        self.max_chunk_bytes = max_chunk_bytes
        self.stats = ReaderStats()
        self._recent = RecentIds(dedup_window)
        self._medium = medium

    def receive(self, max_chunks: int = 64, timeout_s: float = 0.0, *, borrow: bool = False) -> list[Chunk]:
        """As :meth:`ChunkReader.receive` (its errors too)."""
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ConfigError(f"max_chunks must be an integer >= 1, got {max_chunks!r}")
        return self._receive(max_chunks, time.monotonic() + max(timeout_s, 0.0), borrow)

    def _receive(self, max_chunks: int, deadline: float, borrow: bool) -> list[Chunk]:
        raise NotImplementedError

    def _admit(self, data: bytes | bytearray | memoryview, origin: str) -> Chunk | str:
        """Decode ``data``: the chunk, or ``DUPLICATE``, or the rejection reason
        (``checksum``, ...; logged and counted)."""
        try:
            chunk = decode(data, self.spec, max_bytes=self.max_chunk_bytes)
        except CorruptChunkError as exc:
            ident = peek_identity(data) if exc.reason not in ("too_large", "truncated") else None
            self._reject(exc.reason, f"{exc} (from {origin}, claims actor/seq {ident})", ident)
            return exc.reason
        if self._recent.check_and_add(chunk.actor_id, chunk.sequence):
            self.stats.duplicates += 1
            logger.debug("%s: duplicate chunk actor %d seq %d from %s dropped", self._medium,
                         chunk.actor_id, chunk.sequence, origin)
            return DUPLICATE
        self.stats.received += 1
        return chunk

    def _reject(self, reason: str, detail: str, identity: tuple[int, int] | None = None) -> None:
        """Count and log one rejected chunk; queue it in ``stats.dropped`` (``identity``:
        what its header claims, if readable)."""
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        actor, seq = identity or (-1, -1)
        self.stats.dropped.append((actor, seq, 1, f"rejected by the transport: {reason}"))
        logger.warning("%s: rejected a chunk (%s): %s", self._medium, reason, detail)

    def _lose(self, count: int, detail: str) -> None:
        """Count and log ``count`` entries the medium lost (identities unknown); queue
        them in ``stats.dropped`` when there are any."""
        self.stats.lost += count
        if count:
            self.stats.dropped.append((-1, -1, count, detail))
        logger.error("%s: %d chunks lost: %s", self._medium, count, detail)
