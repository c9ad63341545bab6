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

    def set_from_priorities(self, slots: np.ndarray, valid: np.ndarray, priority: np.ndarray,
                            alpha: float) -> None:
        """Leaf of each slot = ``priority[slot]^alpha`` where ``valid[slot]``, else 0."""
        set_from_priorities(self.sums, self.mins, self.base, self.min_base, slots, valid,
                            priority, alpha)

    def draw(self, uniforms: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Leaves for ``uniforms`` in [0, 1): (leaf index, probability, importance weight)."""
        return draw_weighted(self.sums, self.mins, self.base, uniforms, beta)

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


# The kernels below walk all items one tree level at a time rather than one item to the
# root and back: the loads of different items are independent, so the CPU overlaps
# their cache misses (a 1M-leaf tree does not fit in cache).


@numba.njit(cache=True, nogil=True)
def _propagate(sums, mins, base, min_base, leaves):
    """Recompute the ancestors of ``leaves`` (leaf indices) in both trees."""
    n = leaves.shape[0]
    node = np.empty(n, np.int64)
    for j in range(n):
        node[j] = (base + leaves[j]) >> 1
    while node[0] >= 1:
        for j in range(n):
            i = node[j]
            sums[i] = sums[2 * i] + sums[2 * i + 1]
            node[j] = i >> 1
    for j in range(n):
        block = leaves[j] // BLOCK
        lo = base + block * BLOCK
        # A tree with fewer than BLOCK leaves has one short block: stay inside ``sums``.
        hi = min(lo + BLOCK, 2 * base)
        m = np.inf
        for k in range(lo, hi):
            v = sums[k]
            if 0.0 < v < m:
                m = v
        mins[min_base + block] = m
        node[j] = (min_base + block) >> 1
    while node[0] >= 1:
        for j in range(n):
            i = node[j]
            mins[i] = min(mins[2 * i], mins[2 * i + 1])
            node[j] = i >> 1


@numba.njit(cache=True, nogil=True)
def set_leaves(sums, mins, base, min_base, idx, values):
    """Set leaves and recompute their ancestors in both trees."""
    if idx.shape[0] == 0:
        return
    for j in range(idx.shape[0]):
        sums[base + idx[j]] = values[j]
    _propagate(sums, mins, base, min_base, idx)


@numba.njit(cache=True, nogil=True)
def set_from_priorities(sums, mins, base, min_base, slots, valid, priority, alpha):
    """Leaf of each slot = ``priority[slot]^alpha`` where ``valid[slot]`` and the priority
    is positive, else 0."""
    if slots.shape[0] == 0:
        return
    for j in range(slots.shape[0]):
        s = slots[j]
        # p > 0 first: with alpha = 0, 0**0 would be 1 and a priority-0 start drawable.
        sums[base + s] = float(priority[s]) ** alpha if valid[s] and priority[s] > 0 else 0.0
    _propagate(sums, mins, base, min_base, slots)


@numba.njit(cache=True, nogil=True)
def find_prefix(sums, base, targets):
    """For each target, descend to the leaf whose prefix range contains it.

    A child with zero mass is never entered while its sibling has mass, so rounding at
    a boundary can not land on a zero leaf.
    """
    n = targets.shape[0]
    node = np.ones(n, np.int64)
    u = targets.copy()
    while base > 1 and node[0] < base:
        for j in range(n):
            i = node[j]
            left = sums[2 * i]
            if (u[j] < left and left > 0.0) or sums[2 * i + 1] <= 0.0:
                node[j] = 2 * i
            else:
                u[j] -= left
                node[j] = 2 * i + 1
    return node - base


@numba.njit(cache=True, nogil=True)
def draw_weighted(sums, mins, base, uniforms, beta):
    """Leaves for uniforms in [0, 1), their probabilities and importance weights.

    ``w = (leaf / min_positive_leaf)^-beta``, which equals ``(N P(i))^-beta`` divided by
    its maximum over all drawable leaves.
    """
    total = sums[1]
    low = mins[1]
    starts = find_prefix(sums, base, uniforms * total)
    n = uniforms.shape[0]
    prob = np.empty(n, np.float64)
    weights = np.empty(n, np.float32)
    for j in range(n):
        v = sums[base + starts[j]]
        prob[j] = v / total
        weights[j] = (v / low) ** -beta
    return starts, prob, weights
