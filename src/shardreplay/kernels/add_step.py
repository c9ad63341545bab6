"""The compiled one-step add: every check and write of ``ReplayBuffer.add`` of one step
of every stream, in one call (storage/one_step.py holds the plan that calls it).

The values come as separate arguments (``*values``): each is typed by numba's
dispatcher in its C fast path, and a dispatcher compiled for the stored dtypes only
(:func:`compiled_add_step`) refuses anything else with ``TypeError``, so the types
numba reads at dispatch are the dtype and layout check; the shapes and values are
checked here before anything is written.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import literal_unroll, types
from numba.extending import overload

from shardreplay.kernels.copy import copy_small_or_at
from shardreplay.kernels.storage import write_steps
from shardreplay.kernels.validate import STEPS_OK, steps_ok

# The int64 ``state`` array: a header (the priority of new steps as float64 bits), then
# per field ``FIELD_WORDS`` words, then the rows 0 .. S-1, the result scratch
# ``[4, S * window]`` and the discounts of the step (float32, ``ceil(S / 2)`` words).
# ``CHECK_ONLY``: 1 to check and return without writing (a caller with frame stacks plans
# them between the check and the write).
CAP, WINDOW, ROWS, FIELDS, PRIORITY, CHECK_ONLY, PLAN = 0, 1, 2, 3, 4, 5, 6
MAX_FIELD_NDIM = 8
# Per field: byte offset in the record (-1: a field of its own array, written by the
# caller), bytes per row, whether it must be finite, then the field's own shape.
OFFSET, ROW_BYTES, FINITE, DIMS = 0, 1, 2, 3
FIELD_WORDS = DIMS + MAX_FIELD_NDIM
BAD_INPUT = -1  # what the kernel returns (with 0) when an input fails a check
_NO_PRIORITIES = np.zeros((1, 1), np.float32)
# The same bookkeeping as every other write, inlined here: a call passing its sixteen
# arguments costs about as much as the work of one step (their reference counts).
_write_steps = numba.njit(nogil=True, inline="always")(write_steps.py_func)
_FIXED_ARGS = 4  # the arguments of add_step before *values


def _all_finite(values: Any) -> bool:  # pragma: no cover - replaced when compiled
    """No NaN or inf among ``values`` (integers: always)."""
    return bool(np.isfinite(values).all())


@overload(_all_finite)
def _all_finite_compiled(values):  # pragma: no cover - compiling
    if isinstance(values.dtype, types.Float):
        def impl(values):
            for x in values.reshape(values.size):  # noqa: SIM110 - a view (C order), not a copy
                if not np.isfinite(x):
                    return False
            return True
        return impl
    return lambda values: True


@numba.njit(cache=True, nogil=True)
def state_parts(n_rows: int, n_fields: int, window: int) -> tuple[int, int, int, int]:
    """Where the rows, the result scratch and the discounts start in ``state``, and its
    length (in int64 words)."""
    rows_at = PLAN + FIELD_WORDS * n_fields
    out_at = rows_at + n_rows
    discount_at = out_at + 4 * n_rows * window
    return rows_at, out_at, discount_at, discount_at + (n_rows + 1) // 2


def add_step(records, pos_and_counters, state, step_types, *values):  # pragma: no cover - compiled
    """Check one step of every stream, then write it: the bookkeeping
    (``kernels.storage.write_steps``), the discount and every field held in ``records``.

    ``values`` are the user fields in spec order, each ``[S, *shape]`` C-contiguous in
    its stored dtype; ``step_types`` is ``[S]``; ``pos_and_counters`` is the storage's
    positions ``[S]`` then its counters; ``state`` (int64) is laid out as the constants
    above and :func:`state_parts` say. The arguments are few on purpose: each costs the
    dispatcher time on every call.

    Returns ``(n_out, delta)`` as ``write_steps`` (the written slots are in row 0 of the
    scratch; ``(0, 0)`` when ``state[CHECK_ONLY]``), or ``(BAD_INPUT, 0)`` with nothing
    changed when a shape, a value of a finite field, a step type or a discount is wrong
    (the caller's full check then says which)."""
    n_rows, window = state[ROWS], state[WINDOW]
    rows_at, out_at, discount_at, end = state_parts(n_rows, state[FIELDS], window)
    discount = state[discount_at:end].view(np.float32)[:n_rows]
    if step_types.shape[0] != n_rows:
        return BAD_INPUT, 0
    j = PLAN
    for v in literal_unroll(values):
        if v.shape[0] != n_rows:
            return BAD_INPUT, 0
        for d in range(1, v.ndim):
            if v.shape[d] != state[j + DIMS + d - 1]:
                return BAD_INPUT, 0
        if state[j + FINITE] and not _all_finite(v):
            return BAD_INPUT, 0
        j += FIELD_WORDS
    if steps_ok(step_types, discount) != STEPS_OK:
        return BAD_INPUT, 0
    if state[CHECK_ONLY]:
        return 0, 0
    out = state[out_at:discount_at].reshape(4, n_rows * window)
    default_prio = state[PRIORITY:PRIORITY + 1].view(np.float64)[0]
    n_out, delta = _write_steps(records.step_type, records.episode_id, records.generation, records.priority,
                                records.valid, pos_and_counters[:n_rows], pos_and_counters[n_rows:],
                                state[rows_at:out_at], step_types.reshape(n_rows, 1), _NO_PRIORITIES, False,
                                default_prio, state[CAP], window, out[:2], out[2:])
    disc_store = records.discount
    record_bytes = records.strides[0]
    for i in range(n_rows):
        disc_store[out[0, i]] = discount[i]
    j = PLAN
    for v in literal_unroll(values):
        offset, size = state[j + OFFSET], state[j + ROW_BYTES]
        if offset >= 0:
            for i in range(n_rows):
                copy_small_or_at(records, out[0, i] * record_bytes + offset, v, i * size, size)
        j += FIELD_WORDS
    return n_out, delta


def compiled_add_step(args: tuple[Any, ...]) -> Any:
    """A dispatcher of :func:`add_step` compiled (or loaded from numba's cache) for
    arguments of the types of ``args`` only: arguments of any other type raise
    ``TypeError`` at dispatch, and nothing more is compiled."""
    fixed = [numba.typeof(x) for x in args[:_FIXED_ARGS]]
    values = numba.typeof(tuple(args[_FIXED_ARGS:]))  # the C dispatcher passes *values so
    dispatcher = numba.njit(cache=True, nogil=True)(add_step)
    dispatcher.compile((*fixed, values))
    dispatcher.disable_compile()
    return dispatcher
