"""A write fence: a shard's stored steps as they were at one moment, readable while
writes go on (what a background checkpoint writes from).

At :meth:`Shard.take_fence <shardreplay.buffer.shard.Shard.take_fence>` the positions are
recorded: row ``r`` then holds absolute steps ``[lo_r, hi_r)``. Rows are append-only
rings, so a later write of absolute step ``a`` replaces step ``a - C`` and nothing else.
Before every write the shard calls :meth:`WriteFence.before_write`: of the steps that
write is about to replace, those the reader still needs (at or past its frontier for
that field and row, below ``hi_r``) are copied aside first. Copy-on-overwrite of only
those slots: a fence costs nothing until a write reaches fenced steps, and then one
copy of each step it replaces.

The reader (:class:`FencedPiece`, converted with ``np.asarray``) takes the steps of one
field and row in time order: the ones announced as replaced from the copies, the rest
from the live slots, copied without the lock and checked after the copy (a write
announces itself under the lock before it writes: steps announced during the copy are
taken from their copies), and moves the frontier past them. The lock is held for
bookkeeping only, never for a piece's copy or a disk write. Frame-stacked fields are
fenced the same way over their frame rings (:mod:`shardreplay.buffer.frame_fence`).

Internal: not part of the public API.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from shardreplay.buffer.frame_fence import FrameFence
from shardreplay.errors import ShardReplayError
from shardreplay.storage import StreamStorage

PIECE_BYTES = 4 << 20  # one piece's copy under the lock: about a millisecond


class WriteFence:
    """The stored steps of user fields ``names`` of ``storage`` at this moment, kept
    readable from ``start[r]`` (an absolute step of each row) on. Frame-stacked fields
    are fenced by a :class:`~shardreplay.buffer.frame_fence.FrameFence` each (their frame
    rings are overwritten by appends, not by step writes)."""

    def __init__(self, storage: StreamStorage, names: Sequence[str], start: np.ndarray) -> None:
        self.cap = storage.stream_capacity
        self.hi = storage.pos.copy()
        self.lo = self.hi - np.minimum(self.hi, self.cap)
        self.start = np.clip(np.asarray(start, np.int64), self.lo, self.hi)
        self._arrays = {name: storage.fields[name] for name in names if name not in storage.stacked}
        self._front = {name: self.start.copy() for name in self._arrays}
        # Frame-stacked fields: their frame rings are fenced apart (they hook their stores).
        self._frames = {name: FrameFence(storage.stacked[name], self.start, self.hi)
                        for name in names if name in storage.stacked}
        # Steps below replaced[r] were announced as overwritten: read from the copies.
        self._replaced = self.hi - self.cap
        self._kept: dict[tuple[str, int], list[tuple[int, np.ndarray]]] = {}
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.copied_steps = 0  # steps copied aside because a write reached them

    # -- the writer's side (the thread that writes the buffer) ---------------------------
    def before_write(self, pos: np.ndarray, rows: np.ndarray, count: int) -> None:
        """Copy aside what writing ``count`` steps at the end of each of ``rows`` (now at
        ``pos[rows]``) will replace and the reader still needs."""
        if self._released.is_set():
            return
        rows = np.asarray(rows, np.int64)
        first = pos[rows] - self.cap
        end = first + count
        with self._lock:
            for name, front in self._front.items():
                a = np.maximum(first, front[rows])
                b = np.minimum(end, self.hi[rows])
                for k in np.flatnonzero(b > a).tolist():
                    self._keep(name, int(rows[k]), int(a[k]), int(b[k]))
            np.maximum.at(self._replaced, rows, end)

    def _keep(self, name: str, row: int, a: int, b: int) -> None:
        self._kept.setdefault((name, row), []).append((a, self._live(name, row, a, b)))
        self.copied_steps += b - a

    def _live(self, name: str, row: int, a: int, b: int) -> np.ndarray:
        """A copy of the stored steps ``[a, b)`` of ``row`` (at most two ring slices)."""
        arr, cap = self._arrays[name], self.cap
        s = a % cap
        n = b - a
        head = min(n, cap - s)
        out = np.empty((n, *arr.shape[1:]), arr.dtype)
        out[:head] = arr[row * cap + s:row * cap + s + head]
        out[head:] = arr[row * cap:row * cap + n - head]
        return out

    # -- the reader's side (the checkpoint's thread) -------------------------------------
    def read(self, name: str, row: int, a: int, b: int) -> np.ndarray:
        """The steps ``[a, b)`` of ``row`` of field ``name`` as they were at the fence;
        ``a`` must be the frontier (pieces are read in time order).

        The live slots are copied *without* the lock (a writer preempted while holding
        it would stall the buffer's writes): steps announced as replaced meanwhile were
        copied aside before being overwritten (the frontier had not passed them), and
        their copies replace what was read of them; steps not announced by the end of
        the copy were not written during it.
        """
        with self._lock:
            if a != self._front[name][row]:
                raise ShardReplayError(f"internal: fence of {name!r} row {row}: read {a}..{b} out of "
                                       f"order (frontier {self._front[name][row]})")
            m0 = self._announced(row, a, b)
            parts = self._take_kept(name, row, a, m0, drop=False)
        live = self._live(name, row, m0, b) if b > m0 else None
        with self._lock:
            m1 = self._announced(row, a, b)
            if live is not None and m1 > m0:  # overwritten during the copy: take the copies
                fixed = self._take_kept(name, row, m0, m1, drop=False)
                live[:m1 - m0] = np.concatenate(fixed) if len(fixed) > 1 else fixed[0]
            self._front[name][row] = b
            self._take_kept(name, row, b, b, drop=True)  # forget what is read
        if live is not None:
            parts.append(live)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _announced(self, row: int, a: int, b: int) -> int:
        """The end of the steps of ``[a, b)`` announced as replaced (copied aside)."""
        return int(min(max(self._replaced[row], a), b))

    def _take_kept(self, name: str, row: int, a: int, m: int, *, drop: bool) -> list[np.ndarray]:
        """The copies of steps ``[a, m)`` (in order); with ``drop``, forget the copies of
        steps before ``m`` (read already)."""
        chunks = self._kept.get((name, row), [])
        out = []
        for start, data in chunks:
            lo, hi = max(start, a), min(start + data.shape[0], m)
            if hi > lo:
                out.append(data[lo - start:hi - start])
        if drop and chunks:
            self._kept[(name, row)] = [(st, d) for st, d in chunks if st + d.shape[0] > m]
        return out

    def pieces(self, name: str) -> list[FencedPiece]:
        """Pieces of at most ``PIECE_BYTES`` (frame-stacked fields: ``PIECE_STEPS``
        steps) covering each row's steps from ``start`` to ``hi`` of field ``name``, in
        (row, time) order."""
        frames = self._frames.get(name)
        if frames is not None:
            field = frames.store.field
            return [FencedPiece(partial(frames.read, r, a, b), (b - a, *field.shape), field.dtype)
                    for r, a, b in frames.ranges()]
        arr = self._arrays[name]
        row_bytes = max(1, arr.dtype.itemsize * math.prod(arr.shape[1:]))
        step = max(1, PIECE_BYTES // row_bytes)
        return [FencedPiece(partial(self.read, name, r, a, b), (b - a, *arr.shape[1:]), arr.dtype)
                for r, (start, hi) in enumerate(zip(self.start.tolist(), self.hi.tolist(), strict=True))
                for a in range(start, hi, step) for b in (min(a + step, hi),)]

    # -- end -------------------------------------------------------------------------------
    def release(self) -> None:
        """The reader is done: writes stop copying, the copies are dropped."""
        with self._lock:
            self._released.set()
            self._kept.clear()
        for frames in self._frames.values():
            frames.release()

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released.is_set()

    def wait_released(self, timeout: float | None = None) -> bool:
        """Wait until the reader is done; False on timeout."""
        return self._released.wait(timeout)


class FencedPiece:
    """Steps of one row of one field as at the fence, read when converted
    (``np.asarray``) by ``read``. Has ``shape``, ``dtype``, ``size`` and ``nbytes`` like
    the array it stands for; pieces of one field and row must be converted in order."""

    def __init__(self, read: Callable[[], np.ndarray], shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._read = read
        self.shape = shape
        self.dtype = dtype
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)  # not np.prod: a shard has thousands of pieces
        self.nbytes = self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        arr = self._read()
        return arr if dtype is None else arr.astype(dtype, copy=False)
