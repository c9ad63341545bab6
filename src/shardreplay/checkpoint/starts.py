"""Restoring ``at_starts`` fields: their saved start rows go back beside the steps.

A part holds such a field as one row per saved step that could start a window when it
was saved (episode offset a multiple of the saving buffer's ``period``; every step when
that is 1), in saved order. A run of saved steps therefore maps to one contiguous range
of those rows: the restore reads it, keeps the rows of the steps that start windows
under the new buffer's ``period`` (which must be a multiple of the saved one, so every
new start has its row), and hands them to the session by slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardreplay.buffer.restore import RestoreSession
from shardreplay.checkpoint.refs import AnyPartReader
from shardreplay.errors import CheckpointFormatError

__all__ = ["read_starts", "start_mask"]


def start_mask(reader: AnyPartReader, period: int, steps: int) -> np.ndarray:
    """Whether each of the ``steps`` saved steps of a part saved with ``period`` has a
    start row (bool ``[steps]``).

    Raises:
        CheckpointFormatError: the part lacks its episode offsets, or they do not cover
            its steps.
    """
    if period == 1:
        return np.ones(steps, np.bool_)
    offsets = reader.array("episode_step")
    if offsets.shape != (steps,):
        raise CheckpointFormatError(f"{reader.path}: episode_step does not cover the {steps} saved steps")
    return np.asarray(offsets % period == 0)


def read_starts(readers: Sequence[AnyPartReader], periods: Sequence[int],
                runs: Sequence[tuple[int, int, int, int]], session: RestoreSession) -> None:
    """Read the start rows of the ``at_starts`` fields for ``runs`` of saved steps
    (``(part, first saved step, first flat slot, steps)`` each, as for frame stacks) and
    place those of the new buffer's start steps (``session.place_starts``).

    Raises:
        CheckpointFormatError: a part was saved with a period that the new one is not a
            multiple of, or its arrays are missing, short or corrupt.
    """
    stores = session.start_fields()
    if not stores:
        return
    new_period = session.period
    masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for part in sorted({run[0] for run in runs}):
        reader, period = readers[part], periods[part]
        if new_period % period:
            raise CheckpointFormatError(
                f"{reader.path}: saved with period={period}, so its start fields "
                f"{sorted(stores)} hold rows only every {period} steps of an episode; restore it into "
                f"a buffer whose period is a multiple of {period} (this one has {new_period})")
        steps = int(reader.array("row_length").sum())
        mask = start_mask(reader, period, steps)
        masks[part] = (mask, np.concatenate([[0], np.cumsum(mask)]))
    for name, field in stores.items():
        slots, values = [], []
        for part, first, lo, n in runs:
            mask, before = masks[part]
            rows = np.empty((int(before[first + n] - before[first]), *field.shape), field.dtype)
            readers[part].rows_into(f"field.{name}", int(before[first]), rows)
            slots.append(lo + np.flatnonzero(mask[first:first + n]))
            values.append(rows)
        session.place_starts(name, np.concatenate(slots) if slots else np.zeros(0, np.int64),
                             np.concatenate(values) if values else np.zeros((0, *field.shape), field.dtype))
