"""The compiled one-step add: every check and write of ``ReplayBuffer.add`` of one step
of every stream (with a frame stack's frames too), in one call (storage/one_step.py holds
the plan that calls it). Why it is shaped as it is for numba's dispatcher: docs/internals.md,
"One-step writes".
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np

from shardreplay.kernels import frames as fk

# SMALL_CALL: compiled without reference counting (nothing here allocates or keeps an array),
# cached (numba's cache, safe across processes).
from shardreplay.kernels.cache_lock import SMALL_CALL
from shardreplay.kernels.cast import c_code, fits, item, store_as
from shardreplay.kernels.codes import ADD_HELD_DONE as DONE
from shardreplay.kernels.codes import ADD_STEP_BAD_INPUT as BAD_INPUT
from shardreplay.kernels.codes import ADD_STEP_NEED_FRAMES as NEED_FRAMES
from shardreplay.kernels.codes import STORED_DTYPES, stored_code
from shardreplay.kernels.copy import copy_small_or_at
from shardreplay.kernels.storage import write_steps
from shardreplay.kernels.validate import STEPS_OK, steps_ok

__all__ = ["BAD_INPUT", "CALLER", "CHECK_ONLY", "DONE", "FIELD_WORDS", "MAX_FIELD_NDIM", "MAX_FORMS",
           "NEED_FRAMES", "N_OUT", "OWN", "PLAN", "PRIORITY", "add_held", "compiled_for", "entry", "form_for",
           "state_parts"]

# The int64 ``state`` array's layout: docs/internals.md, "One-step writes".
CAP, WINDOW, ROWS, FIELDS, PRIORITY, CHECK_ONLY, N_OUT = 0, 1, 2, 3, 4, 5, 6
AT_STEP_TYPE, AT_DISCOUNT, AT_EPISODE, AT_GENERATION, AT_PRIORITY, AT_VALID = 7, 8, 9, 10, 11, 12
PLAN = 13
RECORD_PARTS = ("step_type", "discount", "episode_id", "generation", "priority", "valid")  # AT_* order
MAX_FIELD_NDIM = 8
OFFSET, ROW_BYTES, FINITE, CODE, DIMS = 0, 1, 2, 3, 4  # CODE: the stored dtype's (kernels/cast.py)
OWN, CALLER = -1, -2
FIELD_WORDS = DIMS + MAX_FIELD_NDIM
MAX_FORMS = 8  # compiled forms of one writer's kernel (kinds of input); the full path takes other kinds
_NO_PRIORITIES = np.zeros((1, 1), np.float32)
_F32 = stored_code(np.dtype(np.float32))
_ITEMSIZE = tuple(d.itemsize for d in STORED_DTYPES)
# The same bookkeeping and frame kernels as the full path's, inlined here (and so compiled
# without reference counting too).
_write_steps, _plan_write, _append_frames = (numba.njit(nogil=True, inline="always")(f.py_func)
                                             for f in (write_steps, fk.plan_write, fk.append_frames))


@numba.njit(nogil=True, inline="always")
def _value_ok(value, state, j, n_rows):  # pragma: no cover - compiled
    """``value`` (any numeric dtype and layout) has ``n_rows`` rows of the field shape in
    ``state[j:]``, and each of its values may be stored in the field's dtype (``fits``: in
    range, no NaN or inf when the field must be finite)."""
    shape = value.shape
    if shape[0] != n_rows:
        return False
    for d in range(1, value.ndim):
        if shape[d] != state[j + DIMS + d - 1]:
            return False
    ok, code, finite = True, state[j + CODE], state[j + FINITE]
    # No early exits: vectorised (flat: no reshape, whose C helper is slow).
    if c_code(value) == code:  # C-contiguous in the stored dtype (a constant)
        if finite:  # a float field's flag (np.isfinite of an integer: True)
            for k in range(value.size):
                ok &= np.isfinite(value.flat[k])
    else:
        per = value.size // n_rows
        for i in range(n_rows):
            for k in range(per):
                ok &= fits(item(value, i, k), code, finite)
    return ok


@numba.njit(nogil=True, inline="always")
def _put_row(dst, at, value, i, size, code):  # pragma: no cover - compiled
    """Row ``i`` of ``value`` (``size`` bytes once stored) stored as the dtype of ``code``
    at byte ``at`` of ``dst``: copied when it is in that form, else value by value."""
    if c_code(value) == code:
        copy_small_or_at(dst, at, value, i * size, size)
    else:
        width = _ITEMSIZE[code]
        per = size // width
        for k in range(per):
            store_as(dst, at + k * width, item(value, i, k), code)


@numba.njit(cache=True, nogil=True)
def state_parts(n_rows: int, n_fields: int, window: int) -> tuple[int, int, int, int]:
    """Where the rows, the result scratch and the scratch of ``n_rows`` words (the held
    write's discounts, a stacked add's frame counts) start in ``state``, and its length
    (in int64 words)."""
    rows_at = PLAN + FIELD_WORDS * n_fields
    out_at = rows_at + n_rows
    scratch_at = out_at + 4 * n_rows * window
    return rows_at, out_at, scratch_at, scratch_at + n_rows


@numba.njit(**SMALL_CALL)
def _check_and_book(records, pos_and_counters, state, discount, step_types):  # pragma: no cover
    """The part of each ``add_step_k`` that no field's type changes: check the step types and
    discounts (their shapes too), then (unless ``state[CHECK_ONLY]``) the bookkeeping and the discount.

    A function of its own, not inlined: its signature is the same for every spec, so
    numba compiles it once (the larger part of a cold compile) and every spec's entry
    point only types its fields."""
    n_rows, window = state[ROWS], state[WINDOW]
    rows_at, out_at, scratch_at, _end = state_parts(n_rows, state[FIELDS], window)
    if step_types.shape[0] != n_rows or discount.shape[0] != n_rows \
            or steps_ok(step_types, discount) != STEPS_OK:
        return BAD_INPUT
    if state[CHECK_ONLY]:
        return 0
    out = state[out_at:scratch_at].reshape(4, n_rows * window)
    default_prio = state[PRIORITY:PRIORITY + 1].view(np.float64)[0]
    # The bookkeeping columns of the records, as strided views.
    episode_id = records[:, state[AT_EPISODE]:state[AT_EPISODE] + 8].view(np.int64)[:, 0]
    generation = records[:, state[AT_GENERATION]:state[AT_GENERATION] + 4].view(np.uint32)[:, 0]
    priority = records[:, state[AT_PRIORITY]:state[AT_PRIORITY] + 4].view(np.float32)[:, 0]
    valid = records[:, state[AT_VALID]:state[AT_VALID] + 1].view(np.bool_)[:, 0]
    n_out, delta = _write_steps(records[:, state[AT_STEP_TYPE]], episode_id, generation, priority, valid,
                                pos_and_counters[:n_rows], pos_and_counters[n_rows:], state[rows_at:out_at],
                                step_types.reshape(n_rows, 1), _NO_PRIORITIES, False, default_prio,
                                state[CAP], window, out[:2], out[2:])
    state[N_OUT] = n_out
    pos_and_counters[n_rows + 1] += delta  # the storage's num_valid
    record_bytes = records.shape[1]
    at_discount = state[AT_DISCOUNT]
    for i in range(n_rows):
        _put_row(records, out[0, i] * record_bytes + at_discount, discount, i, 4, _F32)
    return delta


@numba.njit(nogil=True, inline="always")
def _write_value(records, own, value, state, j):  # pragma: no cover - compiled
    """Write ``value`` (planned at ``state[j:]``) into the slots ``add_step_k`` booked."""
    offset, size, code, n_rows = state[j + OFFSET], state[j + ROW_BYTES], state[j + CODE], state[ROWS]
    out_at = state_parts(n_rows, state[FIELDS], state[WINDOW])[1]
    for i in range(n_rows):
        if offset >= 0:
            _put_row(records, state[out_at + i] * records.shape[1] + offset, value, i, size, code)
        elif offset == OWN:
            _put_row(own, state[out_at + i] * size, value, i, size, code)


# Past MAX_INLINED fields, each field's check and write is compiled once per kind of value and
# inlined by LLVM (forceinline): numba's inlining types it again at every field, which makes a
# cold compile of a wide spec slow; LLVM's leaves each add a little slower, so narrow specs keep
# numba's (the figures: docs/internals.md, "One-step writes").
MAX_INLINED = 6
_value_ok_llvm, _write_value_llvm = (numba.njit(**{**SMALL_CALL, "cache": False}, forceinline=True)(f.py_func)
                                     for f in (_value_ok, _write_value))


# The kernels of exactly k fields (docs/internals.md, "One-step writes"), made from these
# templates the first time a spec asks (:func:`entry`), compiled under this file's name
# (numba caches a function by its source file).
#
# add_step_k(records, own, pos_and_counters, state, discount, step_types, v0 .. v{k-1}):
# check one step of every stream, then write it: the bookkeeping (``write_steps``), the
# discount and every field held in the records (the field planned ``OWN`` into ``own``).
# ``records``: the per-slot records as uint8 ``[N, record bytes]``; ``own``: the own array
# as uint8 rows ``[N, row bytes]``; the values: the fields in plan order, each ``[S, *shape]``
# of a dtype that may be stored in the field's (kernels/cast.py; any layout); ``discount``
# (float32, or as a float field) and ``step_types`` (integers, C-contiguous): ``[S]``;
# ``pos_and_counters``: the storage's positions ``[S]`` then its counters (the next episode
# id; the number of valid starts, which this keeps); ``state``: as the constants above and
# :func:`state_parts` say. Returns the change in the number of valid starts (0 when
# ``state[CHECK_ONLY]``), with the written slots in row 0 of the scratch and
# ``write_steps``'s n in ``state[N_OUT]``; or :data:`BAD_INPUT` with nothing changed when a
# shape, a value of a finite field, a step type or a discount is wrong (the caller's full
# check then says which).
_ADD = """
def add_step_{k}(records, own, pos, state, discount, step_types, {args}):
    n_rows = state[ROWS]
    if not ({checks}):
        return BAD_INPUT
    delta = _check_and_book(records, pos, state, discount, step_types)
    if delta == BAD_INPUT or state[CHECK_ONLY]:
        return delta
{writes}
    return delta
"""
# add_stacked_k(records, pos_and_counters, state, ref, frames, fpos, discount, step_types,
# v0 .. v{k-1}): add_step_k of a spec with one frame-stacked field, whose stack is ``v0``
# (``[S, K, *frame]``, C-contiguous, its stored dtype; planned ``CALLER``: checked, not written
# by add_step_k) and whose frames go to its ``FrameStore`` arrays ``ref``, ``frames`` (uint8
# ``[S, F, frame bytes]``) and ``fpos``, planned and appended by the full path's kernels
# (kernels/frames.py); nothing is written before every check passed (its four stages:
# docs/internals.md). Returns add_step_k's result; :data:`BAD_INPUT` with nothing changed for
# an input the full path must judge (it raises the error, or converts the input); or
# :data:`NEED_FRAMES` with nothing changed and the frames each ring must hold in
# ``state[N_OUT]``.
_STACKED = """
def add_stacked_{k}(records, pos, state, ref, frames, fpos, discount, step_types, {args}):
    state[CHECK_ONLY] = 1
    checked = add_step_{k}(records, records, pos, state, discount, step_types, {args})
    state[CHECK_ONLY] = 0
    if checked == BAD_INPUT:
        return BAD_INPUT
    stacks = v0[:, None]  # plan_write's [n, T, K, *frame] (None: numba's reshape calls a C helper)
    rows_at, out_at, scratch_at, end = state_parts(state[ROWS], state[FIELDS], state[WINDOW])
    rows, counts = state[rows_at:out_at], state[scratch_at:end][:, None]  # counts: frames each appends
    step_type = records[:, state[AT_STEP_TYPE]]
    status, _i, _t, need = _plan_write(stacks, step_types[:, None], rows, pos, step_type, ref, frames, fpos,
                                       state[CAP], counts)
    if status != fk.OK:
        return BAD_INPUT  # the full path names the stream and step
    if need > frames.shape[1]:
        state[N_OUT] = need
        return NEED_FRAMES
    delta = add_step_{k}(records, records, pos, state, discount, step_types, {args})
    _append_frames(stacks, rows, state[out_at:], counts, frames, ref, fpos)
    return delta
"""


@functools.cache
def entry(k: int, stacked: bool) -> Any:
    """``add_step_{k}``, or (``stacked``) ``add_stacked_{k}`` (see their templates above), made
    and kept here the first time."""
    if stacked:
        entry(k, False)  # the add it calls
    at, by = [f"v{i}, state, PLAN + {i} * FIELD_WORDS" for i in range(k)], "" if k <= MAX_INLINED else "_llvm"
    checks = " and ".join(f"_value_ok{by}({a}, n_rows)" for a in at)
    writes = "\n".join(f"    _write_value{by}(records, own, {a})" for a in at)
    source = (_STACKED if stacked else _ADD).format(k=k, args=", ".join(f"v{i}" for i in range(k)),
                                                    checks=checks, writes=writes)
    made: dict[str, Any] = {}
    exec(compile(source, __file__, "exec"), globals(), made)
    ((name, function),) = made.items()
    globals()[name] = numba.njit(**SMALL_CALL)(function)
    return globals()[name]


_ADD_3 = entry(3, False)


@numba.njit(**SMALL_CALL)
def add_held(records, own, pos_and_counters, state, step_types, a, b, c, nxt, spare, term,
             trunc):  # pragma: no cover
    """``add_step_3`` (``GymStepWriter``'s fields), every discount 1.0, that also takes the
    first field's next value: ``nxt`` checked as that field (shape, finite), then the write,
    then ``nxt`` copied into ``spare`` (the caller holds it until the next step).

    Returns what ``add_step_3`` returns, plus :data:`DONE` when some ``term`` or ``trunc``
    flag (bool ``[S]``) is set; :data:`BAD_INPUT` with nothing changed when ``nxt`` or the
    flags do not fit."""
    n_rows = state[ROWS]
    if not _value_ok(nxt, state, PLAN, n_rows) or term.shape[0] != n_rows or trunc.shape[0] != n_rows:
        return BAD_INPUT
    scratch_at, end = state_parts(n_rows, state[FIELDS], state[WINDOW])[2:]
    discount = state[scratch_at:end].view(np.float32)[:n_rows]
    discount[:] = 1.0  # a step without a discount
    delta = _ADD_3(records, own, pos_and_counters, state, discount, step_types, a, b, c)
    if delta == BAD_INPUT:
        return delta
    size = state[PLAN + ROW_BYTES]
    done = False
    for i in range(n_rows):
        _put_row(spare, i * size, nxt, i, size, state[PLAN + CODE])
        done |= term[i] | trunc[i]
    return delta + DONE if done else delta


def compiled_for(kernel: Any, args: tuple[Any, ...]) -> Any:
    """A dispatcher of ``kernel`` (here) compiled (or loaded from numba's cache) for
    arguments of the types of ``args`` only. A call with other types raises ``TypeError``
    at once (about a microsecond): numba's search for conversions and its explanation of
    the mismatch (tens of microseconds) are replaced, as every caller then takes the form
    for them (:func:`form_for`), or leaves the values to the full path."""
    # A dispatcher per spec and form: numba's dispatcher rates each of several forms in a
    # loop, and matches one exactly (docs/internals.md); all share the entry's function, so
    # numba's cache serves every spec.
    dispatcher = numba.njit(**SMALL_CALL)(kernel.py_func)
    dispatcher.compile(tuple(map(numba.typeof, args)))
    dispatcher.disable_compile()
    # The C dispatcher looks these two up on the instance when no compiled form matches.
    dispatcher._search_new_conversions = lambda *a, **k: False
    dispatcher._explain_matching_error = _refuse
    dispatcher.forms = {dispatcher.signatures[0]: dispatcher}
    return dispatcher


def form_for(dispatcher: Any, args: tuple[Any, ...]) -> Any:
    """The dispatcher of the same kernel as ``dispatcher`` (from :func:`compiled_for`) for
    the types of ``args``, compiled (or loaded from numba's cache) the first time; None when
    numba cannot type them or :data:`MAX_FORMS` are compiled already."""
    try:
        types = tuple(map(numba.typeof, args))
    except ValueError:  # a value numba has no type for
        return None
    form = dispatcher.forms.get(types)
    if form is None and len(dispatcher.forms) < MAX_FORMS:
        try:
            form = compiled_for(dispatcher, args)
        except numba.core.errors.NumbaError:
            return None
        form.forms = dispatcher.forms
        form.forms[types] = form
    return form


def _refuse(*args: Any, **kws: Any) -> Any:
    raise TypeError("not compiled for these argument types")
