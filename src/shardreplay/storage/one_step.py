"""The one-step writer: one step of every stream in one compiled call.

Every write of one step per stream goes through it (``ReplayBuffer.add``, ``extend`` of
one-step chunks, ``GymStepWriter``; ``Shard.write`` decides). Which steps take it, how
inputs of other dtypes, layouts and types are taken, and which specs have no short path:
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
from shardreplay.kernels.codes import numba_takes, stored_code
from shardreplay.kernels.lazy import lazy
from shardreplay.spec.coerce import to_numpy, with_unit_axes
from shardreplay.spec.layout import DISCOUNT_DTYPE, STEP_TYPE_DTYPE

if TYPE_CHECKING:
    from shardreplay.kernels import add_step as kernel
    from shardreplay.storage.streams import StreamStorage
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    kernel = lazy("shardreplay.kernels.add_step")

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
        # The fields in the kernel's order: a frame stack, then the plain fields, ``first`` first
        # (the order of add_held's values), then in spec order.
        names = (*storage.stacked, *(n for n in (*first, *(m for m in spec.names if m not in first))
                                     if not spec[n].frame_stack))
        record_fields: Mapping[str, Any] = storage.records.dtype.fields or {}
        rows = storage.record_rows
        own = rows  # the kernel's own array: the first field not in the records (none: unused)
        plan: list[int] = []
        # Other fields of their own array are written here after the kernel, from the values
        # at these indices (the discount and the step types come first).
        self._own: list[tuple[int, np.ndarray]] = []
        for i, name in enumerate(names):
            f = spec[name]
            place = record_fields.get(f"field.{name}")
            row_bytes = f.dtype.itemsize * int(np.prod(f.shape, dtype=np.int64))
            offset = kernel.CALLER  # a frame stack: checked by the kernel, its frames appended by it
            if place is not None:
                offset = place[1]
            elif own is rows and not storage.stacked:
                offset, own = kernel.OWN, storage.byte_rows(name)
            elif not f.frame_stack:
                self._own.append((i + 2, storage.fields[name]))
            words = [offset, row_bytes, int(f.checks_finite), stored_code(f.dtype), *f.shape]
            plan += words + [0] * (kernel.FIELD_WORDS - len(words))
        rows_at, out_at, scratch_at, end = kernel.state_parts(s, len(names), window)
        self._state = np.zeros(end, np.int64)
        self._state[:kernel.AT_STEP_TYPE] = [storage.stream_capacity, window, s, len(names), 0, 0, 0]
        self._state[kernel.AT_STEP_TYPE:kernel.PLAN] = [record_fields[n][1] for n in kernel.RECORD_PARTS]
        self._state[kernel.PLAN:rows_at] = plan
        self._state[rows_at:out_at] = np.arange(s)
        self._priority = self._state[kernel.PRIORITY:kernel.PRIORITY + 1].view(np.float64)
        self._priority[0] = 1.0
        self._out = self._state[out_at:scratch_at].reshape(4, s * window)  # the kernel's results
        self._rows = (s,)
        self._ones = np.ones(s, DISCOUNT_DTYPE)  # the discount of a step without one
        # The values in the kernel's order: discount, step types, the fields.
        order = ("step_type", *names)
        self._get = operator.itemgetter(*order)
        self._get_discounted = operator.itemgetter("discount", *order)
        self._n_keys = len(order)  # a step without "discount"
        # Per value: as_stored's name, stored dtype, shape with the leading axis and the
        # field's own number of axes.
        targets = (("discount", DISCOUNT_DTYPE, self._rows, 0), ("step_type", STEP_TYPE_DTYPE, self._rows, 0),
                   *((n, spec[n].dtype, (s, *spec[n].shape), len(spec[n].shape)) for n in names))
        canonical = tuple(np.zeros(shape, dtype) for _n, dtype, shape, _d in targets)
        self._store: Any = next(iter(storage.stacked.values()), None)  # a frame-stacked field's FrameStore
        # The kernel's first arguments (a frame stack's arrays follow: _head_now).
        self._head = (rows, *((own,) if self._store is None else ()), storage.pos_and_counters, self._state)
        # Per write, 0 the add and 1 the held write (held_writer makes it): its compiled kernel,
        # the targets of its values and the places whose values came as lists, tensors or
        # numbers last time, read as numpy (place, type, shape read, stored shape, and for one
        # value the array it is put in, as 0-d and in the stored shape; none: values handed on
        # as they come).
        self._kernels: list[Any] = [kernel.compiled_for(kernel.entry(len(names), self._store is not None),
                                                        (*self._head_now(), *canonical)), None]
        self._targets: list[Any] = [targets, None]
        self._reads: list[tuple[tuple[Any, ...], ...]] = [(), ()]
        self._default_priority = default_priority
        self._on_write = on_write
        self._exact = (*storage.stacked, "done")  # values the kernel takes in the stored form only
        self._taken: Any = ()  # the values the last call handed to a kernel
        self._simple = not self._own and self._store is None and default_priority is None and on_write is None
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
        return self._call(0, self._head, values) != BAD_INPUT

    def _call(self, w: int, head: tuple[Any, ...], values: tuple[Any, ...]) -> int:
        """``self._kernels[w](*head, *values)``, a value read as numpy first (in its stored
        shape) at a place that came as a list, tensor or number last time, when it is of that
        type again; when the kernel has no form for the values' types, :meth:`_converted`. The
        values taken go to ``_taken``. Returns the kernel's result (BAD_INPUT: nothing written,
        the full path says why)."""
        try:
            taken: Any = values
            if read := self._reads[w]:
                taken, hit = list(values), False
                for at, kind, seen, shape, into, out in read:  # inline: a call per place costs as much
                    value = taken[at]
                    if type(value) is kind:
                        hit = True
                        if into is None:
                            value = to_numpy(value)
                            if value.shape != shape and value.shape == seen:
                                value = value.reshape(shape)
                            taken[at] = value
                        else:  # one value into a held array of its dtype: a fifth of np.asarray's
                            # cost (OverflowError out of range); a list or tensor of its shape only
                            if kind is list:
                                value = value[0] if len(value) == 1 else value  # else: numpy refuses it
                            elif seen and value.shape != seen:
                                raise ValueError(value.shape)
                            into[()] = value
                            taken[at] = out
                if not hit:  # numpy again: forgotten (the kernel refuses a list, which reads them again)
                    self._reads[w] = ()
            self._taken = taken
            return self._kernels[w](*head, *taken)
        except (TypeError, ValueError, OverflowError, SpecMismatchError):  # other kinds now
            return self._converted(w, head, values)

    def _converted(self, w: int, head: tuple[Any, ...], values: tuple[Any, ...]) -> int:
        """:meth:`_call` when the kernel is not the form for the values: each that is not a
        numpy array of its stored shape read as one (the places remembered), then the kernel's
        form for their types, kept for the next calls. BAD_INPUT when the kernel does not take
        them as they are (the full path converts them, or says why it cannot): a dtype that
        is not numeric, a float into a field that is not, other than a bool into a bool field
        (kernels/cast.py), step types not integers and C-contiguous, a frame stack or the held
        write's flags not in the stored form. (A form whose every value the kernel refuses is
        not compiled: seconds for nothing.)"""
        read, taken = [], list(values)
        try:
            for i, (value, (name, dtype, shape, ndim)) in enumerate(zip(values, self._targets[w],
                                                                        strict=True)):
                if type(value) is not np.ndarray or value.shape != shape:
                    arr = to_numpy(value)
                    taken[i] = arr if arr.shape == shape else with_unit_axes(name, arr, shape, ndim)
                    one = arr.size == 1 and (type(value) is not list or arr.ndim == 1)
                    out = np.empty(shape, arr.dtype) if one else None
                    into = out if out is None else out.reshape(())
                    # A tensor's shape is checked (one value of any shape would fill the array).
                    seen = () if one and not hasattr(value, "detach") else arr.shape
                    read.append((i, type(value), seen, shape, into, out))
                got, c = taken[i].dtype, taken[i].flags.c_contiguous
                if stored_code(got) < 0 or (got.kind == "f" and dtype.kind != "f") or (
                        dtype.kind == "b" and got.kind != "b") or (name == "step_type" and not (
                        got.kind in "iu" and c)) or (name in self._exact and not (got == dtype and c)):
                    return BAD_INPUT
        except (TypeError, ValueError, SpecMismatchError):  # a value that cannot be stored
            return BAD_INPUT
        self._taken, self._reads[w], dispatcher = taken, tuple(read), self._kernels[w]
        # A kind seen before first (its form refuses others at once): the steps at episode ends
        # may alternate kinds, and numba's typing of the values costs tens of microseconds.
        for form in (*dispatcher.forms.values(), None):
            if form is None and (form := kernel.form_for(dispatcher, (*head, *taken))) is None:
                return BAD_INPUT
            try:
                result = form(*head, *taken)
            except TypeError:  # not this form's kind
                continue
            self._kernels[w] = form  # kept for the next calls
            return result
        return BAD_INPUT  # pragma: no cover - form_for's form takes the values

    def _write(self, values: tuple[Any, ...], w: int = 0) -> int:
        """The write of ``values`` (kernel order) by the add, or (``w`` 1) by ``held_writer``'s
        (``values`` then have no discount and end with next value, spare, terminated,
        truncated), and what follows it. Returns what ``held_writer``'s write returns."""
        if self._default_priority is not None:
            self._priority[0] = self._default_priority()
        delta = self._call(w, self._head_now(), values)
        if delta == NEED_FRAMES:  # a frame-stacked field's ring grown (nothing was written), again
            self._store.grow(int(self._state[kernel.N_OUT]))
            delta = self._kernels[0](*self._head_now(), *self._taken)
        if delta == BAD_INPUT:
            return 0
        if self._own or self._on_write is not None:
            self._after_write((self._ones, *self._taken) if w else self._taken)
        return 2 if delta >= _SMALL else 1

    def held_writer(self) -> Callable[..., int]:
        """``GymStepWriter``'s write (a spec of 3 plain fields, the ``first`` given):
        ``write(step_types, a, b, c, nxt, spare, terminated, truncated)`` checks ``nxt``
        as the next value of ``a``'s field, writes the step and copies ``nxt`` into
        ``spare``. Values of any kind are taken as :meth:`add` takes them. Returns 1
        (written), 2 (written; some env's episode ended) or 0 (nothing written: a value
        the full path refuses, or this writer was replaced)."""
        if self._kernels[1] is None:
            _ones, types, obs, action, reward = (np.zeros(t[2], t[1]) for t in self._targets[0])
            flags = np.zeros(self._rows, np.bool_)
            args = (*self._head, types, obs, action, reward, obs, obs.copy(), flags, flags)
            self._kernels[1] = kernel.compiled_for(kernel.add_held, args)
            # The form for gymnasium's float64 rewards too: made now, not in the first step.
            kernel.form_for(self._kernels[1], (*args[:7], reward.astype(np.float64), *args[8:]))
            flag, obs_target = ("done", np.dtype(np.bool_), self._rows, 0), self._targets[0][2]
            self._targets[1] = (*self._targets[0][1:], obs_target, obs_target, flag, flag)
        return self._write_held

    def _write_held(self, *values: Any) -> int:
        if not self.open:
            return 0
        if not self._simple:
            return self._write(values, 1)
        delta = self._call(1, self._head, values)
        return 1 if -_SMALL < delta < _SMALL else 0 if delta == BAD_INPUT else 2  # 1: no episode ended

    def _head_now(self) -> tuple[Any, ...]:
        # A frame store's arrays read each call, never kept: a write of the full path may grow
        # (replace) the ring, and a kept reference would hold the old one's memory.
        store = self._store
        return self._head if store is None else (*self._head, store.ref, store.frames, store.fpos)

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
