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
bookkeeping only, never for a piece's copy or a disk write.

A frame-stacked field keeps one ring of frames per row (``storage/frames.py``): a step
records ``ref``, the absolute position of its newest frame, and its stack is the ``K``
frames ending there. Its :class:`FrameFence` copies each slot's ``ref`` at the fence (the
slots are overwritten by later steps) and, per row, knows the frames the fenced steps
use: absolute positions ``[first frame of the oldest fenced step's stack, frames
appended)``. Frames are appended in order, so appending ``n`` frames to a ring of ``F``
replaces positions ``[fpos - F, fpos + n - F)`` and nothing else. The frame store calls
:meth:`FrameFence.before_append` before it appends (after a ring grew: growing copies,
it never replaces a frame): the same copy-on-overwrite, announcement and frontier,
counted in frames instead of steps.

Internal: not part of the public API.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from shardreplay.errors import ShardReplayError
from shardreplay.storage import StreamStorage
from shardreplay.storage.frames import PIECE_STEPS, FrameStore

PIECE_BYTES = 4 << 20  # one piece's copy under the lock: about a millisecond


class _CopiesAside:
    """The copies of ring ranges set aside before writes replaced them, by key (a field
    and row, or a row of frames), and ``replaced[row]``: positions below it were
    announced as overwritten (read from the copies)."""

    def __init__(self, replaced: np.ndarray) -> None:
        self._replaced = replaced
        self._kept: dict[object, list[tuple[int, np.ndarray]]] = {}
        self._lock = threading.Lock()

    def _announced(self, row: int, a: int, b: int) -> int:
        """The end of the positions of ``[a, b)`` announced as replaced (copied aside)."""
        return int(min(max(self._replaced[row], a), b))

    def _take_kept(self, key: object, a: int, m: int) -> list[np.ndarray]:
        """The copies of positions ``[a, m)`` (in order)."""
        out = []
        for start, data in self._kept.get(key, []):
            lo, hi = max(start, a), min(start + data.shape[0], m)
            if hi > lo:
                out.append(data[lo - start:hi - start])
        return out

    def _read(self, key: object, row: int, a: int, b: int, ring: np.ndarray, front: np.ndarray,
              after: int | None = None) -> list[np.ndarray]:
        """Positions ``[a, b)`` of ``ring`` (row ``row``'s) as at the fence, in pieces;
        ``a`` must be the frontier ``front[row]``, which moves to ``after`` (None: ``b``).

        The live positions are copied *without* the lock (a writer preempted while
        holding it would stall the buffer's writes): positions announced as replaced
        meanwhile were copied aside before being overwritten (the frontier had not
        passed them), and their copies replace what was read of them; positions not
        announced by the end of the copy were not written during it.
        """
        after = b if after is None else after
        with self._lock:
            if a != front[row]:
                raise ShardReplayError(f"internal: fence {key!r}: read {a}..{b} out of order "
                                       f"(frontier {front[row]})")
            m0 = self._announced(row, a, b)
            parts = self._take_kept(key, a, m0)
        live = _ring(ring, m0, b) if b > m0 else None
        with self._lock:
            m1 = self._announced(row, a, b)
            if live is not None and m1 > m0:  # overwritten during the copy: take the copies
                fixed = self._take_kept(key, m0, m1)
                live[:m1 - m0] = np.concatenate(fixed) if len(fixed) > 1 else fixed[0]
            front[row] = after
            if key in self._kept:  # forget what is read
                self._kept[key] = [(s, d) for s, d in self._kept[key] if s + d.shape[0] > after]
        if live is not None:
            parts.append(live)
        return parts


class WriteFence(_CopiesAside):
    """The stored steps of user fields ``names`` of ``storage`` at this moment, kept
    readable from ``start[r]`` (an absolute step of each row) on. Frame-stacked fields
    are fenced by a :class:`FrameFence` each (their frame rings are overwritten by
    appends, not by step writes)."""

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
        super().__init__(self.hi - self.cap)
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
                    row, lo, hi = int(rows[k]), int(a[k]), int(b[k])
                    self._kept.setdefault((name, row), []).append((lo, _ring(self._row(name, row), lo, hi)))
                    self.copied_steps += hi - lo
            np.maximum.at(self._replaced, rows, end)

    def _row(self, name: str, row: int) -> np.ndarray:
        """Row ``row``'s ring of slots of field ``name``."""
        return self._arrays[name][row * self.cap:(row + 1) * self.cap]

    # -- the reader's side (the checkpoint's thread) -------------------------------------
    def read(self, name: str, row: int, a: int, b: int) -> np.ndarray:
        """The steps ``[a, b)`` of ``row`` of field ``name`` as they were at the fence;
        ``a`` must be the frontier (pieces are read in time order; see ``_read``)."""
        parts = self._read((name, row), row, a, b, self._row(name, row), self._front[name])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

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


class FrameFence(_CopiesAside):
    """The stacks of steps ``[start[r], hi[r])`` of each row ``r`` of ``store``'s field as
    at this moment (``hi``: the rows' positions now). Hooks itself into ``store`` until
    :meth:`release`."""

    def __init__(self, store: FrameStore, start: np.ndarray, hi: np.ndarray) -> None:
        self.store = store
        self.k = store.stack
        self.cap = store.stream_capacity
        self.start, self.hi = start.copy(), hi.copy()
        self.ref = store.ref.copy()  # slots are reused by later steps: their frames' positions now
        self.fhi = store.fpos.copy()
        rows = np.arange(hi.shape[0], dtype=np.int64)
        first = self.ref[rows * self.cap + self.start % self.cap] - self.k + 1
        self._front = np.where(self.start < self.hi, first, self.fhi)  # frames the reader still needs
        super().__init__(self.fhi - store.frame_capacity)
        self._released = False
        self.copied_frames = 0  # frames copied aside because a write reached them
        store.on_append = self.before_append

    # -- the writer's side -------------------------------------------------------------------
    def before_append(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Copy aside what appending ``counts[i].sum()`` frames to each row ``rows[i]``
        will replace and the reader still needs (the rings have their final size)."""
        store = self.store
        rows = np.asarray(rows, np.int64)
        added = np.asarray(counts, np.int64).reshape(rows.shape[0], -1).sum(axis=1)
        first = store.fpos[rows] - store.frame_capacity
        end = first + added
        with self._lock:
            if self._released:
                return
            # Not below replaced: those were copied already (a grown ring would now
            # map positions that no longer exist to free slots).
            a = np.maximum(np.maximum(first, self._replaced[rows]), self._front[rows])
            b = np.minimum(end, self.fhi[rows])
            for i in np.flatnonzero(b > a).tolist():
                row, lo, hi = int(rows[i]), int(a[i]), int(b[i])
                self._kept.setdefault(row, []).append((lo, _ring(store.frames[row], lo, hi)))
                self.copied_frames += hi - lo
            np.maximum.at(self._replaced, rows, end)

    # -- the reader's side -------------------------------------------------------------------
    def read(self, row: int, a: int, b: int) -> np.ndarray:
        """The stacks of steps ``[a, b)`` of ``row`` as at the fence (``[n, K, *frame]``);
        pieces of a row are read in time order (frames as :meth:`WriteFence.read` reads steps)."""
        cap, k = self.cap, self.k
        refs = self.ref[row * cap + np.arange(a, b, dtype=np.int64) % cap]
        fa, fb = int(refs[0]) - k + 1, int(refs[-1]) + 1
        nxt = int(self.ref[row * cap + b % cap]) - k + 1 if b < self.hi[row] else int(self.fhi[row])
        parts = self._read(row, row, fa, fb, self.store.frames[row], self._front, nxt)
        frames = np.concatenate(parts) if len(parts) > 1 else parts[0]
        idx = (refs - fa)[:, None] + np.arange(1 - k, 1, dtype=np.int64)[None, :]
        field = self.store.field
        return frames[idx].view(field.dtype).reshape(b - a, *field.shape)

    def ranges(self) -> list[tuple[int, int, int]]:
        """``(row, a, b)`` of pieces of at most ``PIECE_STEPS`` steps covering the fenced
        steps, in (row, time) order."""
        return [(r, a, min(a + PIECE_STEPS, hi))
                for r, (start, hi) in enumerate(zip(self.start.tolist(), self.hi.tolist(), strict=True))
                for a in range(start, hi, PIECE_STEPS)]

    def release(self) -> None:
        """The reader is done: appends stop copying, the copies are dropped."""
        with self._lock:
            self._released = True
            self._kept.clear()
            if self.store.on_append == self.before_append:
                self.store.on_append = None


def _ring(ring: np.ndarray, a: int, b: int) -> np.ndarray:
    """A copy of absolute positions ``[a, b)`` of one row's ring (at most two slices)."""
    f = ring.shape[0]
    s, n = a % f, b - a
    head = min(n, f - s)
    out = np.empty((n, *ring.shape[1:]), ring.dtype)
    out[:head] = ring[s:s + head]
    out[head:] = ring[:n - head]
    return out
