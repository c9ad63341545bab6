"""Sum tree with a blocked min tree, as compiled kernels over flat float64 arrays.

The sum tree is an implicit binary tree: node ``i`` has children ``2i`` and ``2i+1``,
the ``n`` leaves sit at ``P .. P+n-1`` with ``P`` the next power of two, and node 1 holds
the total. A parent is always recomputed as ``left + right`` (never by adding a delta),
so the tree is the same whatever order the leaves were set in: a restored buffer samples
exactly as the saved one did.

The min tree serves importance weights, which need the smallest positive leaf. Its
leaves are blocks of ``BLOCK`` sum-tree leaves (min over the positive ones, +inf when
none), which keeps it 1/``BLOCK`` the size of the sum tree.
"""

from __future__ import annotations

import numba
import numpy as np

BLOCK = 16


def tree_size(n_leaves: int) -> int:
    """Number of leaves rounded up to a power of two (at least 1)."""
    return 1 << max(0, int(n_leaves - 1).bit_length())


class SumMinTree:
    """Sum of leaves, prefix search, and the minimum positive leaf.

    Args:
        n_leaves: number of leaves (slots); all start at 0.
    """

    def __init__(self, n_leaves: int) -> None:
        self.n_leaves = n_leaves
        self.base = tree_size(n_leaves)
        self.sums = np.zeros(2 * self.base, np.float64)
        self.min_base = tree_size(-(-n_leaves // BLOCK))
        self.mins = np.full(2 * self.min_base, np.inf, np.float64)

    @property
    def total(self) -> float:
        """Sum of all leaves."""
        return float(self.sums[1])

    @property
    def min_positive(self) -> float:
        """Smallest positive leaf (inf when every leaf is 0)."""
        return float(self.mins[1])

    def leaves(self, idx: np.ndarray) -> np.ndarray:
        """Values of leaves ``idx``."""
        return self.sums[self.base + idx]

    def set(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` to ``values`` (>= 0) and update both trees."""
        set_leaves(self.sums, self.mins, self.base, self.min_base, idx, values.astype(np.float64))

    def rebuild(self, values: np.ndarray) -> None:
        """Set every leaf at once from ``values`` (length ``n_leaves``), bottom up."""
        self.sums[:] = 0.0
        self.sums[self.base:self.base + self.n_leaves] = values
        level = self.base
        while level > 1:
            child = self.sums[level:2 * level]
            self.sums[level // 2:level] = child[0::2] + child[1::2]
            level //= 2
        padded = np.full(self.min_base * BLOCK, np.inf)
        padded[:self.n_leaves] = np.where(values > 0, values, np.inf)
        self.mins[:] = np.inf
        self.mins[self.min_base:] = padded.reshape(self.min_base, BLOCK).min(axis=1)
        level = self.min_base
        while level > 1:
            child = self.mins[level:2 * level]
            self.mins[level // 2:level] = np.minimum(child[0::2], child[1::2])
            level //= 2

    def find(self, targets: np.ndarray) -> np.ndarray:
        """Leaf index for each target mass in ``[0, total)`` (prefix-sum search)."""
        return find_prefix(self.sums, self.base, targets)


@numba.njit(cache=True, nogil=True)
def set_leaves(sums, mins, base, min_base, idx, values):
    """Set leaves and recompute their ancestors in both trees."""
    for j in range(idx.shape[0]):
        i = idx[j] + base
        sums[i] = values[j]
        i //= 2
        while i >= 1:
            sums[i] = sums[2 * i] + sums[2 * i + 1]
            i //= 2
    for j in range(idx.shape[0]):
        block = idx[j] // BLOCK
        lo = base + block * BLOCK
        m = np.inf
        for k in range(lo, lo + BLOCK):
            v = sums[k]
            if 0.0 < v < m:
                m = v
        i = min_base + block
        if mins[i] == m:
            continue
        mins[i] = m
        i //= 2
        while i >= 1:
            mins[i] = min(mins[2 * i], mins[2 * i + 1])
            i //= 2


@numba.njit(cache=True, nogil=True)
def find_prefix(sums, base, targets):
    """For each target, descend to the leaf whose prefix range contains it.

    A child with zero mass is never entered while its sibling has mass, so rounding at
    a boundary can not land on a zero leaf.
    """
    out = np.empty(targets.shape[0], np.int64)
    for j in range(targets.shape[0]):
        u = targets[j]
        i = 1
        while i < base:
            left = sums[2 * i]
            if (u < left and left > 0.0) or sums[2 * i + 1] <= 0.0:
                i = 2 * i
            else:
                u -= left
                i = 2 * i + 1
        out[j] = i - base
    return out
