"""The one-step writer: one step of every stream in one compiled call.

Every write of one step per stream goes through it (``ReplayBuffer.add``, ``extend`` of
one-step chunks, ``GymStepWriter``; ``Shard.write`` decides). A :class:`OneStepAdd` is
built once per storage and owns the record layout: the field order, the stored dtypes
and shapes, where each field sits in the per-slot record, and a compiled kernel
(``kernels/add_step.py``) that checks and writes a step in one call. A step takes it
when it is a plain ``dict`` of exactly the spec's flat names plus ``step_type`` (and
``discount``); numpy arrays of another dtype or layout go to the kernel as they come (it
is compiled for each such kind, and casts), lists, scalars and torch tensors are
converted first (``spec/coerce.py``). Anything else (nested names), and any input
that fails a check, is left to the full validation (``Spec.validate`` and
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
from shardreplay.kernels.lazy import lazy
from shardreplay.spec.coerce import as_stored, stored_values, to_numpy
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
    if any(not _kernel_takes(f.dtype) or len(f.shape) > kernel.MAX_FIELD_NDIM or f.at_starts
           or (f.frame_stack and f.dtype.kind == "f") for f in spec.fields.values()):
        return None  # at_starts fields are kept by the full path (storage/starts.py)
    if storage.stacked and (len(storage.stacked) > 1 or len(spec.fields) == 1):
        return None  # the compiled stacked write takes one stack beside plain fields
    return OneStepAdd(storage, default_priority, on_write, first)


# The bookkeeping in each record, as the kernel reads it (kernels/add_step.py, AT_*).
_RECORD_PARTS = {"step_type": np.dtype(np.uint8), "discount": np.dtype(np.float32),
                 "episode_id": np.dtype(np.int64), "generation": np.dtype(np.uint32),
                 "priority": np.dtype(np.float32), "valid": np.dtype(np.bool_)}


def _kernel_takes(dtype: np.dtype) -> bool:
    return dtype.isnative and (dtype.kind in "biu" or dtype in (np.dtype(np.float32), np.dtype(np.float64)))


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
        self._names = names
        self._get = operator.itemgetter("step_type", *names)
        self._n_keys = len(spec.names) + 1  # a step without "discount"
        record_fields: Mapping[str, Any] = storage.records.dtype.fields or {}
        rows = _rows_of(storage.records)
        own = rows  # the kernel's own array: the first field not in the records (none: unused)
        plan: list[int] = []
        # Other fields of their own array are written here after the kernel.
        self._own: list[tuple[int, np.ndarray]] = []
        for i, name in enumerate(names):
            f = spec[name]
            at = record_fields.get(f"field.{name}")
            row_bytes = f.dtype.itemsize * int(np.prod(f.shape, dtype=np.int64))
            offset = kernel.CALLER
            if at is not None:
                offset = at[1]
            elif own is rows and not storage.stacked:
                offset, own = kernel.OWN, _rows_of(storage.fields[name])
            else:
                self._own.append((i + 1, storage.fields[name]))
            code = kernel.DTYPES.index(f.dtype) if f.dtype in kernel.DTYPES else -1
            low, high = _range_of(f.dtype)
            words = [offset, row_bytes, int(f.checks_finite), code, low, high, *f.shape]
            plan += words + [0] * (kernel.FIELD_WORDS - len(words))
        rows_at, out_at, discount_at, end = kernel.state_parts(s, len(names), window)
        self._state = np.zeros(end, np.int64)
        self._state[:kernel.AT_STEP_TYPE] = [storage.stream_capacity, window, s, len(names), 0, 0, 0]
        self._state[kernel.AT_STEP_TYPE:kernel.PLAN] = [record_fields[n][1] for n in kernel.RECORD_PARTS]
        self._state[kernel.PLAN:rows_at] = plan
        self._state[rows_at:out_at] = np.arange(s)
        self._priority = self._state[kernel.PRIORITY:kernel.PRIORITY + 1].view(np.float64)
        self._priority[0] = 1.0
        self._discount = self._state[discount_at:end].view(DISCOUNT_DTYPE)[:s]
        self._discount[:] = 1.0  # the discount of a step without one
        self._out = self._state[out_at:discount_at].reshape(4, s * window)  # the kernel's results
        self._rows = (s,)
        self._canonical = (np.zeros(s, STEP_TYPE_DTYPE),
                           *(np.zeros((s, *spec[n].shape), spec[n].dtype) for n in names))
        self._storage = storage
        self._store: Any = None  # the FrameStore of a frame-stacked field
        if not storage.stacked:
            self._head: tuple[np.ndarray, ...] = (rows, own, storage.pos_and_counters, self._state)
            self._kernel = kernel.compiled_add_step((*self._head, *self._canonical))
        else:  # one compiled call with the frames (kernels/add_stacked.py)
            (name, store), = storage.stacked.items()
            shape = (s, *spec[name].shape)
            self._head = (rows, storage.pos_and_counters, self._state)
            self._store = store
            self._fstate = sk.fstate_of(store.stream_capacity, store.frame_bytes, shape)
            self._get = operator.itemgetter("step_type", name, *names)
            self._own = [(i + 1, arr) for i, arr in self._own]  # the stack is value 1
            types, *plain = self._canonical
            stack = np.zeros(shape, spec[name].dtype)
            self._kernel = sk.compiled_add_stacked((*self._fused_head_now(), types, stack, *plain))
        # The values in the order of self._get, converted to the stored dtypes when they
        # come in another form (spec/coerce.py).
        stacked = tuple(storage.stacked)
        self._inputs = stored_values([(n, STEP_TYPE_DTYPE, (s,), 0) if n == "step_type" else
                                     (n, spec[n].dtype, (s, *spec[n].shape), len(spec[n].shape))
                                     for n in ("step_type", *stacked, *names)])
        self._default_priority = default_priority
        self._on_write = on_write
        # Whether the last step was handed to the kernel as it came (its dispatcher takes the
        # kinds of input it was compiled for, and refuses others at once); else converted.
        self._direct = True
        self._simple = not self._own and self._store is None and default_priority is None and on_write is None
        self._ndims = tuple(x.ndim for x in self._canonical)
        self._kinds = 0  # kinds of input compiled for beyond the stored one
        self._held: Any = None  # add_held's compiled kernel (held_writer builds it)
        # False while the shard wants every write through Shard.write (a fence attached,
        # or this writer replaced): held_writer's write then refuses.
        self.open = True

    def add(self, step: Mapping[str, Any]) -> bool:
        """Check and write ``step`` (a dict; see the module docstring) and tell the
        sampler what changed. False, with nothing written, when the step needs the full
        path (another kind of input, or a check fails)."""
        n = len(step)
        if n == self._n_keys and self._simple:
            # The common case: no discount, uniform sampling, every field in the kernel's arrays.
            try:
                values = self._get(step)
            except KeyError:  # a name missing
                return False
            if self._direct:  # the last step was handed on as is: so is this one
                try:
                    delta = self._kernel(*self._head, *values)
                except TypeError:  # a kind of input not compiled for
                    delta = self._natural(values)
            else:
                delta = self._natural(values)
            if delta == BAD_INPUT:
                return False
            self._storage.num_valid += delta
            return True
        if n != self._n_keys:
            discount = step.get("discount")
            if n != self._n_keys + 1 or discount is None:
                return False
            discount = to_numpy(discount)
            if discount.shape != self._rows or discount.dtype.kind not in "biuf":
                try:  # one env's discount without its axis, or a refusal that says why
                    discount = as_stored("discount", discount, DISCOUNT_DTYPE, self._rows)
                except SpecMismatchError:
                    return False
            self._discount[:] = discount  # cast as it is stored (bool: 0.0 / 1.0)
        try:
            values = self._inputs(self._get(step))
            if values is None:
                return False
            return self._write(values) > 0
        except (KeyError, TypeError):  # a name missing
            return False
        finally:
            if n != self._n_keys:
                self._discount[:] = 1.0

    def _natural(self, values: tuple[Any, ...]) -> int:
        """The write of values of a kind the kernel is not compiled for: numpy arrays of
        the fields' dimensions and numeric dtypes get a compiled form of their own (at
        most ``_KINDS_KEPT``: compiled now, or loaded from numba's cache), the rest are
        converted (``spec/coerce.py``); the next step is handed on as this one was."""
        if self._compilable(values):
            try:
                delta = self._kernel(*self._head, *values)
            except TypeError:  # a kind not compiled for yet
                if self._kinds >= _KINDS_KEPT:
                    delta = None
                else:
                    self._kinds += 1
                    kernel.compile_also(self._kernel, (*self._head, *values))
                    delta = self._kernel(*self._head, *values)
            if delta is not None:
                self._direct = True
                return delta
        converted = self._inputs(values)
        if converted is None:  # a value that cannot be stored: the full path says why
            return BAD_INPUT
        self._direct = converted is values
        return self._kernel(*self._head, *converted)

    def _compilable(self, values: tuple[Any, ...]) -> bool:
        """All numpy arrays of the stored dimensions, of dtypes the kernel casts."""
        return self._store is None and all(
            type(v) is np.ndarray and v.dtype in kernel.DTYPES and v.ndim == ndim
            for v, ndim in zip(values, self._ndims, strict=True))

    def _write(self, values: tuple[Any, ...], held: tuple[Any, ...] = ()) -> int:
        """The compiled write of ``values`` (converted), and what follows it; with
        ``held`` (next value, spare, terminated, truncated), ``held_writer``'s. Returns
        what ``held_writer``'s write returns."""
        if self._default_priority is not None:
            self._priority[0] = self._default_priority()
        if self._store is not None:
            delta = self._add_stacked(values)
        elif held:
            delta = self._held(*self._head, *values, *held)
        else:
            delta = self._kernel(*self._head, *values)
        if delta == BAD_INPUT:
            return 0
        done = delta >= DONE // 2
        if done:
            delta -= DONE
        if self._own or self._on_write is not None:
            self._after_write(values, delta)
        else:
            self._storage.num_valid += delta
        return 2 if done else 1

    def held_writer(self) -> Callable[..., int]:
        """``GymStepWriter``'s write (a spec of 3 plain fields, the ``first`` given):
        ``write(step_types, a, b, c, nxt, spare, terminated, truncated)`` checks ``nxt``
        as the next value of ``a``'s field, writes the step and copies ``nxt`` into
        ``spare``. Returns 1 (written), 2 (written; some env's episode ended) or 0
        (nothing written: a value of another form, or one the full path refuses)."""
        if self._held is None:
            types, obs, *rest = self._canonical
            flags = np.zeros(self._rows, np.bool_)
            args = (*self._head, types, obs, *rest, obs, obs.copy(), flags, flags)
            self._held = kernel.compiled_add_step(args, held=True)
        if self._simple:
            return self._add_held_simple
        return self._add_held

    def _add_held_simple(self, types: Any, a: Any, b: Any, c: Any, nxt: Any, spare: Any, term: Any,
                         trunc: Any) -> int:
        if not self.open:
            return 0
        try:
            delta = self._held(*self._head, types, a, b, c, nxt, spare, term, trunc)
        except TypeError:  # a kind of input not compiled for: compiled now, or converted by the caller
            if not self._held_compiled((types, a, b, c, nxt, spare, term, trunc)):
                return 0
            delta = self._held(*self._head, types, a, b, c, nxt, spare, term, trunc)
        if -_SMALL < delta < _SMALL:  # the usual case: written, no episode ended
            self._storage.num_valid += delta
            return 1
        if delta == BAD_INPUT:
            return 0
        self._storage.num_valid += delta - DONE
        return 2

    def _add_held(self, *args: Any) -> int:
        if not self.open:
            return 0
        try:
            return self._write(args[:4], args[4:])
        except TypeError:  # a kind of input not compiled for: compiled now, or converted by the caller
            return self._write(args[:4], args[4:]) if self._held_compiled(args) else 0

    def _held_compiled(self, args: tuple[Any, ...]) -> bool:
        """Whether ``held_writer``'s kernel now takes ``args`` (numpy arrays of the stored
        dimensions: compiled for their kind, at most ``_KINDS_KEPT``)."""
        values, (nxt, _spare, *flags) = args[:4], args[4:]
        if self._kinds >= _KINDS_KEPT or not self._compilable(values) or type(nxt) is not np.ndarray \
                or nxt.ndim != self._ndims[1] or nxt.dtype not in kernel.DTYPES \
                or not all(type(f) is np.ndarray and f.dtype == np.bool_ and f.ndim == 1 for f in flags):
            return False
        self._kinds += 1
        kernel.compile_also(self._held, (*self._head, *args))
        return True

    def _fused_head_now(self) -> tuple[Any, ...]:
        # Read each call, never kept: a write of the full path may grow (replace) the
        # ring, and a kept reference would hold the old one's memory.
        store = self._store
        return (*self._head, store.ref, store.frames, store.fpos, self._fstate)

    def _add_stacked(self, values: tuple[Any, ...]) -> int:
        """The one compiled call of a spec with a frame-stacked field: the change in
        valid starts, or BAD_INPUT (nothing written). Grows the ring when the kernel says
        it must (nothing written then), and calls again."""
        delta = self._kernel(*self._fused_head_now(), *values)
        if delta == NEED_FRAMES:
            self._store.grow(int(self._state[kernel.N_OUT]))
            delta = self._kernel(*self._fused_head_now(), *values)
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


_KINDS_KEPT = 8  # kinds of input compiled for, per writer, beyond the stored one (then: converted)
_SMALL = DONE // 2  # within +-: a change in valid starts


def _range_of(dtype: np.dtype) -> tuple[int, int]:
    """The values an integer dtype holds, as int64 words (uint64: up to int64's largest)."""
    if dtype.kind not in "iu":
        return 0, 0
    info = np.iinfo(dtype)
    return int(info.min), min(int(info.max), int(np.iinfo(np.int64).max))


def _rows_of(arr: np.ndarray) -> np.ndarray:
    """``arr`` as plain uint8 rows ``[N, row bytes]`` (a plain ndarray even when it is
    memory-mapped): numba types a structured array, or a subclass, off its fast path."""
    return np.asarray(arr).view(np.uint8).reshape(arr.shape[0], -1)
