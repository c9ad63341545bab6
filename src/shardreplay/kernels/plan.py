"""Compiled greedy bin balancing of checkpoint restore plans."""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)


@numba.njit(cache=True, nogil=True)
def balance_longest_first(order, sizes, caps):
    """Bin of each item: items in ``order`` each go to the bin least filled for its
    capacity ``caps[b]`` (the smallest ``filled / caps``, compared as integer cross
    products; ties: the lowest bin), filling it by the item's size. With every capacity
    alike this is the least-filled bin."""
    bins = caps.shape[0]
    filled = np.zeros(bins, np.int64)
    assign = np.zeros(sizes.shape[0], np.int64)
    for i in order:
        b = 0
        for j in range(1, bins):
            if filled[j] * caps[b] < filled[b] * caps[j]:
                b = j
        assign[i] = b
        filled[b] += sizes[i]
    return assign
