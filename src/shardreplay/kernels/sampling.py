"""Compiled rejection step of uniform sampling."""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)
from shardreplay.kernels.copy import prefetch_rows


@numba.njit(cache=True, nogil=True)
def written_total(pos, cap):
    """Written slots over all rows: the sum of ``min(pos[r], cap)``."""
    total = 0
    for p in pos:
        total += min(p, cap)
    return total


@numba.njit(cache=True, nogil=True)
def draw_written(raw, pos, cap, valid, out, got, sample_rows):
    """Append uniform draws over the valid written slots to ``out[got:]`` until it is
    full; returns the new fill count. The lines of each accepted slot's storage
    ``sample_rows`` are prefetched (as ``kernels.sum_tree.draw_weighted`` does).

    Row ``r``'s written slots are its first ``min(pos[r], cap)``, from slot ``r * cap``.
    Each 64-bit ``raw`` word gives an ordinal over the written slots from its top ``k``
    bits (``2**k`` the smallest power of two >= the written count), rejected when it is
    past the count or its slot is not valid: the accepted slots are uniform over the
    valid ones, exactly, and in the order of their words. Nothing is drawn when no slot
    is written.
    """
    rows = pos.shape[0]
    ends = np.empty(rows, np.int64)  # cumulative written counts
    total = 0
    aligned = True  # every row holds as many: a division instead of a search
    for r in range(rows):
        w = min(pos[r], cap)
        aligned &= w == min(pos[0], cap)
        total += w
        ends[r] = total
    if total == 0:
        return got
    length = ends[0]
    bits = 0
    while (1 << bits) < total:
        bits += 1
    shift = np.uint64(64 - bits)
    # Three passes: slots, then their flags, then the accepted ones. The flag loads are
    # cache misses on a large array; with no branch on them in their loop, the CPU keeps
    # many in flight.
    slots = np.empty(raw.shape[0], np.int64)
    k = 0
    for x in raw:
        u = np.int64(x >> shift) if bits > 0 else np.int64(0)
        if u < total:
            if aligned:
                row = u // length
                slots[k] = row * cap + u - row * length
            else:
                row = np.searchsorted(ends, u, side="right")
                slots[k] = row * cap + u - (ends[row - 1] if row > 0 else 0)
            k += 1
    flags = np.empty(k, np.bool_)
    for i in range(k):
        flags[i] = valid[slots[i]]
    for i in range(k):
        if got == out.shape[0]:
            break
        if flags[i]:
            out[got] = slots[i]
            prefetch_rows(sample_rows, slots[i])
            got += 1
    return got
