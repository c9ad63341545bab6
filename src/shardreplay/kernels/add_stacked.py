"""The compiled one-step add of a spec with one frame-stacked field, in one call: the
checks, the stacks planned and appended by the full path's kernels (kernels/frames.py);
nothing is written before every check passed. Its four steps: docs/internals.md,
"One-step writes".
"""

from __future__ import annotations

import numba

from shardreplay.kernels import add_step as ak
from shardreplay.kernels import frames as fk
from shardreplay.kernels.cache_lock import SMALL_CALL  # numba's cache, safe across processes
from shardreplay.kernels.codes import ADD_STEP_BAD_INPUT as BAD_INPUT
from shardreplay.kernels.codes import ADD_STEP_NEED_FRAMES as NEED_FRAMES

__all__ = ["BAD_INPUT", "NEED_FRAMES", "add_stacked"]

# The full path's frame kernels, inlined (and so compiled without reference counting too).
_plan_write, _append_frames = (numba.njit(nogil=True, inline="always")(f.py_func)
                               for f in (fk.plan_write, fk.append_frames))


# One entry point, whatever the number of plain fields (RESULTS-inputs.md, "Pixels without
# spikes": an entry per arity saved only the tuple ``*values`` makes).
@numba.njit(**SMALL_CALL)
def add_stacked(records, pos_and_counters, state, ref, frames, fpos, discount, step_types,
                *values):  # pragma: no cover - compiled
    """Check and write one step of every stream of a spec with one frame-stacked field:
    ``values`` are its stack (``[S, K, *frame]``, C-contiguous, its stored dtype; planned
    ``CALLER``: :func:`~shardreplay.kernels.add_step.add_step` checks it, writes none of
    it) and then the plain fields (``discount`` and these as ``add_step``). ``ref``,
    ``frames`` (uint8 ``[S, F, frame bytes]``) and ``fpos`` are the field's ``FrameStore``
    arrays.

    Returns the change in valid starts (added to the storage's count, as add_step
    does); :data:`BAD_INPUT` with nothing changed for an input the full path must judge
    (it raises the error, or converts the input); or :data:`NEED_FRAMES` with nothing
    changed and the frames each ring must hold in ``state[N_OUT]``."""
    state[ak.CHECK_ONLY] = 1
    checked = ak.add_step(records, records, pos_and_counters, state, discount, step_types, *values)
    state[ak.CHECK_ONLY] = 0
    if checked == BAD_INPUT:
        return BAD_INPUT
    stacks = values[0][:, None]  # plan_write's [n, T, K, *frame] (None: numba's reshape calls a C helper)
    rows_at, out_at, scratch_at, end = ak.state_parts(state[ak.ROWS], state[ak.FIELDS], state[ak.WINDOW])
    rows, counts = state[rows_at:out_at], state[scratch_at:end][:, None]  # counts: frames each appends
    step_type = records[:, state[ak.AT_STEP_TYPE]]
    status, _i, _t, need = _plan_write(stacks, step_types[:, None], rows, pos_and_counters, step_type, ref,
                                       frames, fpos, state[ak.CAP], counts)
    if status != fk.OK:
        return BAD_INPUT  # the full path names the stream and step
    if need > frames.shape[1]:
        state[ak.N_OUT] = need
        return NEED_FRAMES
    delta = ak.add_step(records, records, pos_and_counters, state, discount, step_types, *values)
    _append_frames(stacks, rows, state[out_at:], counts, frames, ref, fpos)
    return delta
