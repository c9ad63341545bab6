"""The compiled one-step add: every check and write of ``ReplayBuffer.add`` of one step
of every stream, in one call (storage/one_step.py holds the plan that calls it).

The call itself is most of the cost of one small step, so the kernel is shaped for
numba's dispatcher:

* The values come as separate arguments, typed in the dispatcher's C fast path. A
  dispatcher is compiled for the stored dtypes (:func:`compiled_add_step`) and then for
  each other kind of numpy input its caller is given (:func:`compile_also`: any integer,
  float or bool dtype and any layout, cast here as numpy's ``astype`` would, integers
  range-checked, a float into integers refused); other types are refused at once with
  ``TypeError``. Shapes and values are checked here before anything is written.
  Specs of up to ``MAX_ARITY`` fields get an entry point of exactly their arity (a
  ``*values`` entry costs the dispatcher a tuple per call); larger ones take ``*values``.
* The per-slot records come as plain ``uint8`` rows, not as the structured array: numba
  types a structured array off its fast path.
* It is compiled without numba's reference counting (``_nrt=False``, where the installed
  numba has that private option; otherwise with it: slower, same results): it allocates
  nothing, and the counting costs an allocation per array argument plus an atomic
  increment and decrement per array view (figures: benchmarks/replay/RESULTS-single-env.md).
* It returns one integer, not a tuple.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import literal_unroll, types
from numba.core.cpu import CPUTargetOptions
from numba.extending import intrinsic, overload

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)
from shardreplay.kernels.codes import ADD_HELD_DONE as DONE
from shardreplay.kernels.codes import ADD_STEP_BAD_INPUT as BAD_INPUT
from shardreplay.kernels.copy import _byte_pointer, _check_arrays, copy_small_or_at
from shardreplay.kernels.storage import write_steps
from shardreplay.kernels.validate import STEPS_OK, step_type_ok, steps_ok

__all__ = ["BAD_INPUT", "CALLER", "CHECK_ONLY", "DONE", "FIELD_WORDS", "MAX_FIELD_NDIM", "N_OUT", "OWN",
           "PLAN", "PRIORITY", "compiled_add_step", "compiled_for", "state_parts"]

# The int64 ``state`` array: a header (the priority of new steps as float64 bits; the
# byte offsets of the bookkeeping in a record), then per field ``FIELD_WORDS`` words,
# then the rows 0 .. S-1, the result scratch ``[4, S * window]`` and the discounts of the
# step (float32, ``ceil(S / 2)`` words). ``CHECK_ONLY``: 1 to check and return without
# writing (a caller with frame stacks plans them between the check and the write).
# ``N_OUT``: the kernel leaves there how many starts it recomputed (``write_steps``'s n).
CAP, WINDOW, ROWS, FIELDS, PRIORITY, CHECK_ONLY, N_OUT = 0, 1, 2, 3, 4, 5, 6
AT_STEP_TYPE, AT_DISCOUNT, AT_EPISODE, AT_GENERATION, AT_PRIORITY, AT_VALID = 7, 8, 9, 10, 11, 12
PLAN = 13
RECORD_PARTS = ("step_type", "discount", "episode_id", "generation", "priority", "valid")  # AT_* order
MAX_FIELD_NDIM = 8
# Per field: byte offset in the record (OWN: a field of its own array, the kernel's
# ``own``; CALLER: another one, written by the caller), bytes per row, whether it must be
# finite, the stored dtype (its index in DTYPES) and, for integers, its range; then the
# field's own shape.
OFFSET, ROW_BYTES, FINITE, DTYPE, LOW, HIGH, DIMS = 0, 1, 2, 3, 4, 5, 6
OWN, CALLER = -1, -2
FIELD_WORDS = DIMS + MAX_FIELD_NDIM
# The stored dtypes a value of another dtype is cast to in the kernel (others: converted first).
DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.uint8, np.int8, np.uint16, np.int16,
                                     np.uint32, np.int32, np.uint64, np.int64, np.bool_))
_NUMBA_DTYPES = tuple(numba.typeof(np.zeros(0, t)).dtype for t in DTYPES)
MAX_ARITY = 6
_NO_PRIORITIES = np.zeros((1, 1), np.float32)
# The same bookkeeping as every other write, inlined here (and so compiled without
# reference counting too).
_write_steps = numba.njit(nogil=True, inline="always")(write_steps.py_func)
# Compiled without reference counting: nothing here allocates or keeps an array.
_OPTIONS: dict[str, Any] = {"cache": True, "nogil": True,
                            **({"_nrt": False} if hasattr(CPUTargetOptions, "_nrt") else {})}


@intrinsic
def _flat_item(typingctx, array, index):  # pragma: no cover
    """Element ``index`` of a C-contiguous ``array`` in memory order (no reshape: numba's
    reshape calls a C helper)."""
    if not isinstance(array, types.Array) or array.layout != "C":
        raise numba.core.errors.TypingError(f"_flat_item takes a C-contiguous array, got {array}")

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.load(builder.gep(data, [args[1]]))
    return array.dtype(array, types.intp), codegen


def _value_ok(value: Any, state: Any, j: int, n_rows: int) -> bool:  # pragma: no cover
    """``value`` has ``n_rows`` rows of the field shape in ``state[j:]`` and can be stored
    as the field's dtype: numpy's ``astype`` of it changes no value (integers in range, as
    ``casting="same_value"``; no float into integers); when the field must be finite, no
    NaN or inf (after the cast)."""
    raise NotImplementedError("compiled only")


@overload(_value_ok, inline="always")
def _value_ok_compiled(value, state, j, n_rows):  # pragma: no cover - compiling
    ndim, src = value.ndim, value.dtype
    code = _NUMBA_DTYPES.index(src) if src in _NUMBA_DTYPES else -1
    kind = "x" if code < 0 else DTYPES[code].kind
    contiguous = value.layout == "C"

    def impl(value, state, j, n_rows):
        shape = value.shape
        if shape[0] != n_rows:
            return False
        for d in range(1, ndim):
            if shape[d] != state[j + DIMS + d - 1]:
                return False
        to = state[j + DTYPE]
        to_float = to <= 1
        if kind == "x" or (kind == "f" and not to_float) or (to == 10 and kind != "b") or \
                (kind == "u" and code == 8 and to != 8):  # uint64 only as itself
            return False
        exact = to == code
        finite = kind == "f" and state[j + FINITE]
        ranged = not exact and not to_float and kind in "iu"
        if exact and contiguous and not finite:
            return True
        low, high = state[j + LOW], state[j + HIGH]
        ok = True
        for k in range(value.size):  # no early exit: vectorised
            x = _item(value, k)
            if finite:
                ok &= np.isfinite(numba.float32(x)) if to == 0 else np.isfinite(x)
            if ranged:
                ok &= (x >= low) & (x <= high)
        return ok
    return impl


def _item(value: Any, k: int) -> Any:  # pragma: no cover
    """Element ``k`` of ``value`` in C order (any layout)."""
    raise NotImplementedError("compiled only")


@overload(_item)
def _item_compiled(value, k):  # pragma: no cover - compiling
    if value.layout == "C":
        return lambda value, k: _flat_item(value, k)

    def impl(value, k):
        at, rem = 0, k
        for d in range(value.ndim - 1, -1, -1):  # the element's byte offset from the strides
            at += (rem % value.shape[d]) * value.strides[d]
            rem //= value.shape[d]
        return _load(value, at)
    return impl


def _put(dst: Any, at: int, value: Any, i: int, state: Any, j: int) -> None:  # pragma: no cover
    """Row ``i`` of ``value`` (checked by :func:`_value_ok`) at byte ``at`` of ``dst``, as
    the field's dtype."""
    raise NotImplementedError("compiled only")


@overload(_put, inline="always")
def _put_compiled(dst, at, value, i, state, j):  # pragma: no cover - compiling
    src = value.dtype
    code = _NUMBA_DTYPES.index(src) if src in _NUMBA_DTYPES else -1
    contiguous = value.layout == "C"

    def impl(dst, at, value, i, state, j):
        size, to = state[j + ROW_BYTES], state[j + DTYPE]
        if to == code and contiguous:
            copy_small_or_at(dst, at, value, i * size, size)
            return
        n = value.size // value.shape[0]
        for k in range(n):
            _store_as(dst, at, k, _item(value, i * n + k), to)
    return impl


@numba.njit(inline="always")
def _store_as(dst, at, k, x, to):  # pragma: no cover
    """``x`` as element ``k`` of dtype ``DTYPES[to]`` from byte ``at`` of ``dst``."""
    if to == 0:
        _store(dst, at + 4 * k, numba.float32(x))
    elif to == 1:
        _store(dst, at + 8 * k, numba.float64(x))
    elif to == 2:
        _store(dst, at + k, numba.uint8(x))
    elif to == 3:
        _store(dst, at + k, numba.int8(x))
    elif to == 4:
        _store(dst, at + 2 * k, numba.uint16(x))
    elif to == 5:
        _store(dst, at + 2 * k, numba.int16(x))
    elif to == 6:
        _store(dst, at + 4 * k, numba.uint32(x))
    elif to == 7:
        _store(dst, at + 4 * k, numba.int32(x))
    elif to == 8:
        _store(dst, at + 8 * k, numba.uint64(x))
    elif to == 9:
        _store(dst, at + 8 * k, numba.int64(x))
    else:
        _store(dst, at + k, x != 0)


@numba.njit(cache=True, nogil=True)
def state_parts(n_rows: int, n_fields: int, window: int) -> tuple[int, int, int, int]:
    """Where the rows, the result scratch and the discounts start in ``state``, and its
    length (in int64 words; the last ``ceil(S / 8)`` words: step types of another
    dtype, as stored)."""
    rows_at = PLAN + FIELD_WORDS * n_fields
    out_at = rows_at + n_rows
    discount_at = out_at + 4 * n_rows * window
    return rows_at, out_at, discount_at, discount_at + (n_rows + 1) // 2 + (n_rows + 7) // 8


@numba.njit(**_OPTIONS)
def _check_and_book(records, pos_and_counters, state, step_types):  # pragma: no cover
    """The part of :func:`add_step` that no field's type changes: check the step types and
    discounts, then (unless ``state[CHECK_ONLY]``) the bookkeeping and the discount.

    A function of its own, not inlined: its signature is the same for every spec, so
    numba compiles it once (the larger part of a cold compile) and every spec's entry
    point only types its fields."""
    n_rows, window = state[ROWS], state[WINDOW]
    rows_at, out_at, discount_at, end = state_parts(n_rows, state[FIELDS], window)
    discount = state[discount_at:end].view(np.float32)[:n_rows]
    if steps_ok(step_types, discount) != STEPS_OK:
        return BAD_INPUT
    if state[CHECK_ONLY]:
        return 0
    out = state[out_at:discount_at].reshape(4, n_rows * window)
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
    record_bytes = records.shape[1]
    at_discount = state[AT_DISCOUNT]
    for i in range(n_rows):
        copy_small_or_at(records, out[0, i] * record_bytes + at_discount, discount, 4 * i, 4)
    return delta


@numba.njit(**_OPTIONS)
def add_step(records, pos_and_counters, state, step_types, values):  # pragma: no cover
    """Check one step of every stream, then write it: the bookkeeping
    (``kernels.storage.write_steps``), the discount and every field held in the records.

    ``records`` is the storage's per-slot records as uint8 ``[N, record bytes]``;
    ``values`` the user fields in plan order, each ``[S, *shape]`` C-contiguous in its
    stored dtype; ``step_types`` is ``[S]``; ``pos_and_counters`` is the storage's
    positions ``[S]`` then its counters; ``state`` (int64) is laid out as the constants
    above and :func:`state_parts` say.

    Returns the change in the number of valid starts (0 when ``state[CHECK_ONLY]``), with
    the written slots in row 0 of the scratch and ``write_steps``'s n in
    ``state[N_OUT]``; or :data:`BAD_INPUT` with nothing changed when a shape, a value of
    a finite field, a step type or a discount is wrong (the caller's full check then
    says which)."""
    discount_at, end = state_parts(state[ROWS], state[FIELDS], state[WINDOW])[2:]
    discount = state[discount_at:end].view(np.float32)[:state[ROWS]]
    return _add(records, records, pos_and_counters, state, discount, step_types, values)


@numba.njit(**_OPTIONS)
def _add(records, own, pos_and_counters, state, discount, step_types, values):  # pragma: no cover
    """:func:`add_step`, which also writes the field planned ``OWN`` into ``own`` (its
    own array as uint8 rows ``[N, row bytes]``), takes the discounts ``[S]`` as an
    argument, and takes values, step types and discounts of other dtypes and layouts
    (each compiled form is one kind of input: ``OneStepAdd``)."""
    n_rows = state[ROWS]
    if step_types.ndim != 1 or step_types.shape[0] != n_rows or not _integers(step_types) or \
            discount.ndim != 1 or discount.shape[0] != n_rows or not _numbers(discount):
        return BAD_INPUT
    j = PLAN
    for v in literal_unroll(values):
        if not _value_ok(v, state, j, n_rows):
            return BAD_INPUT
        j += FIELD_WORDS
    # The step types as stored, at the end of ``state`` (any integer dtype and layout taken).
    types8 = state[state.shape[0] - (n_rows + 7) // 8:].view(np.uint8)[:n_rows]
    _stored_types(types8, step_types)
    _rows_at, out_at, discount_at, end = state_parts(n_rows, state[FIELDS], state[WINDOW])
    stored_discount = state[discount_at:end].view(np.float32)[:n_rows]
    for i in range(n_rows):  # as stored (bool: 0.0 / 1.0); the step rule is checked next
        stored_discount[i] = numba.float32(discount[i])
    delta = _check_and_book(records, pos_and_counters, state, types8)
    if delta == BAD_INPUT or state[CHECK_ONLY]:
        return delta
    record_bytes = records.shape[1]
    j = PLAN
    for v in literal_unroll(values):
        offset, size = state[j + OFFSET], state[j + ROW_BYTES]
        for i in range(n_rows):
            if offset >= 0:
                _put(records, state[out_at + i] * record_bytes + offset, v, i, state, j)
            elif offset == OWN:
                _put(own, state[out_at + i] * size, v, i, state, j)
        j += FIELD_WORDS
    return delta


def _integers(array: Any) -> bool:  # pragma: no cover
    """Whether ``array`` holds integers (the full check refuses other step types)."""
    raise NotImplementedError("compiled only")


@overload(_integers, inline="always")
def _integers_compiled(array):  # pragma: no cover - compiling
    integers = isinstance(array.dtype, types.Integer)
    return lambda array: integers


def _numbers(array: Any) -> bool:  # pragma: no cover
    """Whether ``array`` holds bools, integers or floats (as a discount may)."""
    raise NotImplementedError("compiled only")


@overload(_numbers, inline="always")
def _numbers_compiled(array):  # pragma: no cover - compiling
    numbers = isinstance(array.dtype, (types.Integer, types.Float, types.Boolean))
    return lambda array: numbers


@numba.njit(inline="always")
def _stored_types(out, step_types):  # pragma: no cover
    """``step_types`` (any integer dtype and layout) into the uint8 ``out``, a value
    outside 0..2 as 255 (which the step check refuses)."""
    for i in range(out.shape[0]):
        t = step_types[i]
        out[i] = numba.uint8(t) if step_type_ok(t) else numba.uint8(255)


@numba.njit(**_OPTIONS)
def add_held(records, own, pos_and_counters, state, discount, step_types, a, b, c, nxt, spare, term,
             trunc):  # pragma: no cover
    """:func:`add_step` of 3 fields (``GymStepWriter``'s) that also takes the first
    field's next value: ``nxt`` checked as that field (shape, finite), then the write,
    then ``nxt`` copied into ``spare`` (the caller holds it until the next step).

    Returns what :func:`add_step` returns, plus :data:`DONE` when some ``term`` or
    ``trunc`` flag (bool ``[S]``) is set; :data:`BAD_INPUT` with nothing changed when
    ``nxt`` or the flags do not fit."""
    n_rows = state[ROWS]
    if not _value_ok(nxt, state, PLAN, n_rows) or term.shape[0] != n_rows or trunc.shape[0] != n_rows:
        return BAD_INPUT
    delta = _add(records, own, pos_and_counters, state, discount, step_types, (a, b, c))
    if delta == BAD_INPUT:
        return delta
    size = state[PLAN + ROW_BYTES]
    for i in range(n_rows):
        _put(spare, i * size, nxt, i, state, PLAN)
    done = False
    for i in range(n_rows):
        done |= term[i] | trunc[i]
    return delta + DONE if done else delta


@intrinsic
def _load(typingctx, array, offset):  # pragma: no cover
    """The element of ``array`` at byte ``offset`` from its first byte."""
    _check_arrays(array)

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1])
        ty = signature.args[0].dtype
        return context.unpack_value(builder, ty, builder.bitcast(ptr, context.get_data_type(ty).as_pointer()),
                                    align=1)
    return array.dtype(array, types.intp), codegen


@intrinsic
def _store(typingctx, array, offset, value):  # pragma: no cover
    """Store ``value`` (its own type) at byte ``offset`` of ``array``."""
    _check_arrays(array)

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1])
        ty = signature.args[2]
        context.pack_value(builder, ty, args[2], builder.bitcast(ptr, context.get_data_type(ty).as_pointer()),
                           align=1)
        return context.get_dummy_value()
    return types.void(array, types.intp, value), codegen


# Entry points by the number of fields (see the module docstring).
@numba.njit(**_OPTIONS)
def add_step_1(records, own, pos, state, discount, step_types, a):  # pragma: no cover
    """:func:`add_step` of a spec of 1 field."""
    return _add(records, own, pos, state, discount, step_types, (a,))


@numba.njit(**_OPTIONS)
def add_step_2(records, own, pos, state, discount, step_types, a, b):  # pragma: no cover
    """:func:`add_step` of a spec of 2 fields."""
    return _add(records, own, pos, state, discount, step_types, (a, b))


@numba.njit(**_OPTIONS)
def add_step_3(records, own, pos, state, discount, step_types, a, b, c):  # pragma: no cover
    """:func:`add_step` of a spec of 3 fields."""
    return _add(records, own, pos, state, discount, step_types, (a, b, c))


@numba.njit(**_OPTIONS)
def add_step_4(records, own, pos, state, discount, step_types, a, b, c, d):  # pragma: no cover
    """:func:`add_step` of a spec of 4 fields."""
    return _add(records, own, pos, state, discount, step_types, (a, b, c, d))


@numba.njit(**_OPTIONS)
def add_step_5(records, own, pos, state, discount, step_types, a, b, c, d, e):  # pragma: no cover
    """:func:`add_step` of a spec of 5 fields."""
    return _add(records, own, pos, state, discount, step_types, (a, b, c, d, e))


@numba.njit(**_OPTIONS)
def add_step_6(records, own, pos, state, discount, step_types, a, b, c, d, e, f):  # pragma: no cover
    """:func:`add_step` of a spec of 6 fields."""
    return _add(records, own, pos, state, discount, step_types, (a, b, c, d, e, f))


@numba.njit(**_OPTIONS)
def add_step_n(records, own, pos, state, discount, step_types, *values):  # pragma: no cover
    """:func:`add_step` of a spec of any number of fields."""
    return _add(records, own, pos, state, discount, step_types, values)


_ENTRIES = (add_step_n, add_step_1, add_step_2, add_step_3, add_step_4, add_step_5, add_step_6)


def compiled_add_step(args: tuple[Any, ...], held: bool = False) -> Any:
    """A dispatcher of the add (the entry point of ``len(args) - 6`` fields; with
    ``held``, :func:`add_held`) compiled (or loaded from numba's cache) for arguments of
    the types of ``args`` only: arguments of any other type raise ``TypeError`` at
    dispatch (see :func:`compile_also`). ``args`` = (records as uint8 rows, the own array
    as uint8 rows, positions and counters, state, discounts, step types, *values)."""
    if held:
        return _compiled(add_held, [numba.typeof(x) for x in args])
    return compiled_for(_ENTRIES, 6, args)


def compiled_for(entries: tuple[Any, ...], n_head: int, args: tuple[Any, ...]) -> Any:
    """A dispatcher of the entry of ``entries`` for ``len(args) - n_head`` values
    (``entries[0]`` takes ``*values``, ``entries[k]`` exactly ``k``), compiled for the
    types of ``args`` only (see :func:`_compiled`)."""
    n_values = len(args) - n_head
    entry = entries[n_values] if 0 < n_values < len(entries) else entries[0]
    head = [numba.typeof(x) for x in args[:n_head]]
    values = [numba.typeof(x) for x in args[n_head:]] if entry is not entries[0] else \
        [numba.typeof(tuple(args[n_head:]))]
    return _compiled(entry, [*head, *values])


def compile_also(dispatcher: Any, args: tuple[Any, ...]) -> None:
    """Let ``dispatcher`` (of :func:`_compiled`) take arguments of the types of ``args``
    too: compiled now, or loaded from numba's cache."""
    dispatcher.disable_compile(False)
    try:
        dispatcher.compile(tuple(numba.typeof(x) for x in args))
    finally:
        dispatcher.disable_compile()


def _compiled(entry: Any, arg_types: list[Any]) -> Any:
    """A dispatcher of ``entry`` compiled for ``arg_types`` only. A call with other types
    raises ``TypeError`` at once (about a microsecond): numba's search for conversions
    and its explanation of the mismatch (tens of microseconds) are replaced, as every
    caller converts the values and calls again."""
    # A dispatcher of its own per spec (each compiles one signature and then refuses
    # others); it shares the entry's function, so numba's cache serves every spec.
    dispatcher = numba.njit(**_OPTIONS)(entry.py_func)
    dispatcher.compile(tuple(arg_types))
    dispatcher.disable_compile()
    # The C dispatcher looks these two up on the instance when no compiled form matches.
    dispatcher._search_new_conversions = lambda *a, **k: False
    dispatcher._explain_matching_error = _refuse
    return dispatcher


def _refuse(*args: Any, **kws: Any) -> Any:
    raise TypeError("not compiled for these argument types")
