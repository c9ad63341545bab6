"""FrameStore: a frame-stacked field kept as one ring of frames per stream (the rules:
docs/semantics.md, "Frame-stacked fields"; the rings: docs/internals.md, "Frame rings")."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from shardreplay.errors import SpecMismatchError
from shardreplay.kernels.lazy import lazy
from shardreplay.spec import Field
from shardreplay.storage.allocate import ArrayAllocator

if TYPE_CHECKING:
    from shardreplay.kernels import frames as fk
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    fk = lazy("shardreplay.kernels.frames")

# Steps per piece of lazily built stacks (84x84x4 uint8: ~28 MiB).
PIECE_STEPS = 1024
# Growth of a ring that has not wrapped (free) and of a wrapped one (it moves frames); why:
# docs/internals.md, "Frame rings".
SLACK = 16
GROWTH = 1.25


def initial_frame_capacity(stream_capacity: int, stack: int) -> int:
    """Frames per stream at first: one per step and the oldest step's stack."""
    return stream_capacity + stack - 1


class FrameStore:
    """The frames of one ``frame_stack`` field of a :class:`StreamStorage`.

    Arguments are those of the owning storage; ``name`` names the field (for errors
    and memory-mapped file names).
    """

    def __init__(self, name: str, field: Field, num_streams: int, stream_capacity: int,
                 allocator: ArrayAllocator) -> None:
        self.name = name
        self.field = field
        self.stack = field.shape[0]
        self.frame_bytes = int(field.dtype.itemsize * math.prod(field.shape[1:]))
        self.num_streams = num_streams
        self.stream_capacity = stream_capacity
        # The most frames a ring can need, plus one: every ring is then a view of fewer
        # frames than a row of the allocation, whatever it grows to, so its type (layout)
        # stays the one compiled kernels were given.
        self._most = self.stack * stream_capacity
        self._reserve = allocator.reserve(f"frames.{name}", (num_streams, self._most + 1, self.frame_bytes),
                                          np.dtype(np.uint8))
        self.frames = self._reserve[:, :min(initial_frame_capacity(stream_capacity, self.stack), self._most)]
        self.ref = np.zeros(num_streams * stream_capacity, np.int64)
        self.fpos = np.zeros(num_streams, np.int64)  # frames appended per stream, ever
        self._counts = np.empty((num_streams, 1), np.int64)  # plan_write's scratch

    @property
    def frame_capacity(self) -> int:
        """Frames each stream's ring holds now."""
        return int(self.frames.shape[1])

    def written(self) -> list[np.ndarray]:
        """Each stream's ring up to its last frame written (all of it once it wrapped)."""
        return [self._reserve[r, :min(int(p), self.frame_capacity)] for r, p in enumerate(self.fpos)]

    def as_frame_bytes(self, values: np.ndarray, lead: int) -> np.ndarray:
        """Stacks ``[n, T, K, *frame]`` (``[n, K, *frame]`` when ``lead``, T, is 1) as
        C-contiguous uint8 ``[n, T, K, frame bytes]``."""
        values = np.ascontiguousarray(values)
        return values.reshape(values.shape[0], lead, self.stack, -1).view(np.uint8)

    def plan(self, values: np.ndarray, types: np.ndarray, rows: np.ndarray, pos: np.ndarray,
             step_type: np.ndarray) -> np.ndarray:
        """Check a write of stacks ``values`` (uint8 ``[n, T, K, frame bytes]``) and grow
        the rings when it needs more room. Returns the frames each step appends.

        Raises:
            SpecMismatchError: a step continuing its episode whose stack does not continue
                the previous step's; nothing is written or changed.
        """
        n, t_len = values.shape[:2]
        if self._counts.shape != (n, t_len):
            self._counts = np.empty((n, t_len), np.int64)
        status, i, t, need = fk.plan_write(values, types, rows, pos, step_type, self.ref, self.frames,
                                           self.fpos, self.stream_capacity, self._counts)
        if status == fk.INCONSISTENT:
            raise SpecMismatchError(
                f"field {self.name!r} is frame-stacked: the stack of stream {int(rows[i])} at step "
                f"{int(pos[rows[i]]) + int(t)} continues its episode, so its first {self.stack - 1} "
                f"frames must be the previous step's last {self.stack - 1} (oldest frame first, on "
                "axis 0); they differ. Mark the step FIRST if an episode starts there, or fix the "
                "frame order. Nothing was written.")
        if need > self.frame_capacity:
            self.grow(int(need))
        return self._counts

    def append(self, values: np.ndarray, rows: np.ndarray, written: np.ndarray, counts: np.ndarray) -> None:
        """Append the frames planned by :meth:`plan` for steps written to flat slots
        ``written`` (row-major ``[n * T]``)."""
        fk.append_frames(values, rows, written, counts, self.frames, self.ref, self.fpos)

    def grow(self, need: int) -> None:
        """Make every stream's ring hold at least ``need`` frames (and ``1/SLACK`` more
        while no ring has wrapped, else ``GROWTH`` times more than now; at most ``K`` per
        step), keeping each stream's last frames at their positions: in place, moving
        only the frames of a wrapped ring whose position changes."""
        old = self.frames
        cap = old.shape[1]
        more = need + need // SLACK if int(self.fpos.max()) <= cap else int(cap * GROWTH) + 1
        new_cap = max(int(need), min(more, self._most))
        new = self._reserve[:, :new_cap]
        for r in range(old.shape[0]):
            end = int(self.fpos[r])
            if end <= cap:  # not wrapped: every frame keeps its place (no index arrays)
                continue
            keep = np.arange(max(end - cap, 0), end)  # frames p < end - cap are gone
            keep = keep[keep % cap != keep % new_cap]
            if keep.shape[0]:
                new[r, keep % new_cap] = old[r, keep % cap]  # the source is gathered first
        self.frames = new

    def gather_into(self, idx: np.ndarray, dst_rows: np.ndarray, out: np.ndarray, offset: int) -> None:
        """Stacks of the windows of slots ``idx[B, L]`` into rows ``dst_rows`` of packed
        uint8 records ``out`` at byte ``offset``."""
        fk.gather_stacks_rows(idx, self.stream_capacity, self.ref, self.frames, self.stack, dst_rows, out,
                              offset)

    def gather(self, idx: np.ndarray) -> np.ndarray:
        """Stacks of slots ``idx`` (any shape) as ``[*idx.shape, K, *frame]``."""
        # The window is the product of the trailing axes (stated, not inferred with -1,
        # which numpy cannot do for no slots: an empty buffer's state).
        window = int(np.prod(idx.shape[1:], dtype=np.int64))
        flat = np.ascontiguousarray(idx, np.int64).reshape(idx.shape[0] if idx.ndim else 1, window)
        out = np.empty((flat.shape[0], window * self.stack * self.frame_bytes), np.uint8)
        fk.gather_stacks_rows(flat, self.stream_capacity, self.ref, self.frames, self.stack,
                              np.arange(flat.shape[0], dtype=np.int64), out, 0)
        return out.view(self.field.dtype).reshape(*idx.shape, *self.field.shape)

    def clear(self) -> None:
        """Forget every frame."""
        self.fpos[:] = 0
        self.ref[:] = 0

    def load_row(self, row: int, slots: np.ndarray, values: np.ndarray, prev_slot: int) -> None:
        """Store the stacks ``values [n, K, *frame]`` of consecutive steps of ``row`` at
        flat ``slots``: a checkpoint or state being restored, after :meth:`clear`, each
        row's steps in time order (over one or more calls; ``prev_slot`` is the slot of
        the step before them, or -1 for a row's first step)."""
        if not slots.shape[0]:
            return
        data = np.ascontiguousarray(values).reshape(1, slots.shape[0], self.stack, -1).view(np.uint8)
        counts = np.empty((1, slots.shape[0]), np.int64)
        added = fk.plan_load(data[0], row, self.frames, self.ref, prev_slot, counts[0])
        need = int(self.fpos[row]) + int(added)  # a row's frames start at 0 after clear()
        if need > self.frame_capacity:
            self.grow(need)
        fk.append_frames(data, np.array([row], np.int64), np.ascontiguousarray(slots, np.int64), counts,
                         self.frames, self.ref, self.fpos)


class StackPieces:
    """The stacks of some slots of a :class:`FrameStore`, built only when converted to an
    array (``np.asarray``): a checkpoint writes a shard's stacks piece by piece instead
    of holding all of them (four times the frames) at once.

    Has ``shape``, ``dtype``, ``size`` and ``nbytes`` like the array it stands for. The
    stacks are read when converted: the storage must not be written before that.
    """

    def __init__(self, store: FrameStore, slots: np.ndarray) -> None:
        self._store, self._slots = store, slots
        self.shape = (int(slots.shape[0]), *store.field.shape)
        self.dtype = store.field.dtype
        self.ndim = len(self.shape)
        self.size = int(math.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        arr = self._store.gather(self._slots)
        return arr if dtype is None else arr.astype(dtype, copy=False)

    @classmethod
    def split(cls, store: FrameStore, slots: np.ndarray) -> list[StackPieces]:
        """Pieces of at most ``PIECE_STEPS`` steps covering ``slots`` in order."""
        return [cls(store, slots[i:i + PIECE_STEPS]) for i in range(0, slots.shape[0], PIECE_STEPS)]
