"""An 8-ary sum tree with a blocked min tree, as compiled kernels over flat arrays.

Sums: level ``D`` holds the ``n`` leaves, each level above holds the sums of groups of
8 nodes of the level below, up to the root (level 0, the total). The 8 children of a
node are contiguous (one cache line of float64), so a prefix search touches one cache
line per level, and the tree holds about 8/7 n values instead of 2 n.
The tree is the same whatever order its leaves were set in (kernels/sum_tree.py), so a
restored buffer samples exactly as the saved one did.

The min tree serves importance weights, which need the smallest positive leaf. It is a
binary tree whose leaves are blocks of ``BLOCK`` sum-tree leaves (min over the positive
ones, +inf when none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shardreplay.kernels.codes import ARITY, BLOCK
from shardreplay.kernels.lazy import lazy

if TYPE_CHECKING:
    from shardreplay.kernels import sum_tree as kernels
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    kernels = lazy("shardreplay.kernels.sum_tree")


def tree_size(n_leaves: int) -> int:
    """Number of leaves rounded up to a power of two (at least 1)."""
    return 1 << max(0, int(n_leaves - 1).bit_length())


def _levels(n_leaves: int) -> tuple[np.ndarray, np.ndarray]:
    """Sizes and offsets (multiples of 8, for alignment) of the levels, root first."""
    sizes = [max(n_leaves, 1)]
    while sizes[-1] > 1 or len(sizes) == 1:
        sizes.append(-(-sizes[-1] // ARITY))
    sizes.reverse()
    offsets, at = [], 0
    for s in sizes:
        offsets.append(at)
        at += -(-s // ARITY) * ARITY
    offsets.append(at)
    return np.array(sizes, np.int64), np.array(offsets, np.int64)


class SumMinTree:
    """Sum of leaves, prefix search, and the minimum positive leaf.

    Args:
        n_leaves: number of leaves (slots); all start at 0.
    """

    def __init__(self, n_leaves: int) -> None:
        self.n_leaves = n_leaves
        self.sizes, self.offsets = _levels(n_leaves)
        self.sums = np.zeros(int(self.offsets[-1]), np.float64)
        self.leaf_offset = int(self.offsets[-2])
        self.min_base = tree_size(-(-n_leaves // BLOCK))
        self.mins = np.full(2 * self.min_base, np.inf, np.float64)

    @property
    def total(self) -> float:
        """Sum of all leaves."""
        return float(self.sums[0])

    @property
    def min_positive(self) -> float:
        """Smallest positive leaf (inf when every leaf is 0)."""
        return float(self.mins[1])

    def leaves(self, idx: np.ndarray) -> np.ndarray:
        """Values of leaves ``idx``."""
        return self.sums[self.leaf_offset + idx]

    def set_from_priorities(self, slots: np.ndarray, valid: np.ndarray, priority: np.ndarray,
                            alpha: float) -> None:
        """Leaf of each slot = ``priority[slot]^alpha`` where ``valid[slot]`` and the
        priority is positive, else 0 (so priority 0 is never drawn, also with alpha 0)."""
        kernels.set_from_priorities(self.sums, self.mins, self.sizes, self.offsets, self.min_base, slots,
                            valid, priority, alpha)

    def draw(self, uniforms: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Leaves for ``uniforms`` in [0, 1): (leaf index, probability, importance weight)."""
        return kernels.draw_weighted(self.sums, self.mins, self.sizes, self.offsets, uniforms, beta)

    def rebuild(self, values: np.ndarray) -> None:
        """Set every leaf at once from ``values`` (length ``n_leaves``), bottom up."""
        self.sums[:] = 0.0
        self.sums[self.leaf_offset:self.leaf_offset + self.n_leaves] = values
        kernels.rebuild_sums(self.sums, self.sizes, self.offsets)
        padded = np.full(self.min_base * BLOCK, np.inf)
        padded[:self.n_leaves] = np.where(values > 0, values, np.inf)
        self.mins[:] = np.inf
        self.mins[self.min_base:] = padded.reshape(self.min_base, BLOCK).min(axis=1)
        level = self.min_base
        while level > 1:
            child = self.mins[level:2 * level]
            self.mins[level // 2:level] = np.minimum(child[0::2], child[1::2])
            level //= 2
