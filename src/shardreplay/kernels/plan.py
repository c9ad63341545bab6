"""Compiled greedy bin balancing of checkpoint restore plans."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def balance_longest_first(order, sizes, bins):
    """Bin of each item: items in ``order`` each go to the least-filled of ``bins`` bins
    (ties: the lowest bin), filling it by the item's size."""
    filled = np.zeros(bins, np.int64)
    assign = np.zeros(sizes.shape[0], np.int64)
    for i in order:
        b = np.argmin(filled)  # the first least-filled bin, as a heap of (filled, bin) pops
        assign[i] = b
        filled[b] += sizes[i]
    return assign
