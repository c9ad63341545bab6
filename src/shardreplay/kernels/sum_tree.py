"""The 8-ary sum and min tree over flat arrays: compiled kernels (the layout and why it
samples a restored buffer exactly as the saved one: docs/internals.md, "The sum tree")."""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.kernels import (
    cache_lock,  # noqa: F401  (numba's cache, safe across processes)
    codes,
)
from shardreplay.kernels.copy import prefetch, prefetch_rows
from shardreplay.kernels.keys import OK, resolve_keys

ARITY = codes.ARITY  # defined in codes.py (numba-free: read at import above)
PRIORITY_BLOCK = codes.PRIORITY_BLOCK


@numba.njit(cache=True, nogil=True, inline="always")
def _recompute(sums, mins, level, parent, offsets, leaf_level):
    """Sum and min of node ``parent`` of ``level`` from its children."""
    child = np.uint64(offsets[level + 1] + parent * ARITY)  # unsigned: no wraparound test per load
    total = 0.0
    low = np.inf
    if level + 1 == leaf_level:
        for c in range(ARITY):
            v = sums[child + np.uint64(c)]
            total += v
            low = min(low, v if v > 0.0 else np.inf)  # no branch: leaves are random
    else:
        for c in range(ARITY):
            total += sums[child + np.uint64(c)]
            low = min(low, mins[child + np.uint64(c)])
    at = np.uint64(offsets[level] + parent)
    sums[at] = total
    mins[at] = low


@numba.njit(cache=True, nogil=True)
def rebuild(sums, mins, sizes, offsets):
    """Recompute every level above the leaves (sums and mins) from the leaves."""
    leaf_level = sizes.shape[0] - 1
    for level in range(leaf_level - 1, -1, -1):
        for node in range(sizes[level]):
            _recompute(sums, mins, level, node, offsets, leaf_level)


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
def set_from_priorities(sums, mins, sizes, offsets, slots, valid, priority, alpha, new):
    """Store ``new[j]`` as ``priority[slots[j]]`` first when ``new`` is not empty (in
    order: a repeated slot keeps its last); then leaf of each slot = ``priority[slot]^alpha``
    where ``valid[slot]`` and the priority is positive, else 0 (``0**0 == 1`` must not
    make a priority-0 start drawable), and the ancestors of the changed leaves (recomputed
    from their children). Returns the largest of ``new`` (0 when empty)."""
    leaf_level = sizes.shape[0] - 1
    for s in slots:  # the leaves' cache lines requested together
        prefetch(sums.ctypes.data + 8 * (offsets[leaf_level] + s))
    top = 0.0
    for j in range(new.shape[0]):
        priority[np.uint64(slots[j])] = new[j]
        top = max(top, float(new[j]))
    node = np.empty(slots.shape[0], np.int64)  # the changed nodes of a level
    n = 0
    last_p, last_leaf = -1.0, 0.0  # new steps share one priority: one pow for all of them
    leaf_offset = np.uint64(offsets[leaf_level])  # unsigned indices: no wraparound test per access
    for j in range(slots.shape[0]):
        s = np.uint64(slots[j])
        p = float(priority[s])
        leaf = 0.0
        if valid[s] and p > 0.0:
            if p != last_p:
                last_p, last_leaf = p, p ** alpha
            leaf = last_leaf
        # Parents are pure functions of their children: unchanged leaves need no walk up.
        if sums[leaf_offset + s] != leaf:
            sums[leaf_offset + s] = leaf
            node[n] = s
            n += 1
    for level in range(leaf_level - 1, -1, -1):
        if n == 0:
            break
        # A level of fewer nodes than changes: all of it, in order. Levels only shrink upwards,
        # so every level above takes this branch too (``node`` is not read again).
        if sizes[level] <= n:
            for parent in range(sizes[level]):
                _recompute(sums, mins, level, parent, offsets, leaf_level)
            n = sizes[level]
            continue
        # Each changed node's parent, neighbours' once. A parent reached twice is recomputed
        # twice (the same value): cheaper than sorting to find it once.
        m = 0
        for j in range(n):
            parent = node[j] // ARITY
            if m == 0 or parent != node[m - 1]:
                node[m] = parent
                m += 1
                prefetch(sums.ctypes.data + 8 * (offsets[level] + parent))
                prefetch(mins.ctypes.data + 8 * (offsets[level] + parent))
        n = m
        for j in range(n):
            _recompute(sums, mins, level, node[j], offsets, leaf_level)
    return top


@numba.njit(cache=True, nogil=True)
def set_from_keys(sums, mins, sizes, offsets, keys, new, generation, epoch, tag, valid, priority, alpha,
                  marks, applied):
    """:func:`~shardreplay.kernels.keys.resolve_keys` of ``keys`` (a buffer of
    ``valid.shape[0]`` slots), then :func:`set_from_priorities` of the slots of the keys not
    stale, in one call (one per learner step). Each applied slot's block of
    ``PRIORITY_BLOCK`` in ``marks`` is stamped ``applied + n``. Returns ``(status, bad, n,
    top)``: ``n`` priorities applied; nothing changes unless ``status`` is ``OK``."""
    status, bad, slots, values, n = resolve_keys(keys, new, generation, valid.shape[0], epoch, tag)
    if status != OK:
        return status, bad, 0, 0.0
    for j in range(n):
        marks[slots[j] // PRIORITY_BLOCK] = applied + n
    top = set_from_priorities(sums, mins, sizes, offsets, slots[:n], valid, priority, alpha, values[:n])
    return OK, -1, n, top


@numba.njit(cache=True, nogil=True)
def find_prefix(sums, offsets, levels, targets):
    """For each target, descend to the leaf whose prefix range contains it.

    A child is chosen by counting the prefix sums of its group at or below the target,
    so a zero-mass child is never entered; when rounding leaves a target at or past the
    end of a group, the last child with mass is taken. Each item prefetches its next group.
    """
    n = targets.shape[0]
    node = np.zeros(n, np.int64)
    u = targets.copy()
    for level in range(1, levels):
        offset = offsets[level]
        below_at = sums.ctypes.data + 8 * offsets[level + 1] if level + 1 < levels else 0
        for j in range(n):
            first = np.uint64(offset + node[j] * ARITY)  # unsigned: no wraparound test per load
            t = u[j]
            acc = 0.0
            below = 0.0  # prefix sum before the chosen child
            count = 0
            for c in range(ARITY):
                acc += sums[first + np.uint64(c)]
                step = acc <= t
                count += step
                below = acc if step else below
            if count == ARITY:  # rounding: past the group's last mass
                count = 0
                for c in range(ARITY):
                    count = c if sums[first + np.uint64(c)] > 0.0 else count
                u[j] = sums[first + np.uint64(count)] * 0.5
            else:
                u[j] = t - below
            node[j] = node[j] * ARITY + count
            if below_at:
                prefetch(below_at + 8 * ARITY * node[j])
    return node


@numba.njit(cache=True, nogil=True)
def draw_weighted(sums, mins, offsets, levels, uniforms, beta, rows):
    """Leaves for uniforms in [0, 1), their probabilities and importance weights.

    ``w = (leaf / min_positive_leaf)^-beta``, which equals ``(N P(i))^-beta`` divided by
    its maximum over all drawable leaves. The lines of each drawn leaf's storage ``rows``
    (int64 ``[k, 3]``: address, bytes per leaf, bytes read from a leaf) are prefetched.
    """
    total = sums[0]
    low = mins[0]
    starts = find_prefix(sums, offsets, levels, uniforms * total)
    leaf_offset = np.uint64(offsets[levels - 1])  # unsigned indices: no wraparound test per access
    n = uniforms.shape[0]
    prob = np.empty(n, np.float64)
    weights = np.empty(n, np.float32)
    for j in range(n):
        s = starts[j]
        prefetch_rows(rows, s)
        v = sums[leaf_offset + np.uint64(s)]
        prob[j] = v / total
        weights[j] = (v / low) ** -beta
    return starts, prob, weights
