"""Restoring frame-stacked fields: their saved stacks go back into frame rings.

A checkpoint stores a frame-stacked field as whole stacks per step (the format of every
other field), so any layout can read it. Restoring reads them in bounded pieces, row by
row in time order, and stores each frame once again (``FrameStore.load_row``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardreplay.buffer.restore import RestoreSession
from shardreplay.checkpoint.refs import AnyPartReader

# Steps read per piece: bounds the temporary stacks (84x84x4 uint8: ~28 MiB).
PIECE_STEPS = 1024


def read_stacks(readers: Sequence[AnyPartReader], runs: Sequence[tuple[int, int, int, int]],
                session: RestoreSession) -> None:
    """Fill the frame rings of the shard ``session`` restores from ``runs`` of saved steps.

    Each run is ``(part, first saved step, first flat slot, steps)``, and must not cross
    the end of its row's ring. The runs must come in (row, time) order of the storage:
    a row's frames are kept in time order (the oldest are the ones a later write
    overwrites).

    Raises:
        CheckpointFormatError: a block of a part is missing or corrupt.
    """
    stores = session.frame_stores()
    if not stores:
        return
    cap = session.stream_capacity
    for name, store in stores.items():
        store.clear()
        prev_slot = -2
        for part, first, lo, n in runs:
            for off in range(0, n, PIECE_STEPS):
                m = min(PIECE_STEPS, n - off)
                values = np.empty((m, *store.field.shape), store.field.dtype)
                readers[part].rows_into(f"field.{name}", first + off, values)
                slot = lo + off
                row = slot // cap
                # The step before continues this one's stack only when it is the previous
                # slot of the same row (the ring's end wraps to slot 0 of the row).
                before = slot - 1 if slot % cap else slot + cap - 1
                store.load_row(row, np.arange(slot, slot + m, dtype=np.int64), values,
                               prev_slot if prev_slot == before else -1)
                prev_slot = slot + m - 1
