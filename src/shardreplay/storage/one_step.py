"""The one-step writer: one step of every stream in one compiled call.

Every write of one step per stream goes through it (``ReplayBuffer.add``, ``extend`` of
one-step chunks, ``GymStepWriter``; ``Shard.write`` decides). Which steps take it, how
inputs in other forms are converted once, and which specs have no short path:
docs/internals.md, "One-step writes".
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
from shardreplay.spec.coerce import as_stored, is_number, to_numpy
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
    if any(not numba_takes(f.dtype) or len(f.shape) > kernel.MAX_FIELD_NDIM or f.at_starts
           or (f.frame_stack and f.dtype.kind == "f") for f in spec.fields.values()):
        return None  # at_starts fields are kept by the full path (storage/starts.py)
    if storage.stacked and (len(storage.stacked) > 1 or len(spec.fields) == 1):
        return None  # the compiled stacked write takes one stack beside plain fields
    return OneStepAdd(storage, default_priority, on_write, first)


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
        rows = storage.record_rows
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
                offset, own = kernel.OWN, storage.byte_rows(name)
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
        self._store: Any = None  # the FrameStore of a frame-stacked field
        if not storage.stacked:
            self._head: tuple[np.ndarray, ...] = (rows, own, storage.pos_and_counters, self._state)
            self._kernel = kernel.compiled_add_step((*self._head, *canonical))
        else:  # one compiled call with the frames (kernels/add_stacked.py)
            (store,) = storage.stacked.values()
            self._head = (rows, storage.pos_and_counters, self._state)
            self._store = store
            self._fstate = sk.fstate_of(store.stream_capacity, canonical[2].shape)
            self._kernel = sk.compiled_add_stacked((*self._fused_head_now(), *canonical))
        self._canonical = canonical
        self._default_priority = default_priority
        self._on_write = on_write
        # The casts of the places converted last time (none: values handed on as they come).
        self._fix: tuple[_Cast, ...] = ()
        self._idle = 0
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
        return self._call(self._kernel, self._head, values, self._targets) != BAD_INPUT

    def _call(self, dispatcher: Any, head: tuple[Any, ...], values: tuple[Any, ...],
              targets: tuple[Any, ...]) -> int:
        """``dispatcher(*head, *values)``, the values at the places converted last time cast as
        then, any other not stored converted by :meth:`_converted`; the values taken in ``_taken``."""
        try:
            if not self._fix:
                self._taken = values
                return dispatcher(*head, *values)
            taken, idle = list(values), True
            for cast in self._fix:  # inline: a call per place costs as much as the copy
                at = cast.at
                value = taken[at]
                if type(value) is not cast.kind:
                    continue  # handed on as it comes: the dispatcher takes it if it is stored, or refuses
                if cast.src is None:  # a Python number, as numpy reads it (ints range-checked)
                    cast.flat[0] = value
                else:
                    if cast.read:
                        value = to_numpy(value)  # a list, a tensor
                    if value.dtype is not cast.src or value.shape != cast.shape:
                        continue
                    if cast.casting is None:  # copied (one value: as a Python number, ints range-checked)
                        if cast.one:
                            cast.flat[0] = value.item()
                        else:
                            cast.into[...] = value
                    else:  # integers range-checked (ValueError), or a tensor read in place
                        value = value.astype(cast.dtype, order="C", casting=cast.casting, copy=False)
                        taken[at] = value if cast.to is None else value.reshape(cast.to)
                        idle = False
                        continue
                taken[at] = cast.out
                idle = False
            if idle:  # a loop that changed its kinds for good: forgotten after a while
                self._idle += 1
                self._fix = self._fix if self._idle < FORGET_AFTER else ()
            self._taken = taken
            return dispatcher(*head, *taken)
        except (TypeError, ValueError, OverflowError, IndexError, SpecMismatchError):  # other kinds now
            return self._converted(dispatcher, head, values, targets)

    def _converted(self, dispatcher: Any, head: tuple[Any, ...], values: tuple[Any, ...],
                   targets: tuple[Any, ...]) -> int:
        """``dispatcher(*head, *values)`` after every value not stored was converted (``as_stored``),
        each such cast remembered. Returns its result (BAD_INPUT: nothing written, the full path says why)."""
        try:
            taken = [_stored(v, target) for v, target in zip(values, targets, strict=True)]
        except (TypeError, ValueError, SpecMismatchError):  # a value that cannot be stored
            return BAD_INPUT
        pairs = enumerate(zip(taken, values, strict=True))
        self._fix = tuple(_Cast(i, v, targets[i]) for i, (a, v) in pairs if a is not v)
        self._idle = 0  # calls that used none of them
        self._taken = taken
        try:
            return dispatcher(*head, *taken)
        except TypeError:  # a read-only array, say: the full path takes it
            return BAD_INPUT

    def _write(self, values: tuple[Any, ...], held: bool = False) -> int:
        """The write of ``values`` (kernel order) by the kernel, or with ``held``
        (``values`` then have no discount and end with next value, spare, terminated,
        truncated) by ``held_writer``'s, and what follows it. Returns what ``held_writer``'s write returns."""
        if self._default_priority is not None:
            self._priority[0] = self._default_priority()
        if held:
            delta = self._call(self._held, self._head, values, self._held_targets)
        elif self._store is None:
            delta = self._call(self._kernel, self._head, values, self._targets)
        else:  # a frame-stacked field: the ring grown when the kernel says it must (nothing written), again
            delta = self._call(self._kernel, self._fused_head_now(), values, self._targets)
            if delta == NEED_FRAMES:
                self._store.grow(int(self._state[kernel.N_OUT]))
                delta = self._kernel(*self._fused_head_now(), *self._taken)
        if delta == BAD_INPUT:
            return 0
        if self._own or self._on_write is not None:
            self._after_write((self._ones, *self._taken) if held else self._taken)
        return 2 if delta >= _SMALL else 1

    def held_writer(self) -> Callable[..., int]:
        """``GymStepWriter``'s write (a spec of 3 plain fields, the ``first`` given):
        ``write(step_types, a, b, c, nxt, spare, terminated, truncated)`` checks ``nxt``
        as the next value of ``a``'s field, writes the step and copies ``nxt`` into
        ``spare``. Values of any kind are taken as :meth:`add` takes them. Returns 1
        (written), 2 (written; some env's episode ended) or 0 (nothing written: a value
        the full path refuses, or this writer was replaced)."""
        if self._held is None:
            _ones, types, obs, *rest = self._canonical
            flags = np.zeros(self._rows, np.bool_)
            args = (*self._head, types, obs, *rest, obs, obs.copy(), flags, flags)
            self._held = kernel.compiled_add_step(args, held=True)
            flag = ("done", np.dtype(np.bool_), self._rows, 0)
            self._held_targets = (*self._targets[1:], self._targets[2], self._targets[2], flag, flag)
        return self._write_held

    def _write_held(self, *values: Any) -> int:
        if not self.open:
            return 0
        if not self._simple:
            return self._write(values, held=True)
        delta = self._call(self._held, self._head, values, self._held_targets)
        return 1 if -_SMALL < delta < _SMALL else 0 if delta == BAD_INPUT else 2  # 1: no episode ended

    def _fused_head_now(self) -> tuple[Any, ...]:
        # Read each call, never kept: a write of the full path may grow (replace) the
        # ring, and a kept reference would hold the old one's memory.
        store = self._store
        return (*self._head, store.ref, store.frames, store.fpos, self._fstate)

    def _after_write(self, values: tuple[Any, ...]) -> None:
        """Fields of their own arrays, the sampler."""
        out, n_out = self._out, int(self._state[kernel.N_OUT])
        if self._own:
            slots = out[0, :self._rows[0]]
            one = self._rows[0] == 1  # one row: basic indexing, a third of a fancy index's cost
            for i, arr in self._own:
                if one:
                    arr[slots[0]] = values[i][0]
                else:
                    arr[slots] = values[i]
        if self._on_write is not None:
            self._on_write(out[1, :n_out], out[2, :n_out].astype(bool), out[3, :n_out].astype(bool))


_SMALL = DONE // 2  # within +-: a change in valid starts
FORGET_AFTER = 64  # calls that used none of the remembered casts (GymStepWriter's episode ends use none)


def _stored(value: Any, target: tuple[Any, ...]) -> Any:
    """``value`` in the form the kernel is compiled for (``target``: as_stored's arguments):
    itself when it is in that form already. Raises as as_stored (or ValueError, TypeError)."""
    name, dtype, shape, field_ndim = target
    if type(value) is np.ndarray and value.dtype is dtype and value.flags.c_contiguous \
            and value.flags.writeable:
        return value
    stored = as_stored(name, value, dtype, shape, field_ndim)
    flags = stored.flags
    return stored if flags.c_contiguous and flags.writeable else np.array(stored, order="C")


class _Cast:
    """The conversion ``as_stored`` made at place ``at``, which ``OneStepAdd._call`` repeats for
    a value of the same kind: the same Python number type (written into ``out``), or an array
    (list, tensor) of the same dtype and shape (copied into ``out``, or cast with ``casting``)."""

    __slots__ = ("at", "casting", "dtype", "flat", "into", "kind", "one", "out", "read", "shape", "src", "to")

    def __init__(self, at: int, value: Any, target: tuple[Any, ...]) -> None:
        _name, dtype, shape, _ndim = target
        self.at, self.kind, self.dtype = at, type(value), dtype
        number = is_number(value, dtype)  # as_stored read it as stored (np.array)
        arr = np.empty((), dtype) if number else to_numpy(value)
        self.one = arr.size == 1  # copied as a Python number (item): no array made, ints range-checked
        # Read as numpy each time: a list, or a tensor of several values (of one value, a
        # tensor's or numpy scalar's own dtype and shape are compared, and item() reads it).
        self.read = not number and self.kind is not np.ndarray and not (self.one and hasattr(value, "dtype"))
        seen = arr if number or self.read else value
        self.src: Any = None if number else seen.dtype
        self.shape = seen.shape
        self.casting: str | None = None  # None: copied into ``out``, a view of it in the value's shape
        if dtype.kind in "iu" and not self.one and not np.can_cast(arr.dtype, dtype, "safe"):
            self.casting = "same_value"  # range-checked (ValueError on numpy < 2.3: never repeated)
        elif self.read and arr.dtype == dtype:
            self.casting = "no"  # a tensor of the stored dtype: read in place
        if self.casting is None:
            self.out = np.empty(shape, dtype)
            self.into = self.out.reshape(arr.shape)  # as_stored only adds unit axes
            self.flat = self.out.reshape(-1)
        self.to = None if arr.shape == shape else shape  # the shape a cast is viewed in

