"""Twins of kernels/storage.py's writes: the bookkeeping of a write (vectorised over steps
and rows) and byte scatters by numpy indexing."""

from __future__ import annotations

import numpy as np

FIRST, LAST = 0, 2


def write_steps(step_type: np.ndarray, episode_id: np.ndarray, generation: np.ndarray,
                priority: np.ndarray, valid: np.ndarray, pos: np.ndarray, counters: np.ndarray,
                rows: np.ndarray, types: np.ndarray, prios: np.ndarray, has_prios: bool,
                default_prio: float, cap: int, window: int, out_slots: np.ndarray,
                out_flags: np.ndarray) -> tuple[int, int]:
    """``kernels.storage.write_steps``: same arguments, effects and results
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
    # Starts whose validity the write may change (docs/internals.md, "Stream storage"), row by row.
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
    """``kernels.storage.scatter_fields``: step ``i`` of each value to row
    ``slots[i]`` of its ``[N, k]`` uint8 destination."""
    n = slots.shape[0]
    for dst, value in pairs:
        dst[slots] = value.reshape(-1).view(np.uint8).reshape(n, dst.shape[1])
