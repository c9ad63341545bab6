"""References of kernels/sum_tree.py: level sums by in-order accumulation, level mins,
prefix search by a cumulative sum over the leaves."""

from __future__ import annotations

import numpy as np

from shardreplay.kernels.sum_tree import ARITY


def level_sums(leaves: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Every level, root first: each node the in-order sum of its ``ARITY`` children."""
    levels = [np.asarray(leaves, np.float64)]
    for size in sizes[-2::-1]:
        child = levels[0]
        padded = np.zeros(int(size) * ARITY)
        padded[:child.shape[0]] = child
        levels.insert(0, np.cumsum(padded.reshape(-1, ARITY), axis=1)[:, -1])
    return levels


def level_mins(leaves: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Every level above the leaves, root first: each node the smallest positive leaf
    below it, inf when none."""
    levels = [np.where(np.asarray(leaves, np.float64) > 0, leaves, np.inf)]
    for size in sizes[-2::-1]:
        padded = np.full(int(size) * ARITY, np.inf)
        padded[:levels[0].shape[0]] = levels[0]
        levels.insert(0, padded.reshape(-1, ARITY).min(axis=1))
    return levels[:-1]


def find_prefix(leaves: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The leaf ``i`` with ``sum(leaves[:i]) <= u < sum(leaves[:i+1])`` (so never a zero
    leaf), for targets below the total (the kernel maps the others, which only rounding
    makes, to some positive leaf)."""
    return np.searchsorted(np.cumsum(leaves), targets, side="right")


def min_positive(leaves: np.ndarray) -> float:
    """The smallest positive leaf, inf when none."""
    positive = leaves[leaves > 0]
    return float(positive.min()) if positive.size else float("inf")


def leaves_from_priorities(valid: np.ndarray, priority: np.ndarray, alpha: float) -> np.ndarray:
    """``priority^alpha`` where valid and positive, else 0 (C's pow, as compiled code uses)."""
    return np.array([float(p) ** alpha if v and p > 0 else 0.0 for v, p in zip(valid, priority, strict=True)])


def draw_weighted(leaves: np.ndarray, uniforms: np.ndarray, beta: float) -> tuple[np.ndarray, ...]:
    """Leaves for uniforms in [0, 1), ``P = leaf / total`` and ``w = (leaf / min)^-beta``."""
    total = np.cumsum(leaves)[-1]
    starts = find_prefix(leaves, uniforms * total)  # uniforms * total < total here
    v = leaves[starts]
    return starts, v / total, ((v / min_positive(leaves)) ** -beta).astype(np.float32)
