"""The compiled one-step add of a spec with one frame-stacked field, in one call: the
checks, the stacks planned and appended by the full path's kernels (kernels/frames.py);
nothing is written before every check passed. Its four steps and ``fstate``'s layout:
docs/internals.md, "One-step writes".
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from shardreplay.kernels import add_step as ak
from shardreplay.kernels import frames as fk
from shardreplay.kernels.cache_lock import SMALL_CALL  # numba's cache, safe across processes
from shardreplay.kernels.codes import ADD_STEP_BAD_INPUT as BAD_INPUT
from shardreplay.kernels.codes import ADD_STEP_NEED_FRAMES as NEED_FRAMES

__all__ = ["BAD_INPUT", "F_CAP", "F_DIMS", "F_NDIM", "NEED_FRAMES", "compiled_add_stacked", "fstate_of"]

F_CAP, F_NDIM, F_DIMS = 0, 1, 2
# The full path's frame kernels, inlined (and so compiled without reference counting too).
_plan_write, _append_frames = (numba.njit(nogil=True, inline="always")(f.py_func)
                               for f in (fk.plan_write, fk.append_frames))


# One entry point, whatever the number of plain fields (RESULTS-inputs.md, "Pixels without
# spikes": an entry per arity saved only the tuple ``*values`` makes).
@numba.njit(**SMALL_CALL)
def add_stacked(records, pos_and_counters, state, ref, frames, fpos, fstate, discount, step_types, stack,
                *values):  # pragma: no cover - compiled
    """Check and write one step of every stream of a spec with one frame-stacked field
    (``stack``: ``[S, K, *frame]``, C-contiguous, its stored dtype) and the plain fields
    ``values`` (``discount`` and these as :func:`~shardreplay.kernels.add_step.add_step`). ``ref``, ``frames``
    (uint8 ``[S, F, frame bytes]``) and ``fpos`` are the field's ``FrameStore`` arrays.

    Returns the change in valid starts (added to the storage's count, as add_step
    does); :data:`BAD_INPUT` with nothing changed for an input the full path must judge
    (it raises the error, or converts the input); or :data:`NEED_FRAMES` with nothing
    changed and the frames each ring must hold in ``state[N_OUT]``."""
    n_rows = state[ak.ROWS]
    ndim = fstate[F_NDIM]
    if stack.ndim != ndim or stack.shape[0] != n_rows:
        return BAD_INPUT
    for d in range(1, ndim):
        if stack.shape[d] != fstate[F_DIMS + d - 1]:
            return BAD_INPUT
    state[ak.CHECK_ONLY] = 1
    checked = ak.add_step(records, records, pos_and_counters, state, discount, step_types, *values)
    state[ak.CHECK_ONLY] = 0
    if checked == BAD_INPUT:
        return BAD_INPUT
    stacks = stack[:, None]  # plan_write's [n, T, K, *frame] (None: numba's reshape calls a C helper)
    counts = fstate[F_DIMS + ndim - 1:][:, None]
    rows_at, out_at, _discount_at, _end = ak.state_parts(n_rows, state[ak.FIELDS], state[ak.WINDOW])
    rows, step_type = state[rows_at:out_at], records[:, state[ak.AT_STEP_TYPE]]
    status, _i, _t, need = _plan_write(stacks, step_types[:, None], rows, pos_and_counters, step_type, ref,
                                       frames, fpos, fstate[F_CAP], counts)
    if status != fk.OK:
        return BAD_INPUT  # the full path names the stream and step
    if need > frames.shape[1]:
        state[ak.N_OUT] = need
        return NEED_FRAMES
    delta = ak.add_step(records, records, pos_and_counters, state, discount, step_types, *values)
    _append_frames(stacks, rows, state[out_at:], counts, frames, ref, fpos)
    return delta


def fstate_of(stream_capacity: int, stack_shape: tuple[int, ...]) -> np.ndarray:
    """The ``fstate`` array of a field whose steps' stacks are ``stack_shape``
    (``[S, K, *frame]``); see the module docstring."""
    return np.array([stream_capacity, len(stack_shape), *stack_shape[1:]] + [0] * stack_shape[0], np.int64)


def compiled_add_stacked(args: tuple[Any, ...]) -> Any:
    """A dispatcher of :func:`add_stacked` compiled (or loaded from numba's cache) for
    arguments of the types of ``args`` only (others raise ``TypeError`` at dispatch);
    ``args`` = (records as uint8 rows, positions and counters, state, ref, frames, fpos,
    fstate, discounts, step types, stack, *plain values), at least one plain value."""
    if len(args) < 11:
        raise ValueError("compiled_add_stacked needs at least one plain field")
    return ak.compiled_for((add_stacked,), 10, args)
