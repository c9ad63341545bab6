"""Sequence windows: starts only every ``period`` steps of an episode (docs/semantics.md,
"Sequence windows").

The compiled write and validity kernels decide rule 1 as for any window; the functions
here then set the episode offsets (``episode_step``) of the written steps and clear the
starts off the grid, in numpy passes over the written and recomputed slots only, so the
cost of a write does not grow with capacity.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class SequenceStorage(Protocol):
    """The parts of a ``StreamStorage`` the sequence bookkeeping reads and writes."""

    period: int
    stream_capacity: int
    pos: np.ndarray
    episode_id: np.ndarray
    episode_step: np.ndarray
    valid: np.ndarray

    def stored_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat slots of the stored steps (row, time order) and row lengths."""


def previous_steps(storage: SequenceStorage, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Episode id and episode offset of the stored step before the next write of each
    of ``rows`` (id -1 where the row is empty). Read before the write: a chunk of
    ``stream_capacity`` steps overwrites that slot."""
    cap = storage.stream_capacity
    p0 = storage.pos[rows]
    prev = rows * cap + (p0 - 1) % cap
    ids = np.where(p0 > 0, storage.episode_id[prev], -1)
    offsets = np.where(p0 > 0, storage.episode_step[prev], -1).astype(np.int64)
    return ids, offsets


def after_write(storage: SequenceStorage, before: tuple[np.ndarray, np.ndarray], written: np.ndarray,
                recomputed: np.ndarray, valid: np.ndarray, newly: np.ndarray) -> int:
    """Set the episode offsets of the ``written`` slots ``[rows, T]`` (their episode ids
    are already written), then clear the starts among ``recomputed`` that are off the
    period grid (in storage and in the ``valid``/``newly`` flags the sampler is told).

    Returns:
        How many starts were cleared (the caller's count of valid starts drops by it).
    """
    prev_ids, prev_offsets = before
    ids = storage.episode_id[written]
    t_len = ids.shape[1]
    if t_len:
        earlier = np.concatenate([prev_ids[:, None], ids[:, :-1]], axis=1)
        steps = np.arange(t_len)
        # The last step of each row that began an episode (-1: the row's episode goes on).
        began = np.maximum.accumulate(np.where(ids != earlier, steps, -1), axis=1)
        offsets = np.where(began >= 0, steps - began, prev_offsets[:, None] + 1 + steps)
        storage.episode_step[written] = offsets
    off_grid = valid & (storage.episode_step[recomputed] % storage.period != 0)
    n = int(off_grid.sum())
    if n:
        storage.valid[recomputed[off_grid]] = False
        valid[off_grid] = False
        newly[off_grid] = False
    return n


def off_grid(storage: SequenceStorage) -> int:
    """Clear every valid start off the period grid (after validity was rebuilt from the
    bookkeeping, e.g. by a restore); returns how many were cleared."""
    slots, _lengths = storage.stored_slots()
    bad = slots[storage.valid[slots] & (storage.episode_step[slots] % storage.period != 0)]
    storage.valid[bad] = False
    return int(bad.shape[0])
