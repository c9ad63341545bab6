"""The one-step writer: one step of every stream in one compiled call.

Every write of one step per stream goes through it (``ReplayBuffer.add``, ``extend`` of
one-step chunks, ``GymStepWriter``; ``Shard.write`` decides). A :class:`OneStepAdd` is
built once per storage and owns the record layout: the field order, the stored dtypes
and shapes, where each field sits in the per-slot record, and a compiled kernel
(``kernels/add_step.py``) that checks and writes a step in one call. A step takes it
when it is a plain ``dict`` of exactly the spec's flat names plus ``step_type`` (and
``discount``). The kernel is compiled once, for the stored dtypes, C-contiguous: values
in that form go to it as they come; any other (numpy arrays of another dtype or layout,
lists, scalars, torch tensors) is converted once (``spec/coerce.as_stored``), the values
at the places converted in the last call first. Anything else (nested names), and any
input that fails a check, is left to the full validation (``Spec.validate`` and
``StreamStorage.write``), which stores the same or raises today's error; nothing is
written by this path then.

A spec with one frame-stacked field (integers) and at least one plain one takes it too,
in one compiled call (``kernels/add_stacked.py``: check, the stacks checked against the
stored ones, write, frames appended). Specs with more frame-stacked fields (or only
one), a frame-stacked float field, an ``at_starts`` field, a dtype numba does not take
(float16, non-native byte order) or a field of more than ``MAX_FIELD_NDIM`` axes have
no short path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardreplay.errors import SpecMismatchError
from shardreplay.kernels.codes import ADD_HELD_DONE as DONE
from shardreplay.kernels.codes import ADD_STEP_BAD_INPUT as BAD_INPUT
from shardreplay.kernels.codes import ADD_STEP_NEED_FRAMES as NEED_FRAMES
from shardreplay.kernels.codes import numba_takes
from shardreplay.kernels.lazy import lazy
from shardreplay.spec.coerce import SAME_VALUE, as_stored
from shardreplay.spec.layout import DISCOUNT_DTYPE, STEP_TYPE_DTYPE

if TYPE_CHECKING:
    from shardreplay.kernels import add_stacked as sk
    from shardreplay.kernels import add_step as kernel
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    kernel = lazy("shardreplay.kernels.add_step")
    sk = lazy("shardreplay.kernels.add_stacked")

if TYPE_CHECKING:
    from shardreplay.storage.streams import StreamStorage

__all__ = ["OneStepAdd", "one_step_add"]

# Called with (flat slots, validity, newly valid) of the recomputed starts.
OnWrite = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def one_step_add(storage: StreamStorage, default_priority: Callable[[], float] | None,
                 on_write: OnWrite | None, first: tuple[str, ...] = ()) -> OneStepAdd | None:
    """The short one-step path of ``storage``, or None when its spec has none (see the
    module docstring). Compiles (or loads from numba's cache) the kernel once.

    ``default_priority``: the priority of a new step now (None: always 1.0);
    ``on_write``: told the recomputed starts of every write (None: nobody is);
    ``first``: fields to put first in the kernel's order (``held_writer``'s).
    """
    spec = storage.spec
    parts: Mapping[str, Any] = storage.records.dtype.fields or {}
    if any(parts[name][0] != dtype for name, dtype in _RECORD_PARTS.items()):
        return None  # the kernel reads the bookkeeping in these dtypes
    if any(not numba_takes(f.dtype) or len(f.shape) > kernel.MAX_FIELD_NDIM or f.at_starts
           or (f.frame_stack and f.dtype.kind == "f") for f in spec.fields.values()):
        return None  # at_starts fields are kept by the full path (storage/starts.py)
    if storage.stacked and (len(storage.stacked) > 1 or len(spec.fields) == 1):
        return None  # the compiled stacked write takes one stack beside plain fields
    return OneStepAdd(storage, default_priority, on_write, first)


# The bookkeeping in each record, as the kernel reads it (kernels/add_step.py, AT_*).
_RECORD_PARTS = {"step_type": np.dtype(np.uint8), "discount": np.dtype(np.float32),
                 "episode_id": np.dtype(np.int64), "generation": np.dtype(np.uint32),
                 "priority": np.dtype(np.float32), "valid": np.dtype(np.bool_)}


class OneStepAdd:
    """Checks and writes one step of every stream of ``storage`` in one compiled call.

    Internal: ``Shard.write`` calls :meth:`add`, and falls back to the full path when it
    returns False.
    """

    def __init__(self, storage: StreamStorage, default_priority: Callable[[], float] | None,
                 on_write: OnWrite | None, first: tuple[str, ...] = ()) -> None:
        spec = storage.spec
        s, window = storage.num_streams, storage.window
        # The plain fields, ``first`` first (the order of add_held's values), then in spec order.
        names = tuple(n for n in (*first, *(m for m in spec.names if m not in first))
                      if not spec[n].frame_stack)
        record_fields: Mapping[str, Any] = storage.records.dtype.fields or {}
        rows = _rows_of(storage.records)
        own = rows  # the kernel's own array: the first field not in the records (none: unused)
        plan: list[int] = []
        # Other fields of their own array are written here after the kernel, from the values
        # at these indices (the discount and the step types come first, then a stack).
        at = 2 + len(storage.stacked)
        self._own: list[tuple[int, np.ndarray]] = []
        for i, name in enumerate(names):
            f = spec[name]
            place = record_fields.get(f"field.{name}")
            row_bytes = f.dtype.itemsize * int(np.prod(f.shape, dtype=np.int64))
            offset = kernel.CALLER
            if place is not None:
                offset = place[1]
            elif own is rows and not storage.stacked:
                offset, own = kernel.OWN, _rows_of(storage.fields[name])
            else:
                self._own.append((i + at, storage.fields[name]))
            words = [offset, row_bytes, int(f.checks_finite), *f.shape]
            plan += words + [0] * (kernel.FIELD_WORDS - len(words))
        rows_at, out_at, discount_at, end = kernel.state_parts(s, len(names), window)
        self._state = np.zeros(end, np.int64)
        self._state[:kernel.AT_STEP_TYPE] = [storage.stream_capacity, window, s, len(names), 0, 0, 0]
        self._state[kernel.AT_STEP_TYPE:kernel.PLAN] = [record_fields[n][1] for n in kernel.RECORD_PARTS]
        self._state[kernel.PLAN:rows_at] = plan
        self._state[rows_at:out_at] = np.arange(s)
        self._priority = self._state[kernel.PRIORITY:kernel.PRIORITY + 1].view(np.float64)
        self._priority[0] = 1.0
        self._discount = self._state[discount_at:end].view(DISCOUNT_DTYPE)[:s]  # the stacked kernel's
        self._discount[:] = 1.0
        self._out = self._state[out_at:discount_at].reshape(4, s * window)  # the kernel's results
        self._rows = (s,)
        self._ones = np.ones(s, DISCOUNT_DTYPE)  # the discount of a step without one
        # The values in the kernel's order: discount, step types, a frame stack, the plain fields.
        order = ("step_type", *storage.stacked, *names)
        self._get = operator.itemgetter(*order)
        self._get_discounted = operator.itemgetter("discount", *order)
        self._n_keys = len(order)  # a step without "discount"
        # Per value: as_stored's name, stored dtype, shape with the leading axis and the
        # field's own number of axes.
        self._targets = tuple((n, DISCOUNT_DTYPE, self._rows, 0) if n == "discount" else
                              (n, STEP_TYPE_DTYPE, self._rows, 0) if n == "step_type" else
                              (n, spec[n].dtype, (s, *spec[n].shape), len(spec[n].shape))
                              for n in ("discount", *order))
        canonical = tuple(np.zeros(shape, dtype) for _n, dtype, shape, _d in self._targets)
        self._storage = storage
        self._store: Any = None  # the FrameStore of a frame-stacked field
        if not storage.stacked:
            self._head: tuple[np.ndarray, ...] = (rows, own, storage.pos_and_counters, self._state)
            self._kernel = kernel.compiled_add_step((*self._head, *canonical))
        else:  # one compiled call with the frames (kernels/add_stacked.py)
            (name, store), = storage.stacked.items()
            self._head = (rows, storage.pos_and_counters, self._state)
            self._store = store
            self._fstate = sk.fstate_of(store.stream_capacity, store.frame_bytes, canonical[2].shape)
            self._kernel = sk.compiled_add_stacked((*self._fused_head_now(), *canonical[1:]))
        self._canonical = canonical
        self._default_priority = default_priority
        self._on_write = on_write
        # The places of the values converted in the last call (none: handed on as they came),
        # each with its direct cast (``_memo``).
        self._fix: tuple[tuple[Any, ...], ...] = ()
        self._taken: Any = ()  # the values the last call handed to a kernel
        self._simple = not self._own and self._store is None and default_priority is None and on_write is None
        self._held: Any = None  # add_held's compiled kernel (held_writer builds it)
        # False once the shard replaced this writer: held_writer's write then refuses.
        self.open = True

    def add(self, step: Mapping[str, Any]) -> bool:
        """Check and write ``step`` (a dict; see the module docstring) and tell the
        sampler what changed. False, with nothing written, when the step needs the full
        path (a name missing or another, or a check fails)."""
        n = len(step)
        try:
            if n == self._n_keys:
                values = (self._ones, *self._get(step))
            elif n == self._n_keys + 1:
                values = self._get_discounted(step)
            else:
                return False
        except KeyError:  # a name missing
            return False
        if not self._simple:
            return self._write(values) > 0
        delta = self._call(self._kernel, self._head, values, self._targets)
        if delta == BAD_INPUT:
            return False
        self._storage.num_valid += delta  # the common case: every field in the kernel's arrays
        return True

    def _call(self, dispatcher: Any, head: tuple[Any, ...], values: tuple[Any, ...],
              targets: tuple[Any, ...]) -> int:
        """``dispatcher(*head, *values)``, the values not in their stored form converted
        first (see :meth:`_converted`); the values taken are left in ``_taken``."""
        if not self._fix:
            try:
                self._taken = values
                return dispatcher(*head, *values)
            except TypeError:  # a value not in its stored form (the one compiled)
                pass
        return self._converted(dispatcher, head, values, targets)

    def _converted(self, dispatcher: Any, head: tuple[Any, ...], values: tuple[Any, ...],
                   targets: tuple[Any, ...]) -> int:
        """``dispatcher(*head, *values)`` after the values at the places converted last
        time were converted (``as_stored``); when that is refused, after every value not
        in its stored form was. Returns the dispatcher's result (BAD_INPUT: nothing
        written, the full path says why)."""
        taken = list(values)
        if self._fix:  # the inputs of a user's loop keep their kinds
            try:
                kept = 0
                for i, src, shape, dtype, casting, to in self._fix:
                    value = taken[i]
                    if type(value) is np.ndarray and value.dtype is src and value.shape == shape:
                        cast = value.astype(dtype, order="C", casting=casting)
                        taken[i] = cast if to is None else cast.reshape(to)
                        continue  # the cast as_stored chose for this kind (ValueError: out of range)
                    taken[i] = _stored(value, targets[i])
                    kept += taken[i] is value
                self._taken = taken
                if kept == len(self._fix):  # all in their stored form now: handed on as they come
                    self._fix = ()
                return dispatcher(*head, *taken)
            except (TypeError, ValueError, IndexError, SpecMismatchError):  # other kinds (or places) now
                taken = list(values)
        try:
            taken = [_stored(v, target) for v, target in zip(values, targets, strict=True)]
        except (TypeError, ValueError, SpecMismatchError):  # a value that cannot be stored
            return BAD_INPUT
        pairs = enumerate(zip(taken, values, strict=True))
        self._fix = tuple((i, *_memo(v, targets[i])) for i, (a, v) in pairs if a is not v)
        self._taken = taken
        try:
            return dispatcher(*head, *taken)
        except TypeError:  # a read-only array, say: the full path takes it
            return BAD_INPUT

    def _write(self, values: tuple[Any, ...], held: bool = False) -> int:
        """The write of ``values`` (kernel order) by the kernel, or with ``held``
        (``values`` then end with next value, spare, terminated, truncated) by
        ``held_writer``'s, and what follows it. Returns what ``held_writer``'s write returns."""
        if self._default_priority is not None:
            self._priority[0] = self._default_priority()
        if self._store is not None:
            delta = self._add_stacked(values)
        elif held:
            delta = self._call(self._held, self._head, values, self._held_targets)
        else:
            delta = self._call(self._kernel, self._head, values, self._targets)
        if delta == BAD_INPUT:
            return 0
        done = delta >= DONE // 2
        if done:
            delta -= DONE
        if self._own or self._on_write is not None:
            self._after_write(self._taken, delta)
        else:
            self._storage.num_valid += delta
        return 2 if done else 1

    def held_writer(self) -> Callable[..., int]:
        """``GymStepWriter``'s write (a spec of 3 plain fields, the ``first`` given):
        ``write(step_types, a, b, c, nxt, spare, terminated, truncated)`` checks ``nxt``
        as the next value of ``a``'s field, writes the step and copies ``nxt`` into
        ``spare``. Values of any kind are taken as :meth:`add` takes them. Returns 1
        (written), 2 (written; some env's episode ended) or 0 (nothing written: a value
        the full path refuses, or this writer was replaced)."""
        if self._held is None:
            ones, types, obs, *rest = self._canonical
            flags = np.zeros(self._rows, np.bool_)
            args = (*self._head, ones, types, obs, *rest, obs, obs.copy(), flags, flags)
            self._held = kernel.compiled_add_step(args, held=True)
            flag = ("done", np.dtype(np.bool_), self._rows, 0)
            self._held_targets = (*self._targets, self._targets[2], self._targets[2], flag, flag)
        return self._write_held

    def _write_held(self, *args: Any) -> int:
        if not self.open:
            return 0
        values = (self._ones, *args)
        if not self._simple:
            return self._write(values, held=True)
        delta = self._call(self._held, self._head, values, self._held_targets)
        if -_SMALL < delta < _SMALL:  # the usual case: written, no episode ended
            self._storage.num_valid += delta
            return 1
        if delta == BAD_INPUT:
            return 0
        self._storage.num_valid += delta - DONE
        return 2

    def _fused_head_now(self) -> tuple[Any, ...]:
        # Read each call, never kept: a write of the full path may grow (replace) the
        # ring, and a kept reference would hold the old one's memory.
        store = self._store
        return (*self._head, store.ref, store.frames, store.fpos, self._fstate)

    def _add_stacked(self, values: tuple[Any, ...]) -> int:
        """The one compiled call of a spec with a frame-stacked field (its kernel reads
        the discount from ``state``). Grows the ring when the kernel says it must
        (nothing written then), and calls again."""
        discount = values[0]
        if discount is not self._ones:
            try:
                self._discount[:] = as_stored("discount", discount, DISCOUNT_DTYPE, self._rows)
            except SpecMismatchError:
                return BAD_INPUT
        try:
            delta = self._call(self._kernel, self._fused_head_now(), values[1:], self._targets[1:])
            if delta == NEED_FRAMES:
                self._store.grow(int(self._state[kernel.N_OUT]))
                delta = self._kernel(*self._fused_head_now(), *self._taken)
        finally:
            if discount is not self._ones:
                self._discount[:] = 1.0
        self._taken = (discount, *self._taken)
        return delta

    def _after_write(self, values: tuple[Any, ...], delta: int) -> None:
        """Fields of their own arrays, the valid count, the sampler."""
        out, n_out = self._out, int(self._state[kernel.N_OUT])
        if self._own:
            slots = out[0, :self._rows[0]]
            one = self._rows[0] == 1  # one row: basic indexing, a third of a fancy index's cost
            for i, arr in self._own:
                if one:
                    arr[slots[0]] = values[i][0]
                else:
                    arr[slots] = values[i]
        self._storage.num_valid += delta
        if self._on_write is not None:
            self._on_write(out[1, :n_out], out[2, :n_out].astype(bool), out[3, :n_out].astype(bool))


_SMALL = DONE // 2  # within +-: a change in valid starts


def _stored(value: Any, target: tuple[Any, ...]) -> Any:
    """``value`` in the form the kernel is compiled for (``target``: as_stored's name,
    stored dtype, shape and field axes; C-contiguous and writable): itself when it is in
    that form already.

    Raises:
        SpecMismatchError, ValueError, TypeError: it cannot be stored (the full path says why).
    """
    name, dtype, shape, field_ndim = target
    if type(value) is np.ndarray and value.dtype is dtype and value.flags.c_contiguous \
            and value.flags.writeable:
        return value
    stored = as_stored(name, value, dtype, shape, field_ndim)
    flags = stored.flags
    return stored if flags.c_contiguous and flags.writeable else np.array(stored, order="C")


def _memo(value: Any, target: tuple[Any, ...]) -> tuple[Any, ...]:
    """The cast ``as_stored`` made of an array of ``value``'s dtype and shape (source dtype
    and shape, stored dtype, casting, stored shape when it is another); Nones for other kinds."""
    dtype, kind = target[1], target[1].kind
    if type(value) is not np.ndarray or (kind in "iu" and not SAME_VALUE):
        return None, None, None, None, None
    return value.dtype, value.shape, dtype, "same_value" if kind in "iu" else "same_kind", \
        None if value.shape == target[2] else target[2]


def _rows_of(arr: np.ndarray) -> np.ndarray:
    """``arr`` as plain uint8 rows ``[N, row bytes]`` (a plain ndarray even when it is
    memory-mapped): numba types a structured array, or a subclass, off its fast path."""
    return np.asarray(arr).view(np.uint8).reshape(arr.shape[0], -1)
