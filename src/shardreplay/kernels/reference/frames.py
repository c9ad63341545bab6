"""References of kernels/frames.py: stacks rebuilt and frames appended by plain indexing."""

from __future__ import annotations

import numpy as np

FIRST, LAST = 0, 2


def stack(frames: np.ndarray, row: int, ref: int, k: int) -> np.ndarray:
    """The ``[K, frame bytes]`` stack whose newest frame is at position ``ref`` of ``row``."""
    return frames[row, (ref - k + 1 + np.arange(k)) % frames.shape[1]]


def gather_stacks_rows(idx, cap, ref, frames, k, dst_rows, out, offset):
    """Stacks of every slot of ``idx [B, L]`` into rows ``dst_rows`` of ``out`` at ``offset``."""
    fb = frames.shape[2]
    for b in range(idx.shape[0]):
        stacks = [stack(frames, int(s) // cap, int(ref[s]), k) for s in idx[b]]
        out[dst_rows[b], offset:offset + idx.shape[1] * k * fb] = np.concatenate(stacks).reshape(-1)


def new_counts(values, types, rows, pos, step_type, ref, frames, cap):
    """Frames each step appends (1 when its stack continues the stored or previous one,
    else K), or ``(i, t)`` of the first step that continues its episode but not its stack."""
    n, t_len, k = values.shape[:3]
    counts = np.empty((n, t_len), np.int64)
    for i in range(n):
        r, p0 = int(rows[i]), int(pos[rows[i]])
        for t in range(t_len):
            if t == 0:
                prev_slot = r * cap + (p0 - 1) % cap
                has_prev = p0 > 0
                cont = has_prev and types[i, 0] != FIRST and step_type[prev_slot] != LAST
                prev = stack(frames, r, int(ref[prev_slot]), k) if has_prev else None
            else:
                cont = types[i, t] != FIRST and types[i, t - 1] != LAST
                prev = values[i, t - 1]
            same = prev is not None and np.array_equal(values[i, t, :k - 1], prev[1:])
            if cont and not same:
                return i, t
            counts[i, t] = 1 if same else k
    return counts


def append_frames(values, rows, written, counts, frames, ref, fpos):
    """Append each step's new frames (its newest one, or its whole stack) and record its ref."""
    t_len, k = values.shape[1], values.shape[2]
    for i, r in enumerate(rows):
        for t in range(t_len):
            for j in range(k - int(counts[i, t]), k):
                frames[r, fpos[r] % frames.shape[1]] = values[i, t, j]
                fpos[r] += 1
            ref[written[i * t_len + t]] = fpos[r] - 1
