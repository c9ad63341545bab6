"""References of the small kernels: sampling.py, nstep.py, plan.py, returns.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

FIRST, LAST = 0, 2


def draw_written(raw: np.ndarray, pos: np.ndarray, cap: int, valid: np.ndarray, out: np.ndarray,
                 got: int) -> int:
    """Valid written slots of the raw words' top bits appended in order to ``out[got:]``
    until it is full; the new fill count."""
    lengths = np.minimum(pos, cap)
    total = int(lengths.sum())
    if total == 0:
        return got
    bits = (total - 1).bit_length()
    ordinals = (raw >> np.uint64(64 - bits)).astype(np.int64) if bits else np.zeros(raw.shape, np.int64)
    ordinals = ordinals[ordinals < total]
    ends = np.cumsum(lengths)
    row = np.searchsorted(ends, ordinals, side="right")
    slots = row * cap + ordinals - (ends - lengths)[row]
    take = slots[valid[slots]][:out.shape[0] - got]
    out[got:got + take.shape[0]] = take
    return got + take.shape[0]


def nstep_scalar(idx, mask, reward, discount, gamma, n):
    """``(ret, boot, m, last)`` per window (kernels.nstep.nstep_scalar's formulas)."""
    b = idx.shape[0]
    m = np.array([n if mask[i, 1:n + 1].all() else int(np.argmin(mask[i, 1:n + 1])) for i in range(b)])
    ret, boot = np.zeros(b), np.ones(b)
    for i in range(b):
        for k in range(m[i]):
            ret[i] += boot[i] * float(reward[idx[i, k]])  # in float64, as the kernel
            boot[i] *= gamma * float(discount[idx[i, k + 1]])
    return ret, boot, m, idx[np.arange(b), m]


def balance_longest_first(order: np.ndarray, sizes: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Each item in ``order`` to the bin least filled for its capacity, the lowest of ties."""
    filled = [0] * caps.shape[0]
    assign = np.zeros(sizes.shape[0], np.int64)
    for i in order:
        b = min(range(caps.shape[0]), key=lambda j: (Fraction(filled[j], int(caps[j])), j))
        assign[i] = b
        filled[b] += int(sizes[i])
    return assign


def track_returns(rows, reward, step_type, running, last_return):
    """Returns of the episodes a chunk finishes, in time order (``running`` and
    ``last_return`` updated in place)."""
    finished = []
    for t in range(step_type.shape[1]):
        for i, r in enumerate(rows):
            if step_type[i, t] == FIRST:
                running[r] = 0.0
            if step_type[i, t] == LAST:
                finished.append(running[r])
                last_return[r] = running[r]
            else:
                running[r] += reward[i, t]
    return np.array(finished)
