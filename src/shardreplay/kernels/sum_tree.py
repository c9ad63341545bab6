"""The 8-ary sum tree with a blocked min tree over flat arrays: compiled kernels.

Sums: level ``D`` holds the ``n`` leaves, each level above holds the sums of groups of
``ARITY`` nodes of the level below, up to the root (level 0, the total); level ``l``
starts at ``offsets[l]`` of ``sums`` and has ``sizes[l]`` nodes. The 8 children of a
node are contiguous (one cache line of float64). A parent is always recomputed as the
sum of its children in order (never by adding a delta), so the tree is the same
whatever order its leaves were set in: a restored buffer samples exactly as the saved
one did.

The min tree ``mins`` is a binary heap (root at 1, leaves from ``min_base``) whose
leaves are blocks of ``BLOCK`` sum-tree leaves: the minimum over the positive ones,
+inf when none.

The kernels walk all items one tree level at a time rather than one item to the root
and back: loads of different items are independent, so the CPU overlaps their cache
misses.
"""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.kernels import (
    cache_lock,  # noqa: F401  (numba's cache, safe across processes)
    codes,
)

BLOCK, ARITY = codes.BLOCK, codes.ARITY  # defined in codes.py (numba-free: read at import above)


@numba.njit(cache=True, nogil=True, inline="always")
def _group_sum(sums, child_offset, child_size, parent):
    first = parent * ARITY
    total = 0.0
    for c in range(first, min(first + ARITY, child_size)):
        total += sums[child_offset + c]
    return total


@numba.njit(cache=True, nogil=True)
def rebuild_sums(sums, sizes, offsets):
    """Recompute every level above the leaves from the leaves."""
    for level in range(sizes.shape[0] - 2, -1, -1):
        for node in range(sizes[level]):
            sums[offsets[level] + node] = _group_sum(sums, offsets[level + 1], sizes[level + 1], node)


@numba.njit(cache=True, nogil=True)
def _propagate(sums, mins, sizes, offsets, min_base, leaves):
    """Recompute the ancestors of ``leaves`` (leaf indices) in both trees."""
    # Leaves come mostly in increasing order, so equal ancestors are neighbours: a node
    # equal to the previous item's is recomputed once per level, not once per leaf.
    n = leaves.shape[0]
    node = leaves.copy()
    for level in range(sizes.shape[0] - 2, -1, -1):
        prev = -1
        for j in range(n):
            parent = node[j] // ARITY
            node[j] = parent
            if parent != prev:
                sums[offsets[level] + parent] = _group_sum(sums, offsets[level + 1], sizes[level + 1],
                                                           parent)
                prev = parent
    leaf_offset = offsets[sizes.shape[0] - 1]
    n_leaves = sizes[sizes.shape[0] - 1]
    prev = -1
    for j in range(n):
        block = leaves[j] // BLOCK
        node[j] = (min_base + block) >> 1
        if block == prev:
            continue
        prev = block
        m = np.inf
        for k in range(block * BLOCK, min(block * BLOCK + BLOCK, n_leaves)):
            v = sums[leaf_offset + k]
            if 0.0 < v < m:
                m = v
        mins[min_base + block] = m
    while node[0] >= 1:
        prev = -1
        for j in range(n):
            i = node[j]
            node[j] = i >> 1
            if i != prev:
                mins[i] = min(mins[2 * i], mins[2 * i + 1])
                prev = i


@numba.njit(cache=True, nogil=True)
def leaves_from_priorities(valid, priority, alpha):
    """Every leaf value as :func:`set_from_priorities` computes it (the same compiled pow:
    numpy's differs in the last bit for ~5% of values, and a restored tree must equal
    the saved one bit for bit)."""
    out = np.zeros(priority.shape[0], np.float64)
    for s in range(priority.shape[0]):
        p = float(priority[s])
        if valid[s] and p > 0.0:
            out[s] = p ** alpha
    return out


@numba.njit(cache=True, nogil=True)
def set_from_priorities(sums, mins, sizes, offsets, min_base, slots, valid, priority, alpha):
    """Leaf of each slot = ``priority[slot]^alpha`` where ``valid[slot]`` and the priority
    is positive, else 0 (``0**0 == 1`` must not make a priority-0 start drawable)."""
    leaf_offset = offsets[sizes.shape[0] - 1]
    changed = np.empty(slots.shape[0], np.int64)
    n_changed = 0
    last_p, last_leaf = -1.0, 0.0  # new steps share one priority: one pow for all of them
    for j in range(slots.shape[0]):
        s = slots[j]
        p = float(priority[s])
        leaf = 0.0
        if valid[s] and p > 0.0:
            if p != last_p:
                last_p, last_leaf = p, p ** alpha
            leaf = last_leaf
        # Parents are pure functions of their children: unchanged leaves need no walk up.
        if sums[leaf_offset + s] != leaf:
            sums[leaf_offset + s] = leaf
            changed[n_changed] = s
            n_changed += 1
    if n_changed:
        _propagate(sums, mins, sizes, offsets, min_base, changed[:n_changed])


@numba.njit(cache=True, nogil=True)
def find_prefix(sums, sizes, offsets, targets):
    """For each target, descend to the leaf whose prefix range contains it.

    Zero-mass children are never entered; when rounding leaves a target at or past the
    end of a group, the last child with mass is taken.
    """
    n = targets.shape[0]
    node = np.zeros(n, np.int64)
    u = targets.copy()
    for level in range(1, sizes.shape[0]):
        offset, size = offsets[level], sizes[level]
        for j in range(n):
            first = node[j] * ARITY
            chosen, last_positive = -1, first
            for c in range(first, min(first + ARITY, size)):
                v = sums[offset + c]
                if v > 0.0:
                    last_positive = c
                    if u[j] < v:
                        chosen = c
                        break
                    u[j] -= v
            if chosen < 0:
                chosen = last_positive
                u[j] = sums[offset + chosen] * 0.5
            node[j] = chosen
    return node


@numba.njit(cache=True, nogil=True)
def draw_weighted(sums, mins, sizes, offsets, uniforms, beta):
    """Leaves for uniforms in [0, 1), their probabilities and importance weights.

    ``w = (leaf / min_positive_leaf)^-beta``, which equals ``(N P(i))^-beta`` divided by
    its maximum over all drawable leaves.
    """
    total = sums[0]
    low = mins[1]
    starts = find_prefix(sums, sizes, offsets, uniforms * total)
    leaf_offset = offsets[sizes.shape[0] - 1]
    n = uniforms.shape[0]
    prob = np.empty(n, np.float64)
    weights = np.empty(n, np.float32)
    for j in range(n):
        v = sums[leaf_offset + starts[j]]
        prob[j] = v / total
        weights[j] = (v / low) ** -beta
    return starts, prob, weights
