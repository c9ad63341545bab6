"""The write fence of a frame-stacked field: its stored stacks as they were at one
moment, readable while writes go on (see :mod:`shardreplay.buffer.fence`).

A frame-stacked field keeps one ring of frames per row (``storage/frames.py``): a step
records ``ref``, the absolute position of its newest frame, and its stack is the ``K``
frames ending there. At the fence each slot's ``ref`` is copied (the slots are
overwritten by later steps) and, per row, the frames the fenced steps use are known:
absolute positions ``[first frame of the oldest fenced step's stack, frames appended)``.
Frames are appended in order, so a write appending ``n`` frames to a ring of ``F``
replaces positions ``[fpos - F, fpos + n - F)`` and nothing else. The frame store calls
:meth:`FrameFence.before_append` before it appends (after a ring grew: growing copies,
it never replaces a frame), and the frames the reader still needs are copied aside
first: the same copy-on-overwrite, announcement and frontier as the plain fields',
counted in frames instead of steps.

Internal: not part of the public API.
"""

from __future__ import annotations

import threading

import numpy as np

from shardreplay.errors import ShardReplayError
from shardreplay.storage.frames import PIECE_STEPS, FrameStore


class FrameFence:
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
        # Frames below replaced[r] were announced as overwritten: read from the copies.
        self._replaced = self.fhi - store.frame_capacity
        self._kept: dict[int, list[tuple[int, np.ndarray]]] = {}
        self._lock = threading.Lock()
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
                row = int(rows[i])
                copy = _ring(store.frames, row, int(a[i]), int(b[i]))
                self._kept.setdefault(row, []).append((int(a[i]), copy))
                self.copied_frames += int(b[i] - a[i])
            np.maximum.at(self._replaced, rows, end)

    # -- the reader's side -------------------------------------------------------------------
    def read(self, row: int, a: int, b: int) -> np.ndarray:
        """The stacks of steps ``[a, b)`` of ``row`` as at the fence (``[n, K, *frame]``);
        pieces of a row are read in time order. Live frames are copied without the lock
        and checked after, as in :meth:`WriteFence.read <shardreplay.buffer.fence.WriteFence.read>`."""
        cap, k = self.cap, self.k
        refs = self.ref[row * cap + np.arange(a, b, dtype=np.int64) % cap]
        fa, fb = int(refs[0]) - k + 1, int(refs[-1]) + 1
        with self._lock:
            if fa != self._front[row]:
                raise ShardReplayError(f"internal: frame fence of {self.store.name!r} row {row}: read "
                                       f"{a}..{b} out of order")
            m0 = self._announced(row, fa, fb)
            parts = self._take_kept(row, fa, m0)
        live = _ring(self.store.frames, row, m0, fb) if fb > m0 else None  # one array, whichever
        with self._lock:
            m1 = self._announced(row, fa, fb)
            if live is not None and m1 > m0:  # overwritten during the copy: take the copies
                fixed = self._take_kept(row, m0, m1)
                live[:m1 - m0] = np.concatenate(fixed)
            nxt = int(self.ref[row * cap + b % cap]) - k + 1 if b < self.hi[row] else int(self.fhi[row])
            self._front[row] = nxt
            self._kept[row] = [(s, d) for s, d in self._kept.get(row, []) if s + d.shape[0] > nxt]
        if live is not None:
            parts.append(live)
        frames = np.concatenate(parts) if len(parts) > 1 else parts[0]
        idx = (refs - fa)[:, None] + np.arange(1 - k, 1, dtype=np.int64)[None, :]
        field = self.store.field
        return frames[idx].view(field.dtype).reshape(b - a, *field.shape)

    def _announced(self, row: int, a: int, b: int) -> int:
        return int(min(max(self._replaced[row], a), b))

    def _take_kept(self, row: int, a: int, m: int) -> list[np.ndarray]:
        out = []
        for start, data in self._kept.get(row, []):
            lo, hi = max(start, a), min(start + data.shape[0], m)
            if hi > lo:
                out.append(data[lo - start:hi - start])
        return out

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


def _ring(frames: np.ndarray, row: int, a: int, b: int) -> np.ndarray:
    """A copy of the frames at absolute positions ``[a, b)`` of ``row`` of a ring array
    ``frames [rows, F, frame bytes]`` (at most two slices)."""
    f = frames.shape[1]
    s, n = a % f, b - a
    head = min(n, f - s)
    out = np.empty((n, frames.shape[2]), frames.dtype)
    out[:head] = frames[row, s:s + head]
    out[head:] = frames[row, :n - head]
    return out
