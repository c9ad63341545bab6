"""References of the small kernels: sampling.py, nstep.py, plan.py, returns.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

FIRST, LAST = 0, 2


def accept_valid(candidates: np.ndarray, valid: np.ndarray, out: np.ndarray, got: int) -> int:
    """Valid candidates appended in order to ``out[got:]`` until it is full."""
    take = candidates[valid[candidates]][:out.shape[0] - got]
    out[got:got + take.shape[0]] = take
    return got + take.shape[0]


def accept_written(ordinals: np.ndarray, ends: np.ndarray, cap: int, valid: np.ndarray, out: np.ndarray,
                   got: int) -> int:
    """:func:`accept_valid` of the flat slots of written-slot ordinals (row ``r`` holds
    ordinals ``ends[r-1] .. ends[r] - 1``, from slot ``r * cap``)."""
    row = np.searchsorted(ends, ordinals, side="right")
    starts = np.concatenate([[0], ends[:-1]])
    return accept_valid(row * cap + ordinals - starts[row], valid, out, got)


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
