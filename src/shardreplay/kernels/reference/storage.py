"""References of kernels/storage.py: validity from its definition, bookkeeping of a write,
window indices, and byte scatters and gathers by numpy indexing."""

from __future__ import annotations

import numpy as np

from shardreplay.kernels.reference.keys import encode_keys

FIRST, MID, LAST = 0, 1, 2


def validity(step_type: np.ndarray, episode_id: np.ndarray, pos: np.ndarray, cap: int,
             window: int) -> np.ndarray:
    """Valid flag of every flat slot (kernels/storage.py's module docstring): a stored
    start whose window is stored and in its episode, or ends with a LAST inside it."""
    valid = np.zeros(pos.shape[0] * cap, bool)
    for r, p1 in enumerate(pos):
        for q in range(max(int(p1) - cap, 0), int(p1)):
            slots = [r * cap + (q + k) % cap for k in range(window)]
            ok = window == 1 or step_type[slots[0]] != LAST
            for k in range(1, window):
                if not ok:
                    break
                if q + k >= p1 or episode_id[slots[k]] != episode_id[slots[0]]:
                    ok = False
                elif step_type[slots[k]] == LAST:
                    break
            valid[slots[0]] = ok
    return valid


def write_steps(step_type, episode_id, generation, priority, valid, pos, counters, rows, types, prios,
                has_prios, default_prio, cap, window):
    """Apply a write in place as kernels.storage.write_steps does; returns (written flat
    slots, recomputed flat slots in order, change in the valid count)."""
    written, recomputed = [], []
    before = int(valid.sum())
    for i, r in enumerate(rows):
        p0 = int(pos[r])
        for t in range(types.shape[1]):
            p = p0 + t
            slot, prev = r * cap + p % cap, r * cap + (p - 1) % cap
            new_episode = p == 0 or types[i, t] == FIRST or step_type[prev] == LAST
            if new_episode:
                episode_id[slot] = counters[0]
                counters[0] += 1
            else:
                episode_id[slot] = episode_id[prev]
            step_type[slot] = types[i, t]
            generation[slot] += 1
            priority[slot] = prios[i, t] if has_prios else default_prio
            written.append(slot)
        p1 = p0 + types.shape[1]
        pos[r] = p1
        recomputed += [r * cap + q % cap for q in range(max(p0 - window + 1, p1 - cap, 0), p1)]
    valid[:] = validity(step_type, episode_id, pos, cap, window)
    return np.array(written, np.int64), np.array(recomputed, np.int64), int(valid.sum()) - before


def window_indices(starts, step_type, generation, cap, window, epoch, tag):
    """``(idx [B, L], mask [B, L], keys [B])`` of valid starts: positions after a LAST
    inside the window repeat the LAST's slot and are masked."""
    n = starts.shape[0]
    idx = np.empty((n, window), np.int64)
    mask = np.ones((n, window), bool)
    for b, s in enumerate(starts):
        base = s - s % cap
        slots = base + (s - base + np.arange(window)) % cap
        ends = np.flatnonzero(step_type[slots[1:]] == LAST)
        if ends.size:
            end = ends[0] + 1
            slots[end + 1:] = slots[end]
            mask[b, end + 1:] = False
        idx[b] = slots
    gens = generation[starts].astype(np.int64) + epoch
    keys = encode_keys(np.zeros(n, np.int64), np.full(n, tag), starts.astype(np.int64), gens)
    return idx, mask, keys


def rows_distinct_in_range(rows: np.ndarray, num_streams: int) -> bool:
    """Some rows, all in range, none repeated."""
    return bool(rows.size) and bool(((rows >= 0) & (rows < num_streams)).all()) \
        and np.unique(rows).size == rows.size


def scatter_fields(pairs, slots):
    """``dst[slots] = value's bytes`` for every ``(dst, value)`` (the last of repeated slots wins)."""
    for dst, value in pairs:
        dst[slots] = np.ascontiguousarray(value).view(np.uint8).reshape(slots.shape[0], dst.shape[1])


def gather_window_parts(sources, out_offset, idx, dst_rows, out):
    """Window ``b`` of part ``p`` (``[L, k]`` bytes) into row ``dst_rows[b]`` of ``out`` at
    byte ``out_offset[p]``."""
    for src, offset in zip(sources, out_offset, strict=True):
        k = src.shape[1]
        out[dst_rows, offset:offset + idx.shape[1] * k] = src[idx].reshape(idx.shape[0], idx.shape[1] * k)
