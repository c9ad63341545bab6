"""``local`` transport: a bounded shared-memory ring (:class:`ShmRing`) between processes
of one machine; its rules: docs/transports.md, "local: a shared-memory ring". Ring and
locks come from the ``spawn`` context, so a :class:`LocalTransport` can be a ``Process``
argument.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import platform
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from shardreplay.errors import ConfigError, TransportTimeout
from shardreplay.spec import Spec
from shardreplay.transport.base import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_SEND_TIMEOUT_S,
    Backlog,
    IntakeReader,
)
from shardreplay.transport.codec import Chunk, Encoding

__all__ = ["LocalReader", "LocalTransport", "LocalWriter", "ShmRing"]

logger = logging.getLogger("shardreplay.transport")
# A receive takes about this many bytes at most, so the batch copied out of the ring
# stays in cache while it is decoded and stored.
_BATCH_BYTES = 1 << 20


class LocalTransport:
    """Chunks of ``spec`` between processes of one machine through a shared-memory ring of
    ``capacity_bytes`` (writers wait while it is full; a chunk that cannot fit even an
    empty ring is a ``ConfigError`` at ``send``). The reader rejects chunks over
    ``max_chunk_bytes`` and remembers ``dedup_window`` sequences per actor to drop duplicates.

    Raises:
        ConfigError: a capacity under 1024 bytes.
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
        return LocalReader(self)


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
        if enc.nbytes + _LEN.size > self._ring.capacity:
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

    def __init__(self, transport: LocalTransport) -> None:
        super().__init__(transport.spec, transport.max_chunk_bytes, transport.dedup_window, "local")
        self._ring = transport._ring

    def _receive(self, max_chunks: int, deadline: float, borrow: bool) -> list[Chunk]:
        while True:  # rejected or duplicate records do not end the wait
            records = self._ring.take(max_chunks, deadline, _BATCH_BYTES, borrow=borrow)
            chunks = [c for c in (self._admit(r, "local ring") for r in records)
                      if isinstance(c, Chunk)]
            if chunks or not records or time.monotonic() >= deadline:
                return chunks

    def ack(self, chunks: Iterable[Chunk]) -> None:
        """Count acknowledgements; the local medium keeps nothing to forget."""
        self.stats.acked += sum(1 for _ in chunks)

    def close(self) -> None:
        """Give back borrowed chunks' room (see :meth:`receive`)."""
        self._ring.give_back()


# -- the ring ---------------------------------------------------------------------------

_LEN = struct.Struct("<Q")
_HEAD, _TAIL, _HOLDER, _READER = 0, 1, 2, 3  # _HOLDER: of the lock; _READER: of the read lock
_STUCK_S = 0.5
# x86-64 readers need no ring lock: docs/transports.md, "local: a shared-memory ring".
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: fall back to a signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class ShmRing:
    """Byte records in ``capacity`` bytes of shared memory (a record takes ``8 + len(data)``)
    from multiprocessing context ``ctx``, for any number of writer and reader processes."""

    def __init__(self, capacity: int, ctx: Any) -> None:
        self.capacity = capacity
        self._raw = ctx.RawArray("B", capacity)
        self._meta = ctx.RawArray("q", 4)
        self._lock = ctx.Lock()
        self._read_lock = ctx.Lock()
        self._repairing = ctx.Lock()
        self._items = ctx.Semaphore(0)
        self._view: np.ndarray | None = None
        self._lent: int | None = None  # end of the records lent by take(borrow=True)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_view"] = None  # numpy views are rebuilt in the receiving process
        state["_lent"] = None  # a loan is the lending process's own
        return state

    @property
    def _buf(self) -> np.ndarray:
        if self._view is None:
            self._view = np.frombuffer(self._raw, dtype=np.uint8)
        return self._view

    def _acquire(self, lock: Any = None, slot: int = _HOLDER) -> None:
        lock = self._lock if lock is None else lock
        while not lock.acquire(timeout=_STUCK_S):
            self._repair(lock, slot)
        self._meta[slot] = os.getpid()

    def _repair(self, lock: Any, slot: int) -> None:
        """Release the lock of a dead holder; one repairer at a time, holder read inside."""
        if not self._repairing.acquire(timeout=_STUCK_S):
            return
        try:
            holder = self._meta[slot]
            if holder and not pid_alive(holder):
                logger.warning("local ring: process %d died holding a ring lock; released it", holder)
                self._meta[slot] = 0
                with contextlib.suppress(ValueError):  # "released too many times": nothing to do
                    lock.release()
        finally:
            self._repairing.release()

    def _release(self, lock: Any = None, slot: int = _HOLDER) -> None:
        self._meta[slot] = 0
        (self._lock if lock is None else lock).release()

    def _head_tail(self) -> tuple[int, int]:
        """``head`` and ``tail``, read under the ring lock."""
        self._acquire()
        try:
            return self._meta[_HEAD], self._meta[_TAIL]
        finally:
            self._release()

    def put(self, data: bytes, deadline: float | None) -> bool:
        """Append one record, polling for room; False when ``deadline`` passed first."""
        src = np.frombuffer(data, np.uint8)
        return self.put_with(len(data), lambda dst: dst.__setitem__(slice(None), src), deadline)

    def put_with(self, nbytes: int, fill: Callable[[np.ndarray], None], deadline: float | None) -> bool:
        """Append a record of ``nbytes`` that ``fill`` writes into the ring's own memory (a
        uint8 view; a scratch array when the record wraps around the ring's end), under the
        ring lock, visible once ``fill`` returned; False when ``deadline`` passed first."""
        need = _LEN.size + nbytes
        pause = 0.0002
        while True:
            self._acquire()
            try:
                head, tail = self._meta[_HEAD], self._meta[_TAIL]
                if self.capacity - (head - tail) >= need:
                    buf, at = self._buf, head % self.capacity
                    if at + _LEN.size <= self.capacity:
                        _LEN.pack_into(buf.data, at, nbytes)
                    else:
                        self._write(head, _LEN.pack(nbytes))
                    start = (head + _LEN.size) % self.capacity
                    if start + nbytes <= self.capacity:
                        fill(buf[start:start + nbytes])
                    else:
                        scratch = np.empty(nbytes, np.uint8)
                        fill(scratch)
                        self._write(head + _LEN.size, scratch)
                    self._meta[_HEAD] = head + need  # last: a writer killed before leaves nothing
                    if head == tail:
                        self._items.release()  # the ring was empty: the reader may sleep
                    return True
            finally:
                self._release()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, 0.005)

    def take(self, max_records: int, deadline: float, max_bytes: int | None = None, *,
             borrow: bool = False) -> list[memoryview]:
        """Read-only views of up to ``max_records`` records popped (waiting until ``deadline``
        for the first; with ``max_bytes``, none more once those taken reach that many
        bytes), into one ``bytes`` copy of the batch. ``borrow`` lends them in place instead
        (a record that wraps around the ring's end is copied): writers cannot reuse their
        bytes, and this process keeps the read lock, until :meth:`give_back` or its next
        ``take``."""
        self.give_back()
        while True:
            self._acquire(self._read_lock, _READER)
            lent = False
            try:
                while self._items.acquire(False):  # drop stale hints before looking
                    pass
                out = self._take_turn(max_records, max_bytes, borrow)
                lent = self._lent is not None
            finally:
                if not lent:
                    self._release(self._read_lock, _READER)
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            self._items.acquire(timeout=min(left, 0.1))

    def backlog(self) -> tuple[int, int]:
        """Records waiting and their bytes (without the length words)."""
        lent = self._lent is not None
        if not lent:
            self._acquire(self._read_lock, _READER)
        try:
            head, tail = self._head_tail()
            records, nbytes, pos = 0, 0, tail
            while head > pos:  # nobody moves tail or overwrites these bytes: read lock held
                (n,) = _LEN.unpack(self._read(pos, _LEN.size))
                records, nbytes, pos = records + 1, nbytes + n, pos + _LEN.size + n
            return records, nbytes
        finally:
            if not lent:
                self._release(self._read_lock, _READER)

    def give_back(self) -> None:
        """End the loan of the last ``take(borrow=True)``: writers may now reuse those
        records' bytes (views of them then show whatever is written next)."""
        if self._lent is None:
            return
        self._move_tail(self._lent)
        self._lent = None
        self._release(self._read_lock, _READER)

    def _move_tail(self, pos: int) -> None:
        if _ORDERED_STORES:
            self._meta[_TAIL] = pos  # after the copy: loads are not reordered with later stores
        else:
            self._acquire()
            try:
                self._meta[_TAIL] = pos
            finally:
                self._release()

    def _take_turn(self, max_records: int, max_bytes: int | None, borrow: bool) -> list[memoryview]:
        """Copy records out between ``tail`` and ``head`` (read lock held), then move
        ``tail``; or, with ``borrow``, lend them in place and note where ``tail`` goes."""
        if _ORDERED_STORES:
            head, tail = self._meta[_HEAD], self._meta[_TAIL]  # no ring lock: see _ORDERED_STORES
            if head == tail:  # empty: look again under the lock before the caller sleeps
                head, _tail = self._head_tail()
        else:
            head, tail = self._head_tail()
        spans: list[tuple[int, int]] = []  # (offset from tail, length) of each record
        pos = tail
        stop = tail + (max_bytes if max_bytes is not None else head)
        buf, capacity = self._buf, self.capacity
        while len(spans) < max_records and head > pos and (pos < stop or not spans):
            at = pos % capacity
            # The length in place when it does not wrap (no bytes object per record).
            wraps = at + _LEN.size > capacity
            (n,) = _LEN.unpack(self._read(pos, _LEN.size)) if wraps else _LEN.unpack_from(buf.data, at)
            spans.append((pos + _LEN.size - tail, n))
            pos += _LEN.size + n
        if not spans:
            return []
        if borrow:
            self._lent = pos
            ring = self._buf.data.toreadonly()
            return [ring[start:start + n] if (start := (tail + at) % capacity) + n <= capacity
                    else memoryview(self._read(tail + at, n)) for at, n in spans]
        blob = memoryview(self._read(tail, pos - tail))
        self._move_tail(pos)
        return [blob[at:at + n] for at, n in spans]

    def _write(self, pos: int, data: bytes | np.ndarray) -> None:
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
