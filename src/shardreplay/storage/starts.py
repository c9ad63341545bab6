"""StartStore: ``at_starts`` fields kept once per window start, not once per step
(docs/semantics.md, "Start-state fields"; the rings: docs/internals.md, "Start rows")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from shardreplay.errors import ShardReplayError
from shardreplay.spec import Field
from shardreplay.storage.allocate import ArrayAllocator

__all__ = ["StartStore", "initial_start_capacity"]

# Steps per episode that the first allocation has room for (one extra start each);
# shorter episodes on average make the rings grow.
STEPS_PER_EPISODE = 64
GROWTH = 1.25


def initial_start_capacity(stream_capacity: int, period: int) -> int:
    """Start rows per stream at first: one per ``period`` steps, one more per
    ``STEPS_PER_EPISODE`` steps (an episode's first step breaks the grid) and one for
    the oldest stored episode; never more than one per step."""
    per_grid = math.ceil(stream_capacity / period)
    return min(stream_capacity, per_grid + math.ceil(stream_capacity / STEPS_PER_EPISODE) + 1)


class StartStore:
    """The start rows of the ``at_starts`` ``fields`` (by name) of a :class:`StreamStorage`.

    The other arguments are those of the owning storage.
    """

    def __init__(self, fields: Mapping[str, Field], num_streams: int, stream_capacity: int, period: int,
                 allocator: ArrayAllocator) -> None:
        self.fields = dict(fields)
        self.num_streams = num_streams
        self.stream_capacity = stream_capacity
        self.row_bytes = {name: int(f.dtype.itemsize * math.prod(f.shape)) for name, f in self.fields.items()}
        self._allocator = allocator
        self._grown = 0
        rows = initial_start_capacity(stream_capacity, period)
        self.values = {name: allocator.zeros(f"starts.{name}", (num_streams, rows, *f.shape), f.dtype)
                       for name, f in self.fields.items()}
        self._capacity = rows
        # Per slot: the absolute number of its start row in its stream, -1 off the starts
        # (nothing without at_starts fields: other specs keep their memory use).
        self.ref = np.full(num_streams * stream_capacity if self.fields else 0, -1, np.int64)
        self.count = np.zeros(num_streams, np.int64)  # start rows appended per stream, ever
        self.live = np.zeros(num_streams, np.int64)  # start rows of the stored steps

    @property
    def capacity(self) -> int:
        """Start rows each stream's ring holds now."""
        return self._capacity

    @property
    def nbytes(self) -> int:
        """Bytes of the rings and the per-slot references."""
        return int(sum(v.nbytes for v in self.values.values()) + self.ref.nbytes + self.count.nbytes
                   + self.live.nbytes)

    def write(self, values: Mapping[str, np.ndarray], rows: np.ndarray, written: np.ndarray,
              is_start: np.ndarray) -> None:
        """Keep the values ``[n, T, *shape]`` of each field of the steps just written to
        flat slots ``written`` ``[n, T]`` of distinct ``rows`` where ``is_start`` ``[n, T]``;
        forget the start rows of the steps they replaced."""
        replaced = (self.ref[written] >= 0).sum(axis=1)
        added = is_start.sum(axis=1)
        live = self.live[rows] + added - replaced
        need = int(live.max(initial=0))
        if need > self.capacity:
            self.grow(need)
        absolute = self.count[rows][:, None] + np.cumsum(is_start, axis=1) - 1
        self.ref[written] = np.where(is_start, absolute, -1)
        at_row, at_t = np.nonzero(is_start)
        if at_row.shape[0]:
            dst = (rows[at_row], absolute[at_row, at_t] % self.capacity)
            for name, arr in self.values.items():
                arr[dst] = values[name].reshape(*written.shape, *self.fields[name].shape)[at_row, at_t]
        self.count[rows] += added
        self.live[rows] = live

    def grow(self, need: int) -> None:
        """Make every stream's ring hold at least ``need`` rows (and ``GROWTH`` times more
        than now, up to one per step), keeping each stream's live rows."""
        cap = self.capacity
        new_cap = max(int(need), min(int(cap * GROWTH) + 1, self.stream_capacity))
        self._grown += 1
        for name, old in self.values.items():
            new = self._allocator.zeros(f"starts.{name}.{self._grown}",
                                        (old.shape[0], new_cap, *old.shape[2:]), old.dtype)
            for r in range(old.shape[0]):
                end = int(self.count[r])
                keep = np.arange(end - int(self.live[r]), end)
                new[r, keep % new_cap] = old[r, keep % cap]
            self.values[name] = new
            if isinstance(old, np.memmap) and old.filename:
                Path(old.filename).unlink(missing_ok=True)  # the old ring's file (mapped until freed)
        self._capacity = new_cap

    def gather(self, name: str, starts: np.ndarray) -> np.ndarray:
        """Field ``name`` of the start steps at flat slots ``starts`` ``[B]`` as ``[B, *shape]``.

        Raises:
            ShardReplayError: a slot is not a start step (an internal error: only window
                starts are sampled).
        """
        starts = np.asarray(starts, np.int64)
        absolute = self.ref[starts]
        if absolute.shape[0] and int(absolute.min()) < 0:
            raise ShardReplayError(f"internal: field {name!r}: a sampled window starts at a step "
                                   "that holds no start row")
        return self.values[name][starts // self.stream_capacity, absolute % self.capacity]

    def gather_into(self, name: str, starts: np.ndarray, dst_rows: np.ndarray, out: np.ndarray,
                    offset: int) -> None:
        """:meth:`gather` into rows ``dst_rows`` of packed uint8 records ``out`` at byte ``offset``."""
        rows = np.ascontiguousarray(self.gather(name, starts)).reshape(starts.shape[0], -1).view(np.uint8)
        out[dst_rows, offset:offset + self.row_bytes[name]] = rows

    def export(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Field ``name`` of the start steps among the stored steps at ``slots`` (in their
        order) ``[k, *shape]``."""
        return self.gather(name, slots[self.ref[slots] >= 0])

    def clear(self) -> None:
        """Forget every start row."""
        self.ref[:] = -1
        self.count[:] = 0
        self.live[:] = 0

    def load(self, slots: np.ndarray, lengths: np.ndarray, is_start: np.ndarray,
             values: Mapping[str, np.ndarray]) -> None:
        """Forget every start row, then keep ``values[name]`` ``[k, *shape]`` as the start
        rows of the stored steps at ``slots`` (row by row in time order, ``lengths`` per
        row) where ``is_start`` holds (``k`` of them, in the same order)."""
        self.clear()
        row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
        at = np.flatnonzero(is_start)
        per_row = np.bincount(row_of[at], minlength=lengths.shape[0]).astype(np.int64)
        need = int(per_row.max(initial=0))
        if need > self.capacity:
            self.grow(need)
        first = np.concatenate([[0], np.cumsum(per_row)])[:-1]
        absolute = np.arange(at.shape[0]) - first[row_of[at]]
        self.ref[slots[at]] = absolute
        for name, arr in self.values.items():
            arr[row_of[at], absolute % self.capacity] = values[name]
        self.count[:lengths.shape[0]] = per_row
        self.live[:lengths.shape[0]] = per_row
