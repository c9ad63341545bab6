"""The one-step writer: one step of every stream in one compiled call.

Every write of one step per stream goes through it (``ReplayBuffer.add``, ``extend`` of
one-step chunks, ``GymStepWriter``; ``Shard.write`` decides). A :class:`OneStepAdd` is
built once per storage and owns the record layout: the field order, the stored dtypes
and shapes, where each field sits in the per-slot record, and a compiled kernel
(``kernels/add_step.py``) that checks and writes a step in one call. A step takes it
when it is a plain ``dict`` of exactly the spec's flat names plus ``step_type`` (and
``discount``); values in another form than the stored one (another dtype or layout,
lists, scalars, torch tensors) are converted first (``spec/coerce.py``), so the kernel
is only ever called with the stored dtypes. Anything else (nested names), and any input
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
from shardreplay.kernels.codes import ADD_STEP_BAD_INPUT as BAD_INPUT
from shardreplay.kernels.codes import ADD_STEP_NEED_FRAMES as NEED_FRAMES
from shardreplay.kernels.lazy import lazy
from shardreplay.spec.coerce import as_stored, stored_values
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
                 on_write: OnWrite | None) -> OneStepAdd | None:
    """The short one-step path of ``storage``, or None when its spec has none (see the
    module docstring). Compiles (or loads from numba's cache) the kernel once.

    ``default_priority``: the priority of a new step now (None: always 1.0);
    ``on_write``: told the recomputed starts of every write (None: nobody is).
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
    return OneStepAdd(storage, default_priority, on_write)


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
                 on_write: OnWrite | None) -> None:
        spec = storage.spec
        s, window = storage.num_streams, storage.window
        names = tuple(n for n in spec.names if not spec[n].frame_stack)
        self._get = operator.itemgetter("step_type", *names)
        self._n_keys = len(spec.names) + 1  # a step without "discount"
        record_fields: Mapping[str, Any] = storage.records.dtype.fields or {}
        plan: list[int] = []
        # Fields of their own array (not in the record) are written here after the kernel.
        self._own: list[tuple[int, np.ndarray]] = []
        for i, name in enumerate(names):
            f = spec[name]
            at = record_fields.get(f"field.{name}")
            row_bytes = f.dtype.itemsize * int(np.prod(f.shape, dtype=np.int64))
            words = [at[1] if at is not None else -1, row_bytes, int(f.checks_finite), *f.shape]
            plan += words + [0] * (kernel.FIELD_WORDS - len(words))
            if at is None:
                self._own.append((i + 1, storage.fields[name]))
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
        # The records as plain uint8 rows (a plain ndarray even when they are memory-mapped):
        # numba types a structured array, or a subclass, off its fast path.
        rows = np.asarray(storage.records).view(np.uint8).reshape(storage.records.shape[0], -1)
        self._head = (rows, storage.pos_and_counters, self._state)
        canonical = (np.zeros(s, STEP_TYPE_DTYPE),
                     *(np.zeros((s, *spec[n].shape), spec[n].dtype) for n in names))
        self._storage = storage
        self._store: Any = None  # the FrameStore of a frame-stacked field
        if not storage.stacked:
            self._kernel = kernel.compiled_add_step((*self._head, *canonical))
        else:  # one compiled call with the frames (kernels/add_stacked.py)
            (name, store), = storage.stacked.items()
            shape = (s, *spec[name].shape)
            self._store = store
            self._fstate = sk.fstate_of(store.stream_capacity, store.frame_bytes, shape)
            self._get = operator.itemgetter("step_type", name, *names)
            self._own = [(i + 1, arr) for i, arr in self._own]  # the stack is value 1
            stack = np.zeros(shape, spec[name].dtype)
            types, *plain = canonical
            self._kernel = sk.compiled_add_stacked((*self._fused_head_now(), types, stack, *plain))
        # The values in the order of self._get, converted to the stored dtypes when they
        # come in another form (spec/coerce.py): never a failed compiled dispatch.
        stacked = tuple(storage.stacked)
        self._inputs = stored_values([(n, STEP_TYPE_DTYPE, (s,), 0) if n == "step_type" else
                                     (n, spec[n].dtype, (s, *spec[n].shape), len(spec[n].shape))
                                     for n in ("step_type", *stacked, *names)])
        self._default_priority = default_priority
        self._on_write = on_write
        # Whether the last step came in the stored form: the next one is then handed to the
        # kernel as is (its dispatcher refuses other types), without the conversion's check.
        self._typed = True
        self._simple = not self._own and self._store is None and default_priority is None and on_write is None

    def add(self, step: Mapping[str, Any]) -> bool:
        """Check and write ``step`` (a dict; see the module docstring) and tell the
        sampler what changed. False, with nothing written, when the step needs the full
        path (another kind of input, or a check fails)."""
        n = len(step)
        if n == self._n_keys and self._simple:
            # The common case: no discount, uniform sampling, every field in the record.
            try:
                values = self._get(step)
                if self._typed:  # the last step was in the stored form: no conversion asked
                    try:
                        delta = self._kernel(*self._head, *values)
                    except TypeError:  # the kernel takes only the stored dtypes: convert
                        self._typed = False
                        return self.add(step)
                else:
                    converted = self._inputs(values)
                    if converted is None:  # a value that cannot be stored: the full path says why
                        return False
                    self._typed = converted is values
                    delta = self._kernel(*self._head, *converted)
            except (KeyError, TypeError):  # a name missing
                return False
            if delta == BAD_INPUT:
                return False
            self._storage.num_valid += delta
            return True
        if n != self._n_keys:
            discount = step.get("discount")
            if n != self._n_keys + 1 or discount is None:
                return False
            if type(discount) is not np.ndarray or discount.dtype != DISCOUNT_DTYPE:
                try:
                    discount = as_stored("discount", discount, DISCOUNT_DTYPE, self._rows)
                except SpecMismatchError:
                    return False
            if discount.shape != self._rows:
                return False
            self._discount[:] = discount
        if self._default_priority is not None:
            self._priority[0] = self._default_priority()
        try:
            values = self._inputs(self._get(step))
            if values is None:
                return False
            if self._store is not None:
                delta = self._add_stacked(values)
            else:
                delta = self._kernel(*self._head, *values)
        except (KeyError, TypeError):  # a name missing
            return False
        finally:
            if n != self._n_keys:
                self._discount[:] = 1.0
        if delta == BAD_INPUT:
            return False
        if self._own or self._on_write is not None:
            self._after_write(values, delta)
        else:
            self._storage.num_valid += delta
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
