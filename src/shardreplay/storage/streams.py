"""StreamStorage: per-stream rings of steps plus the bookkeeping beside them (the slot
layout: docs/internals.md, "Stream storage")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardreplay.errors import ShardReplayError
from shardreplay.kernels.codes import numba_takes
from shardreplay.kernels.lazy import lazy
from shardreplay.spec import Spec
from shardreplay.spec.keys import new_key_tag
from shardreplay.spec.spec import DISCOUNT_DTYPE, STEP_TYPE_DTYPE
from shardreplay.storage.allocate import (
    MADV_COLLAPSE,
    MADV_HUGEPAGE,
    MADV_NOHUGEPAGE,
    ArrayAllocator,
    advise_hugepages,
)
from shardreplay.storage.frames import FrameStore, StackPieces
from shardreplay.storage.starts import StartStore

if TYPE_CHECKING:
    from shardreplay.kernels import storage as kernels
    from shardreplay.kernels import windows as window_kernels
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    kernels = lazy("shardreplay.kernels.storage")
    window_kernels = lazy("shardreplay.kernels.windows")

# Per-slot arrays saved with the steps (beside the user's fields), with their dtypes (the
# one-step kernel, kernels/add_step.py, reads them in these).
STEP_ARRAYS: dict[str, np.dtype] = {
    "step_type": STEP_TYPE_DTYPE,
    "discount": DISCOUNT_DTYPE,
    "episode_id": np.dtype(np.int64),
    "generation": np.dtype(np.uint32),
    "priority": np.dtype(np.float32),
}

EPISODE_STEP_DTYPE = np.dtype(np.int32)
# ... and with sequence windows (period > 1), each step's offset in its episode.
SEQUENCE_STEP_ARRAYS: dict[str, np.dtype] = {**STEP_ARRAYS, "episode_step": EPISODE_STEP_DTYPE}


# Fields of at most this many bytes per step share the per-slot record (see __init__).
SMALL_FIELD_BYTES = 32


# A layout's gather plan: ((byte rows of each part, record offset of each part), extent).
_GatherPlan = tuple[tuple[tuple[np.ndarray, ...], np.ndarray], int]
# The windows of a batch size (kernels/windows.py): its params, its output bytes, and each
# record part's (name, dtype, shape [B, L, *field shape], byte offset in the output).
_WindowsPlan = tuple[np.ndarray, int, tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]]
_BLOCK_ALIGN = 64  # each block of the windows' output bytes starts on a cache line


def ring_runs(pos: np.ndarray, cap: int, start: np.ndarray | None = None) -> list[tuple[int, int]]:
    """``(first flat slot, steps)`` of each row's stored steps (of steps ``start[r]`` on,
    when given) of rows at positions ``pos`` of ``cap`` slots, row after row in time
    order: two runs per row, up to the ring's end, then from slot 0 (maybe empty)."""
    length = np.minimum(pos, cap) if start is None else np.minimum(pos - start, cap)
    first = (pos - length) % cap
    head = np.minimum(length, cap - first)
    rows = zip(first.tolist(), head.tolist(), length.tolist(), strict=True)
    return [run for r, (f, h, n) in enumerate(rows) for run in ((r * cap + f, h), (r * cap, n - h))]


def _nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return int(np.dtype(dtype).itemsize * np.prod(shape, dtype=np.int64))


def _c_order(value: np.ndarray) -> np.ndarray:
    return value if value.flags.c_contiguous else np.ascontiguousarray(value)


def _c_bytes(value: np.ndarray) -> np.ndarray:
    return _c_order(value).reshape(-1).view(np.uint8)


class StreamStorage:
    """Rings of steps for ``num_streams`` streams of ``stream_capacity`` steps each.

    It knows nothing of sampling: it stores steps, keeps episode ids and generations,
    and maintains which slots are valid window starts for windows of ``window`` steps.
    Arguments are checked by the buffer that owns it.
    """

    def __init__(self, spec: Spec, num_streams: int, stream_capacity: int, window: int,
                 allocator: ArrayAllocator, period: int = 1) -> None:
        self.spec = spec
        self.num_streams = num_streams
        self.stream_capacity = stream_capacity
        self.window = window
        n = num_streams * stream_capacity
        # Episode offsets (period > 1) live beside the records, not in them: buffers without
        # a period keep their layout and checkpoints byte for byte.
        self.period = period
        self.episode_step = allocator.zeros("episode_step", (n if period > 1 else 0,), EPISODE_STEP_DTYPE)
        # Frame-stacked fields keep their frames apart (frames.py); ``fields`` holds the others.
        self.stacked = {name: FrameStore(name, f, num_streams, stream_capacity, allocator)
                        for name, f in spec.fields.items() if f.frame_stack}
        # ``at_starts`` fields keep a row per window start only (starts.py).
        self.starts = {name: f for name, f in spec.fields.items() if f.at_starts}
        self.start_rows = StartStore(self.starts, num_streams, stream_capacity, period, allocator)
        plain = {name: f for name, f in spec.fields.items() if not (f.frame_stack or f.at_starts)}
        small = [name for name, f in plain.items() if _nbytes(f.dtype, f.shape) <= SMALL_FIELD_BYTES]
        # One packed record per slot for the bookkeeping and the small fields (docs/internals.md).
        record = np.dtype([(f"field.{name}", spec[name].dtype, spec[name].shape) for name in small]
                          + [(name, dtype) for name, dtype in STEP_ARRAYS.items()] + [("valid", np.bool_)])
        self.records = allocator.zeros("records", (n,), record)
        # The records as plain uint8 rows (memory-mapped ones too: numba types a structured
        # array, or a subclass, off its fast path).
        self.record_rows = np.asarray(self.records).view(np.uint8).reshape(n, -1)
        self._small = frozenset(small)
        self.fields = {name: (self.records[f"field.{name}"] if name in small else
                              allocator.zeros(f"field.{name}", (n, *f.shape), f.dtype))
                       for name, f in plain.items()}
        self.step_type = self.records["step_type"]
        self.discount = self.records["discount"]
        self.episode_id = self.records["episode_id"]
        self.generation = self.records["generation"]
        self.priority = self.records["priority"]
        self.valid = self.records["valid"]
        # Positions and counters share one array, so that a compiled write takes them as
        # one argument (storage/one_step.py): ``pos`` its first ``num_streams`` entries.
        self.pos_and_counters = np.zeros(num_streams + 2, np.int64)
        self.pos = self.pos_and_counters[:num_streams]
        self.all_rows = np.arange(num_streams, dtype=np.int64)  # pass this to write all rows
        self.counters = self.pos_and_counters[num_streams:]  # [next episode id, num_valid]
        # Added to every slot's write count in the keys handed out: a restore raises it, so
        # keys sampled before the save are stale afterwards (docs/semantics.md, "Keys").
        self.key_epoch = 0
        # The key tag of every key handed out (spec/keys.py): rejects keys of other buffers.
        self.key_tag = new_key_tag()
        self.clears = 0  # times emptied (restores): a checkpoint chain of older content ends
        # The write path's result scratch, and every field (discount last) as [S*C, bytes
        # per step] uint8 for the scatter of its values (fields with no bytes left out):
        # (name, travels as bytes (a dtype numba cannot take: float16), destination rows).
        self._out_slots = np.empty((2, num_streams * window), np.int64)
        self._out_flags = np.empty((2, num_streams * window), np.bool_)
        scattered = ((name, arr.dtype, self.byte_rows(name))
                     for name, arr in (*self.fields.items(), ("discount", self.discount)))
        self._scatter_fields = tuple((name, not numba_takes(dtype), rows) for name, dtype, rows in scattered
                                     if rows.shape[1])
        self.row_marks = np.zeros(num_streams, np.uint8)  # scratch of rows_distinct_in_range
        # What a draw prefetches of each window (kernels/sum_tree.draw_weighted, sampling.draw_written):
        # the records and the fields beside them, as (address, bytes per slot, per window).
        own = [self.record_rows, *(self.byte_rows(name) for name in plain if name not in self._small)]
        self.sample_rows = np.array([(r.ctypes.data, r.strides[0], window * r.strides[0]) for r in own
                                     if r.shape[1]], np.int64).reshape(-1, 3)
        self._gather_plans: dict[tuple, _GatherPlan] = {}  # see _gather_plan
        self._windows_plans: dict[int, _WindowsPlan] = {}  # see _windows_plan
        self.transition_plans: dict[tuple, Any] = {}  # buffer/transitions.py's, by field names and n

    def byte_rows(self, name: str) -> np.ndarray:
        """A ``[S*C, k]`` uint8 view of field ``name`` (a record field is a strided view)."""
        raw, offset, nbytes = self._byte_source(name)
        return raw[:, offset:offset + nbytes]

    @property
    def size(self) -> int:
        """Number of slots, ``num_streams * stream_capacity``."""
        return self.num_streams * self.stream_capacity

    @property
    def num_valid(self) -> int:
        """Number of valid window starts (``counters[1]``: the one-step writer's kernel adds to it)."""
        return int(self.counters[1])

    @num_valid.setter
    def num_valid(self, value: int) -> None:
        self.counters[1] = value

    @property
    def num_steps(self) -> int:
        """Number of stored steps."""
        return int(np.minimum(self.pos, self.stream_capacity).sum())

    def write(self, steps: Mapping[str, np.ndarray], rows: np.ndarray, t_len: int,
              priorities: np.ndarray | None, default_priority: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write validated steps ``[len(rows), T, ...]`` (or ``[len(rows), ...]`` when
        ``t_len == 1``) at the end of each row; ``t_len <= stream_capacity``.

        Returns the flat slots whose validity was recomputed, their validity, and
        whether each became valid with this write: views of scratch arrays that the next
        write overwrites.
        """
        n_rows = rows.shape[0]
        need = n_rows * (t_len + self.window - 1)
        if need > self._out_slots.shape[1]:
            self._out_slots = np.empty((2, need), np.int64)
            self._out_flags = np.empty((2, need), np.bool_)
        out_slots, out_flags = self._out_slots, self._out_flags
        pos = self.pos
        types = steps["step_type"]
        if types.ndim != 2:
            types = types.reshape(n_rows, t_len)
        before = self._previous_steps(rows) if self.period > 1 else None
        # Frame-stacked fields are checked against the stored stacks first (this may
        # raise: nothing is written yet).
        frame_plans = [(store, stacks, store.plan(stacks, types, rows, pos, self.step_type).copy())
                       for store, stacks in ((store, store.as_frame_bytes(steps[name], t_len))
                                             for name, store in self.stacked.items())] if self.stacked else ()
        prios = _NO_PRIORITIES if priorities is None else priorities.reshape(n_rows, t_len)
        n_out, delta = kernels.write_steps(
            self.step_type, self.episode_id, self.generation, self.priority, self.valid, pos, self.counters,
            rows, types, prios, priorities is not None, default_priority, self.stream_capacity, self.window,
            out_slots, out_flags)
        # The user's fields are written after the bookkeeping: the spec was checked
        # before, so nothing below can fail half-way.
        flat = out_slots[0, :n_rows * t_len]
        if flat.shape[0]:
            pairs = tuple((rows, _c_bytes(steps[name]) if as_bytes else _c_order(steps[name]))
                          for name, as_bytes, rows in self._scatter_fields)
            kernels.scatter_fields(pairs, flat)
        for store, stacks, counts in frame_plans:
            store.append(stacks, rows, out_slots[0, :n_rows * t_len], counts)
        if before is not None:
            delta -= self._after_write(before, out_slots[0, :n_rows * t_len].reshape(n_rows, t_len),
                                       out_slots[1, :n_out], out_flags[0, :n_out], out_flags[1, :n_out])
        if self.starts:  # their episode offsets are set already
            written = out_slots[0, :n_rows * t_len].reshape(n_rows, t_len)
            self.start_rows.write(steps, rows, written, self.is_start(written))
        self.num_valid += delta
        # Views of scratch arrays: valid until the next write (the sampler uses them at once).
        return out_slots[1, :n_out], out_flags[0, :n_out], out_flags[1, :n_out]

    # -- sequence windows (period > 1, docs/semantics.md): rule 1 is the kernels', the grid is here.
    def _previous_steps(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Episode id and episode offset of the stored step before the next write of each
        of ``rows`` (id -1 where the row is empty). Read before the write: a chunk of
        ``stream_capacity`` steps overwrites that slot."""
        cap = self.stream_capacity
        p0 = self.pos[rows]
        prev = rows * cap + (p0 - 1) % cap
        ids = np.where(p0 > 0, self.episode_id[prev], -1)
        offsets = np.where(p0 > 0, self.episode_step[prev], -1).astype(np.int64)
        return ids, offsets

    def _after_write(self, before: tuple[np.ndarray, np.ndarray], written: np.ndarray, recomputed: np.ndarray,
                     valid: np.ndarray, newly: np.ndarray) -> int:
        """Set the episode offsets of the ``written`` slots ``[rows, T]`` (their episode ids
        are already written), then clear the starts among ``recomputed`` that are off the
        period grid (in storage and in the ``valid``/``newly`` flags the sampler is told);
        returns how many were cleared."""
        prev_ids, prev_offsets = before
        ids = self.episode_id[written]
        t_len = ids.shape[1]
        if t_len:
            earlier = np.concatenate([prev_ids[:, None], ids[:, :-1]], axis=1)
            steps = np.arange(t_len)
            # The last step of each row that began an episode (-1: the row's episode goes on).
            began = np.maximum.accumulate(np.where(ids != earlier, steps, -1), axis=1)
            offsets = np.where(began >= 0, steps - began, prev_offsets[:, None] + 1 + steps)
            self.episode_step[written] = offsets
        off_grid = valid & (self.episode_step[recomputed] % self.period != 0)
        n = int(off_grid.sum())
        if n:
            self.valid[recomputed[off_grid]] = False
            valid[off_grid] = False
            newly[off_grid] = False
        return n

    def is_start(self, slots: np.ndarray) -> np.ndarray:
        """Whether each stored step at ``slots`` can start a window by its episode offset
        (a multiple of ``period``; every step when ``period`` is 1)."""
        if self.period == 1:
            return np.ones(slots.shape, np.bool_)
        return self.episode_step[slots] % self.period == 0

    def windows(self, starts: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """Gather the windows starting at flat slots ``starts``.

        Returns arrays ``[B, L, ...]`` (user fields, step_type, discount, episode_id;
        ``[B, 1, ...]`` for ``at_starts`` fields: their value at the window's first
        step), the mask ``[B, L]`` and the keys ``[B]`` (shard 0). The record fields,
        the mask and the keys are views of one array, filled in one compiled call
        (``kernels/windows.py``).
        """
        starts = np.ascontiguousarray(starts, np.int64)
        n, window = starts.shape[0], self.window
        params, total, blocks = self._windows_plan(n)
        # The key epoch and tag change on a restore: read each time.
        params[window_kernels.EPOCH] = self.key_epoch
        params[window_kernels.TAG] = self.key_tag
        dst = np.empty(total, np.uint8)
        idx = np.empty((n, window), np.int64)
        window_kernels.gather_windows(starts, self.step_type, self.generation, self.record_rows, params, dst,
                                      idx.reshape(-1))
        parts = {name: np.ndarray(shape, dtype, dst, offset) for name, dtype, shape, offset in blocks}
        data = {name: (parts[name] if name in self._small else arr.take(idx, axis=0))
                for name, arr in self.fields.items()}
        for name, store in self.stacked.items():
            data[name] = store.gather(idx)
        for name in self.starts:
            data[name] = self.start_rows.gather(name, starts)[:, None]
        for name in ("step_type", "discount", "episode_id"):
            data[name] = parts[name]
        return data, parts["mask"], parts["keys"]

    def _windows_plan(self, n: int) -> _WindowsPlan:
        """The plan of :meth:`windows` for batches of ``n`` windows (built once per size)."""
        plan = self._windows_plans.get(n)
        if plan is None:
            window = self.window
            fields: Mapping[str, Any] = self.records.dtype.fields or {}
            parts = [(name, f"field.{name}", self.spec[name].dtype, self.spec[name].shape)
                     for name in self.fields if name in self._small]
            parts += [(name, name, STEP_ARRAYS[name], ()) for name in ("step_type", "discount", "episode_id")]
            words: list[int] = []
            blocks: list[tuple[str, np.dtype, tuple[int, ...], int]] = []
            total = 0
            for name, key, dtype, shape in parts:
                size = _nbytes(dtype, shape)
                blocks.append((name, dtype, (n, window, *shape), total))
                if size:
                    words += [int(fields[key][1]), size, total]
                total += -(-n * window * size // _BLOCK_ALIGN) * _BLOCK_ALIGN
            mask_at, keys_at = total, total + -(-n * window // _BLOCK_ALIGN) * _BLOCK_ALIGN
            blocks += [("mask", np.dtype(np.bool_), (n, window), mask_at),
                       ("keys", np.dtype(np.int64), (n,), keys_at)]
            total = keys_at + 8 * n
            params = np.array([self.stream_capacity, window, 0, 0, mask_at, keys_at, len(words) // 3, *words],
                              np.int64)
            plan = self._windows_plans[n] = (params, total, tuple(blocks))
        return plan

    def window_indices(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The flat slots ``[B, L]`` of the windows at flat ``starts``, their mask ``[B, L]``
        (positions after the episode's LAST repeat its slot, masked) and keys ``[B]``
        (shard 0): :meth:`windows`' walk, copying no record part."""
        starts = np.ascontiguousarray(starts, np.int64)
        n, window = starts.shape[0], self.window
        keys_at = -(-n * window // 8) * 8  # the mask first, then the keys
        params = np.array([self.stream_capacity, window, self.key_epoch, self.key_tag, 0, keys_at, 0],
                          np.int64)
        dst = np.empty(keys_at + 8 * n, np.uint8)
        idx = np.empty((n, window), np.int64)
        window_kernels.gather_windows(starts, self.step_type, self.generation, self.record_rows, params, dst,
                                      idx.reshape(-1))
        return idx, dst[:n * window].view(np.bool_).reshape(n, window), dst[keys_at:].view(np.int64)

    def windows_into(self, starts: np.ndarray, out: np.ndarray, offsets: Mapping[str, int],
                     dst_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write the windows starting at flat slots ``starts`` into rows ``dst_rows`` of
        packed records ``out`` (C-contiguous uint8 ``[N, record bytes]``), without an
        intermediate copy.

        ``offsets`` maps a field name (or ``step_type``, ``discount``, ``episode_id``) to
        the byte offset of its ``[L, *shape]`` values in a record. Returns the mask
        ``[B, L]`` and the keys ``[B]`` (shard 0), for the caller to place.

        Raises:
            ValueError: ``out`` is not C-contiguous uint8, or a row or offset is out of range.
        """
        if out.dtype != np.uint8 or out.ndim != 2 or not out.flags.c_contiguous:
            raise ValueError("out must be a C-contiguous uint8 array [rows, record bytes]")
        if dst_rows.size and (dst_rows.min() < 0 or dst_rows.max() >= out.shape[0]):
            raise ValueError("dst_rows must name rows of out")
        stacked = {name: offsets[name] for name in self.stacked if name in offsets}
        at_starts = {name: offsets[name] for name in self.starts if name in offsets}
        columns, extent = self._gather_plan({k: v for k, v in offsets.items()
                                             if k not in stacked and k not in at_starts})
        for name, offset in stacked.items():
            store = self.stacked[name]
            extent = max(extent, offset + self.window * store.stack * store.frame_bytes)
        for name, offset in at_starts.items():
            extent = max(extent, offset + self.start_rows.row_bytes[name])
        if extent > out.shape[1]:
            raise ValueError("offsets must leave room for a window of every part in a record")
        idx, mask, keys = self.window_indices(starts)
        rows = np.ascontiguousarray(dst_rows, np.int64)
        sources, out_offsets = columns
        if sources:
            window_kernels.gather_window_parts(sources, out_offsets, idx, rows, out)
        for name, offset in stacked.items():
            self.stacked[name].gather_into(idx, rows, out, int(offset))
        for name, offset in at_starts.items():
            self.start_rows.gather_into(name, starts, rows, out, int(offset))
        return mask, keys

    def _gather_plan(self, offsets: Mapping[str, int]) -> _GatherPlan:
        """Per part with bytes: its ``[S*C, k]`` uint8 rows and its record offset (int64),
        and the record bytes they need. Built once per layout."""
        key = tuple(offsets.items())
        plan = self._gather_plans.get(key)
        if plan is None:
            parts = [(self.byte_rows(name), offset) for name, offset in key]
            parts = [(rows, offset) for rows, offset in parts if rows.shape[1]]
            sources = tuple(rows for rows, _offset in parts)
            out_offsets = np.array([offset for _rows, offset in parts], np.int64)
            extent = max((offset + self.window * rows.shape[1] for rows, offset in parts), default=0)
            plan = self._gather_plans[key] = ((sources, out_offsets), int(extent))
        return plan

    def _byte_source(self, name: str) -> tuple[np.ndarray, int, int]:
        """``(C-contiguous uint8 rows [S*C, k], offset, bytes per step)`` holding ``name``."""
        key = name if name in STEP_ARRAYS else f"field.{name}"
        fields = self.records.dtype.fields  # never None: the records are a structured array
        if fields is not None and key in fields:
            dtype, offset = fields[key][:2]
            return self.record_rows, offset, dtype.itemsize
        arr = np.asarray(self.fields[name])
        return arr.reshape(arr.shape[0], -1).view(np.uint8), 0, _nbytes(arr.dtype, arr.shape[1:])

    # -- state in time order --------------------------------------------------------------
    def stored_slots(self, pos: np.ndarray | None = None, start: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Flat slots of all stored steps (of steps ``start[r]`` on, when given), row by row
        in time order, and the row lengths (of rows at positions ``pos``, by default the
        storage's)."""
        pos, cap = self.pos if pos is None else np.asarray(pos, np.int64), self.stream_capacity
        starts = pos - np.minimum(pos, cap) if start is None else np.asarray(start, np.int64)
        lengths = pos - starts
        row_of = np.repeat(np.arange(pos.shape[0]), lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        within = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
        return row_of * cap + (np.repeat(starts, lengths) + within) % cap, lengths

    def valid_after_import(self, steps: Mapping[str, np.ndarray]) -> np.ndarray:
        """Validity flags ``[S*C]`` that a restore of ``steps`` (a state's arrays) would
        give, computed on scratch arrays (this storage is not touched).

        ``steps`` must be checked for shapes and dtypes already.
        """
        pos = np.asarray(steps["row_pos"], np.int64)
        slots, _lengths = self.stored_slots(pos)
        step_type = np.zeros(self.size, STEP_TYPE_DTYPE)
        episode_id = np.zeros(self.size, np.int64)
        step_type[slots] = steps["step_type"]
        episode_id[slots] = steps["episode_id"]
        offsets = np.zeros(self.size if self.period > 1 else 0, EPISODE_STEP_DTYPE)
        if self.period > 1:
            offsets[slots] = steps["episode_step"]
        valid = np.zeros(self.size, np.bool_)
        self._validity(step_type, episode_id, offsets, valid, pos)
        return valid

    def row_pieces(self, arr: np.ndarray, start: np.ndarray | None = None) -> list[np.ndarray]:
        """Views of ``arr`` holding each row's stored steps (from step ``start[r]`` on, when
        given) in time order (ring order unrolled: at most two contiguous pieces per row),
        for writing without a copy."""
        return [arr[a:a + n] for a, n in ring_runs(self.pos, self.stream_capacity, start) if n]

    def _joined(self, arr: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
        """A copy of ``arr``'s stored steps (from ``start``) in (row, time) order."""
        pieces = self.row_pieces(arr, start)
        return np.concatenate(pieces) if pieces else arr[:0].copy()

    def export_steps(self, copy_fields: bool = True, start: np.ndarray | None = None
                     ) -> dict[str, np.ndarray]:
        """Every stored step in (row, time) order (with ``start``, each row's steps from step ``start[r]``
        on): user fields and per-step arrays, plus ``row_length`` and ``row_pos`` (of every stored step).
        Without ``copy_fields`` plain fields come as lists of views (:meth:`row_pieces`) and frame-stacked
        fields as lists of :class:`StackPieces` (whole stacks, built when each piece is read). An
        ``at_starts`` field comes as the rows of the start steps only (in the same order), always copied."""
        slots = self.stored_slots(start=start)[0] if self.stacked or self.starts else np.empty(0, np.int64)
        # Copied by ring slices, not gathered by slot (a fancy index): the same arrays, a
        # fraction of the time, which a background save spends on the training thread.
        out: dict[str, Any] = {f"field.{name}": self._joined(arr, start) if copy_fields else
                               self.row_pieces(arr, start) for name, arr in self.fields.items()}
        for name, store in self.stacked.items():
            lazy = not copy_fields and slots.shape[0]
            out[f"field.{name}"] = StackPieces.split(store, slots) if lazy else store.gather(slots)
        for name in self.starts:
            out[f"field.{name}"] = self.start_rows.export(name, slots)
        for name in self.step_arrays:
            out[name] = self._joined(getattr(self, name), start)
        out["row_length"] = np.minimum(self.pos, self.stream_capacity)
        out["row_pos"] = self.pos.copy()
        return out

    def regroup(self) -> None:
        """Map the written arrays on transparent huge pages again where the kernel can
        (``MADV_COLLAPSE``): a write while a fork shares them splits each huge page it hits,
        and a fork copies a page-table entry per 4 KiB page (docs/semantics.md,
        "Background saves"). The frame rings' hint against huge pages, which collapsing
        obeys, is lifted meanwhile: their faults stay 4 KiB ones (docs/internals.md)."""
        for arr in self.fields.values():  # views (the small fields, in the records) are small
            if arr.base is None:
                advise_hugepages(arr, MADV_COLLAPSE)
        for store in self.stacked.values():
            for ring in store.written():
                advise_hugepages(ring, MADV_HUGEPAGE, MADV_COLLAPSE, MADV_NOHUGEPAGE)

    @property
    def step_arrays(self) -> dict[str, np.dtype]:
        """The per-slot arrays saved beside the fields: :data:`STEP_ARRAYS`, plus
        ``episode_step`` for sequence windows (``period > 1``)."""
        return SEQUENCE_STEP_ARRAYS if self.period > 1 else STEP_ARRAYS

    def clear(self) -> None:
        """Forget every step: positions, bookkeeping and validity back to zero."""
        self.clears += 1
        for name in self.step_arrays:
            getattr(self, name)[:] = 0
        self.valid[:] = False
        for store in self.stacked.values():
            store.clear()
        self.start_rows.clear()
        self.pos[:] = 0
        self.counters[:] = 0

    def finish_restore(self, pos: np.ndarray, next_episode_id: int,
                       starts: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        """After arrays were filled directly (checkpoint load): set positions, keep the
        start rows ``starts[name] = (slots, rows)`` of ``at_starts`` fields (each stored
        start step's row among them), rebuild validity.

        Raises:
            ShardReplayError: a stored start step has no row in ``starts``; nothing of
                the start rows is kept then.
        """
        self.pos[:] = pos
        self.counters[0] = next_episode_id
        if self.starts:
            self._place_starts(starts or {})
        self.num_valid = self._validity(self.step_type, self.episode_id, self.episode_step, self.valid,
                                        self.pos)

    def _place_starts(self, starts: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Keep the rows of ``starts`` (by slot) of every stored start step."""
        slots, lengths = self.stored_slots()
        is_start = self.is_start(slots)
        wanted = slots[is_start]
        values = {}
        for name, field in self.starts.items():
            placed, rows = starts.get(name, (np.zeros(0, np.int64), np.zeros((0, *field.shape), field.dtype)))
            index = np.full(self.size, -1, np.int64)
            index[placed] = np.arange(placed.shape[0])
            pick = index[wanted]
            if pick.shape[0] and int(pick.min()) < 0:
                self.start_rows.clear()
                raise ShardReplayError(f"field {name!r}: {int((pick < 0).sum())} start steps have no "
                                       "saved start row")
            values[name] = np.asarray(rows)[pick]
        self.start_rows.load(slots, lengths, is_start, values)

    def _validity(self, step_type: np.ndarray, episode_id: np.ndarray, episode_step: np.ndarray,
                  valid: np.ndarray, pos: np.ndarray) -> int:
        """Fill ``valid`` for every stored start of these arrays (rule 1, then the period
        grid); returns the count."""
        count = kernels.recompute_validity(step_type, episode_id, valid, pos, self.stream_capacity,
                                           self.window)
        if self.period > 1:
            off_grid = valid & (episode_step % self.period != 0)
            valid[off_grid] = False
            count -= int(off_grid.sum())
        return int(count)


_NO_PRIORITIES = np.zeros((1, 1), np.float32)

