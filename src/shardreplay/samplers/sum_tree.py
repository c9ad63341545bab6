"""An 8-ary sum and min tree, as compiled kernels over flat arrays.

Sums: level ``D`` holds the ``n`` leaves, each level above holds the sums of groups of
8 nodes of the level below, up to the root (level 0, the total). The 8 children of a
node are contiguous and 64-byte aligned (one cache line of float64), so a prefix search
touches one cache line per level (7 levels at 1M leaves, 9 at 100M), and the tree holds
about 8/7 n values instead of 2 n. Mins: each node above the leaves also holds the
smallest positive leaf below it, for importance weights. Parents are recomputed from
their children, never adjusted by deltas, so float64 sums do not drift, and the tree is
the same whatever order its leaves were set in (kernels/sum_tree.py): a restored buffer
samples exactly as the saved one did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shardreplay.kernels.codes import ARITY
from shardreplay.kernels.lazy import lazy

if TYPE_CHECKING:
    from shardreplay.kernels import sum_tree as kernels
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    kernels = lazy("shardreplay.kernels.sum_tree")


_NONE = np.zeros(0, np.float32)  # set_from_priorities without new priorities


def _aligned_zeros(n: int, fill: float = 0.0) -> np.ndarray:
    """A float64 array of ``n`` values starting on a 64-byte boundary (a group of 8
    children is then one cache line)."""
    raw = np.zeros(n + 8) if fill == 0.0 else np.full(n + 8, fill)  # zeros: pages untouched until written
    skip = (-raw.ctypes.data % 64) // 8
    return raw[skip:skip + n]


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
        self.levels = int(self.sizes.shape[0])
        self.sums = _aligned_zeros(int(self.offsets[-1]))
        self.leaf_offset = int(self.offsets[-2])
        self.mins = _aligned_zeros(self.leaf_offset, np.inf)  # the levels above the leaves

    @property
    def total(self) -> float:
        """Sum of all leaves."""
        return float(self.sums[0])

    @property
    def min_positive(self) -> float:
        """Smallest positive leaf (inf when every leaf is 0)."""
        return float(self.mins[0])

    def leaves(self, idx: np.ndarray) -> np.ndarray:
        """Values of leaves ``idx``."""
        return self.sums[self.leaf_offset + idx]

    def set_from_priorities(self, slots: np.ndarray, valid: np.ndarray, priority: np.ndarray,
                            alpha: float, new: np.ndarray = _NONE) -> float:
        """Leaf of each slot = ``priority[slot]^alpha`` where ``valid[slot]`` and the
        priority is positive, else 0 (so priority 0 is never drawn, also with alpha 0).
        ``new`` (float32, one per slot) is stored in ``priority`` first; returns its
        largest value (0 when none)."""
        return kernels.set_from_priorities(self.sums, self.mins, self.sizes, self.offsets, slots, valid,
                                           priority, alpha, new)[0]

    def draw(self, uniforms: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Leaves for ``uniforms`` in [0, 1): (leaf index, probability, importance weight)."""
        return kernels.draw_weighted(self.sums, self.mins, self.offsets, self.levels, uniforms, beta)

    def rebuild(self, values: np.ndarray) -> None:
        """Set every leaf at once from ``values`` (length ``n_leaves``), bottom up."""
        self.sums[:] = 0.0
        self.sums[self.leaf_offset:self.leaf_offset + self.n_leaves] = values
        self.mins[:] = np.inf
        kernels.rebuild(self.sums, self.mins, self.sizes, self.offsets)
