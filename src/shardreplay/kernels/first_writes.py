"""Numpy twins of the kernels a write runs, for a process's first writes (no numba).

Importing numba and its one-time set-up on the first compiled call cost about half a
second: a process that writes a few steps (a script, a test, an actor's first chunk) would
pay it all on its first write. The first :data:`NUMPY_WRITES` writes of a process run these
instead while numba is not loaded yet; each gives exactly what its compiled twin gives
(the same arrays, in place, and the same results; tests/kernels/test_first_writes.py
compares them over many writes), vectorised over steps and rows. After that budget the
compiled kernels load (kernels/lazy.py) and serve every call, as they do in any process
that imported numba already.

Checks (:func:`values_ok`, :func:`steps_ok`, :func:`is_finite`) do not spend that budget:
a process that only checks, such as an actor checking each chunk it sends, never loads
numba. A chunk's numpy check costs an actor a small fraction of the steps in the chunk,
numba's loading a large part of its start-up
(benchmarks/startup/RESULTS-actor.md).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["NUMPY_WRITES", "all_equal", "numpy_first", "rows_distinct_in_range", "scatter_fields",
           "steps_ok", "values_ok", "write_steps"]

from shardreplay.kernels.codes import (
    BAD_DISCOUNT,
    BAD_STEP_TYPE,
    DISCOUNTS,
    F32_EXPONENT,
    F64_EXPONENT,
    FINITE_F32,
    FINITE_F64,
    MAX_STEP_TYPE,
    STEP_TYPES,
    STEPS_OK,
)

FIRST, LAST = 0, 2

# Writes of a process served by numpy before the compiled kernels load: enough for a
# script's or an actor's first steps, few enough that a long run soon runs compiled.
NUMPY_WRITES = 64
_writes_left = NUMPY_WRITES


def numpy_first(spend: bool = False) -> bool:
    """Whether the numpy twins serve this call: numba is not imported yet and fewer than
    :data:`NUMPY_WRITES` writes were served. ``spend`` (a write, not a check) counts the
    call. Threads may race on the count: either answer gives the same results."""
    global _writes_left
    if _writes_left <= 0 or "numba" in sys.modules:
        return False
    if spend:
        _writes_left -= 1
    return True


def write_steps(step_type: np.ndarray, episode_id: np.ndarray, generation: np.ndarray,
                priority: np.ndarray, valid: np.ndarray, pos: np.ndarray, counters: np.ndarray,
                rows: np.ndarray, types: np.ndarray, prios: np.ndarray, has_prios: bool,
                default_prio: float, cap: int, window: int, out_slots: np.ndarray,
                out_flags: np.ndarray) -> tuple[int, int]:
    """``kernels.storage.write_steps`` in numpy: same arguments, effects and results
    (``rows`` distinct, ``types.shape[1] <= cap``, as the compiled one requires)."""
    n_rows, t_len = types.shape
    rows = rows.astype(np.int64, copy=False)
    p0 = pos[rows]
    base = rows * cap
    slots = base[:, None] + (p0[:, None] + np.arange(t_len)) % cap
    if t_len:
        _write_episodes(step_type, episode_id, counters, types, p0, base, slots, cap)
    flat = slots.reshape(-1)
    step_type[flat] = types.reshape(-1)
    generation[flat] += 1
    priority[flat] = prios.reshape(-1) if has_prios else default_prio
    delta = -int(np.count_nonzero(valid[flat]))
    valid[flat] = False
    out_slots[0, :flat.shape[0]] = flat
    p1 = p0 + t_len
    pos[rows] = p1
    # Starts whose validity the write may change (kernels/storage.py's docstring), row by row.
    lo = np.maximum(np.maximum(p0 - window + 1, p1 - cap), 0)
    counts = p1 - lo
    n_out = int(counts.sum())
    which = np.repeat(np.arange(n_rows), counts)
    q = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(n_out)
    q_base, q_p1 = base[which], p1[which]
    q_slot = q_base + q % cap
    was = valid[q_slot] & (q < p0[which])
    now = _valid_starts(step_type, episode_id, q, q_base, q_p1, cap, window)
    delta += int(np.count_nonzero(now)) - int(np.count_nonzero(valid[q_slot]))
    valid[q_slot] = now
    out_slots[1, :n_out] = q_slot
    out_flags[0, :n_out] = now
    out_flags[1, :n_out] = now & ~was
    return n_out, delta


def _write_episodes(step_type: np.ndarray, episode_id: np.ndarray, counters: np.ndarray,
                    types: np.ndarray, p0: np.ndarray, base: np.ndarray, slots: np.ndarray,
                    cap: int) -> None:
    """Episode ids of the written steps: a step opens a new episode (the next id, in row
    then time order) at position 0, at FIRST, or after a LAST; any other continues the
    episode of the step before it (stored, for a row's first written step)."""
    prev = base + (p0 - 1) % cap  # read before anything is written (t_len <= cap)
    new = np.empty(types.shape, np.bool_)
    new[:, 0] = (p0 == 0) | (types[:, 0] == FIRST) | (step_type[prev] == LAST)
    new[:, 1:] = (types[:, 1:] == FIRST) | (types[:, :-1] == LAST)
    new_ids = (counters[0] - 1 + np.cumsum(new.reshape(-1))).reshape(new.shape)
    counters[0] += np.count_nonzero(new)
    # Each step takes the id of the latest new episode at or before it in its row.
    opened = np.maximum.accumulate(np.where(new, np.arange(types.shape[1]), -1), axis=1)
    inherited = np.take_along_axis(new_ids, np.maximum(opened, 0), axis=1)
    episode_id[slots] = np.where(opened >= 0, inherited, episode_id[prev][:, None])


def _valid_starts(step_type: np.ndarray, episode_id: np.ndarray, q: np.ndarray, q_base: np.ndarray,
                  q_p1: np.ndarray, cap: int, window: int) -> np.ndarray:
    """Validity of absolute starts ``q`` (rows at ``q_base``, written up to ``q_p1``), as
    ``kernels.storage._is_valid_at``: one vector step per window position."""
    if window == 1:
        return np.ones(q.shape[0], np.bool_)
    first = q_base + q % cap
    episode = episode_id[first]
    now = step_type[first] != LAST
    open_ = now.copy()  # not decided yet
    for k in range(1, window):
        nxt = q_base + (q + k) % cap
        fail = open_ & ((q + k >= q_p1) | (episode_id[nxt] != episode))
        now &= ~fail
        open_ &= ~fail & (step_type[nxt] != LAST)  # a LAST inside the window closes it: valid
    return now


def scatter_fields(pairs: tuple[tuple[np.ndarray, np.ndarray], ...], slots: np.ndarray) -> None:
    """``kernels.storage.scatter_fields`` in numpy: step ``i`` of each value to row
    ``slots[i]`` of its ``[N, k]`` uint8 destination."""
    n = slots.shape[0]
    for dst, value in pairs:
        dst[slots] = value.reshape(-1).view(np.uint8).reshape(n, dst.shape[1])


def all_equal(pos: np.ndarray) -> bool:
    """``kernels.storage.all_equal`` in numpy."""
    return bool(pos.shape[0] == 0 or (pos == pos[0]).all())


def rows_distinct_in_range(rows: np.ndarray, num_streams: int, marks: np.ndarray) -> bool:
    """``kernels.storage.rows_distinct_in_range`` in numpy (``marks`` is left untouched)."""
    n = rows.shape[0]
    return bool(n > 0 and rows.min() >= 0 and rows.max() < num_streams and np.unique(rows).shape[0] == n)


def steps_ok(types: np.ndarray, discount: np.ndarray) -> int:
    """``kernels.validate.steps_ok`` in numpy."""
    if types.size and not ((types >= 0) & (types <= MAX_STEP_TYPE)).all():
        return BAD_STEP_TYPE
    if discount.size and not ((discount >= 0) & (discount <= 1)).all():
        return BAD_DISCOUNT
    return STEPS_OK


def values_ok(payload: np.ndarray, plan: np.ndarray) -> int:
    """``kernels.validate.values_ok`` in numpy: the index of the first row of ``plan``
    (``(kind, byte offset, count)``) whose values fail in the uint8 ``payload`` (its
    length a multiple of 8), or -1."""
    u8 = payload[:payload.shape[0] - payload.shape[0] % 8]
    for j, (kind, off, n) in enumerate(plan.tolist()):
        if n == 0:
            continue
        if kind == FINITE_F32:
            bad = not is_finite(u8.view(np.uint32)[off // 4:off // 4 + n], np.uint32(F32_EXPONENT))
        elif kind == FINITE_F64:
            bad = not is_finite(u8.view(np.uint64)[off // 8:off // 8 + n], np.uint64(F64_EXPONENT))
        elif kind == STEP_TYPES:
            bad = bool((u8[off:off + n] > MAX_STEP_TYPE).any())  # uint8: never below FIRST
        elif kind == DISCOUNTS:
            discounts = u8.view(np.float32)[off // 4:off // 4 + n]
            bad = not ((discounts >= 0) & (discounts <= 1)).all()  # NaN fails both
        else:
            bad = False
        if bad:
            return j
    return -1


def is_finite(words: np.ndarray, mask: Any) -> bool:
    """Whether ``kernels.validate.max_masked(words, mask) != mask`` (no float whose
    exponent bits are all set: no NaN or inf), for a non-empty array."""
    return bool(not (np.bitwise_and(words, mask) == mask).any())
