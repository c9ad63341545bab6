"""The compiled one-step add of a spec with one frame-stacked field, in one call: check,
the stacks checked against the stored ones, write, frames appended; nothing is written
before every check passed. Its four steps and ``fstate``'s layout: docs/internals.md,
"One-step writes".
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from shardreplay.kernels.add_step import (
    AT_STEP_TYPE,
    CHECK_ONLY,
    FIELDS,
    N_OUT,
    ROWS,
    WINDOW,
    add_step,
    compiled_for,
    state_parts,
)
from shardreplay.kernels.cache_lock import SMALL_CALL  # numba's cache, safe across processes
from shardreplay.kernels.codes import ADD_STEP_BAD_INPUT as BAD_INPUT
from shardreplay.kernels.codes import ADD_STEP_NEED_FRAMES as NEED_FRAMES
from shardreplay.kernels.copy import _byte_pointer, _check_arrays, copy_at

__all__ = ["BAD_INPUT", "F_CAP", "F_DIMS", "F_FRAME_BYTES", "F_NDIM", "F_STACK", "NEED_FRAMES",
           "compiled_add_stacked", "fstate_of"]

F_CAP, F_STACK, F_FRAME_BYTES, F_NDIM, F_DIMS = 0, 1, 2, 3, 4
FIRST, LAST = 0, 2


def _loader(bits: int) -> Any:
    """An intrinsic reading an unsigned integer of ``bits`` at a byte offset of an array
    (unaligned: frames start at any byte)."""
    @intrinsic
    def load(typingctx, array, offset):  # pragma: no cover - compiled
        _check_arrays(array)

        def codegen(context, builder, signature, args):
            ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1])
            return builder.load(builder.bitcast(ptr, ir.IntType(bits).as_pointer()), align=1)
        return getattr(types, f"uint{bits}")(array, types.intp), codegen
    return load


_u64_at, _u8_at = _loader(64), _loader(8)


@numba.njit(cache=True, nogil=True, inline="always")
def _bytes_equal(a, a_off, b, b_off, n):  # pragma: no cover - compiled
    """Bytes ``a[a_off:a_off+n]`` equal ``b[b_off:b_off+n]`` (8 at a time, no early exit:
    the loop vectorises)."""
    diff = numba.uint64(0)
    whole = n - n % 8
    for x in range(0, whole, 8):
        diff |= _u64_at(a, a_off + x) ^ _u64_at(b, b_off + x)
    for x in range(whole, n):
        diff |= numba.uint64(_u8_at(a, a_off + x) ^ _u8_at(b, b_off + x))
    return diff == 0


@numba.njit(**SMALL_CALL)
def add_stacked(records, pos_and_counters, state, ref, frames, fpos, fstate, discount, step_types, stack,
                values):  # pragma: no cover - compiled
    """Check and write one step of every stream of a spec with one frame-stacked field
    (``stack``: ``[S, K, *frame]``, C-contiguous, its stored dtype) and the plain fields
    ``values`` (``discount`` and these as :func:`~shardreplay.kernels.add_step.add_step`). ``ref``, ``frames``
    (uint8 ``[S, F, frame bytes]``) and ``fpos`` are the field's ``FrameStore`` arrays.

    Returns the change in valid starts (added to the storage's count, as add_step
    does); :data:`BAD_INPUT` with nothing changed for an input the full path must judge
    (it raises the error, or converts the input); or :data:`NEED_FRAMES` with nothing
    changed and the frames each ring must hold in ``state[N_OUT]``."""
    n_rows = state[ROWS]
    ndim = fstate[F_NDIM]
    if stack.ndim != ndim or stack.shape[0] != n_rows:
        return BAD_INPUT
    for d in range(1, ndim):
        if stack.shape[d] != fstate[F_DIMS + d - 1]:
            return BAD_INPUT
    state[CHECK_ONLY] = 1
    checked = add_step(records, records, pos_and_counters, state, discount, step_types, values)
    state[CHECK_ONLY] = 0
    if checked == BAD_INPUT:
        return BAD_INPUT
    cap, k, fb = fstate[F_CAP], fstate[F_STACK], fstate[F_FRAME_BYTES]
    counts = fstate[F_DIMS + ndim - 1:]
    rows_at, out_at, _discount_at, _end = state_parts(n_rows, state[FIELDS], state[WINDOW])
    record_bytes = records.shape[1]
    at_step_type = state[AT_STEP_TYPE]
    cap_frames = frames.shape[1]
    row_stride, frame_stride = frames.strides[0], frames.strides[1]
    need = 0
    for i in range(n_rows):  # plan_write's rule, for one step per stream
        r = state[rows_at + i]
        p0 = pos_and_counters[r]
        prev_slot = r * cap + (p0 - 1) % cap
        same = p0 > 0
        if same:
            first = ref[prev_slot] - k + 2
            for j in range(k - 1):  # a reset stack differs in its first frame: one compared
                same = _bytes_equal(stack, (i * k + j) * fb, frames,
                                    r * row_stride + ((first + j) % cap_frames) * frame_stride, fb)
                if not same:
                    break
            prev_type = _u8_at(records, prev_slot * record_bytes + at_step_type)
            if not same and step_types[i] != FIRST and prev_type != LAST:
                return BAD_INPUT  # the full path names the stream and step
        counts[i] = 1 if same else k
        q = max(p0 + 1 - cap, 0)  # the oldest step stored after the write
        oldest_frame = fpos[r] + counts[i] - k if q >= p0 else ref[r * cap + q % cap] - k + 1
        need = max(need, fpos[r] + counts[i] - oldest_frame)
    if need > cap_frames:
        state[N_OUT] = need
        return NEED_FRAMES
    delta = add_step(records, records, pos_and_counters, state, discount, step_types, values)
    for i in range(n_rows):  # append_frames
        r = state[rows_at + i]
        p = fpos[r]
        for j in range(k - counts[i], k):
            copy_at(frames, r * row_stride + (p % cap_frames) * frame_stride, stack, (i * k + j) * fb, fb)
            p += 1
        ref[state[out_at + i]] = p - 1
        fpos[r] = p
    return delta


# The one entry point, whatever the number of plain fields (RESULTS-inputs.md, "Pixels
# without spikes": an entry per arity saved only the tuple ``*values`` makes).
@numba.njit(**SMALL_CALL)
def add_stacked_n(records, pos_and_counters, state, ref, frames, fpos, fstate, discount, step_types,
                  stack, *values):  # pragma: no cover - compiled
    """:func:`add_stacked` with any number (>= 1) of plain fields."""
    return add_stacked(records, pos_and_counters, state, ref, frames, fpos, fstate, discount, step_types,
                       stack, values)


def fstate_of(stream_capacity: int, frame_bytes: int, stack_shape: tuple[int, ...]) -> np.ndarray:
    """The ``fstate`` array of a field whose steps' stacks are ``stack_shape``
    (``[S, K, *frame]``); see the module docstring."""
    n_rows, ndim = stack_shape[0], len(stack_shape)
    return np.array([stream_capacity, stack_shape[1], frame_bytes, ndim, *stack_shape[1:]]
                    + [0] * n_rows, np.int64)


def compiled_add_stacked(args: tuple[Any, ...]) -> Any:
    """A dispatcher of :func:`add_stacked` compiled (or loaded from numba's cache) for
    arguments of the types of ``args`` only (others raise ``TypeError`` at dispatch);
    ``args`` = (records as uint8 rows, positions and counters, state, ref, frames, fpos,
    fstate, discounts, step types, stack, *plain values), at least one plain value."""
    if len(args) < 11:
        raise ValueError("compiled_add_stacked needs at least one plain field")
    return compiled_for((add_stacked_n,), 10, args)
