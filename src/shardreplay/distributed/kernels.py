"""Compiled per-key work of routing priority updates (one pass instead of a dozen
numpy temporaries per learner step)."""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.spec.keys import MAX_ROWS, MAX_SLOTS, ROW_SHIFT, SHARD_SHIFT, SLOT_SHIFT

OK, BAD_PRIORITY, BAD_KEY = 0, 1, 2
_LOCAL_BITS = np.int64((1 << SHARD_SHIFT) - 1)


@numba.njit(cache=True, nogil=True)
def split_updates(keys: np.ndarray, prios: np.ndarray, rank: int, world: int, num_streams: int,
                  stream_capacity: int) -> tuple:
    """Check every ``(key, priority)`` and split them by owner.

    Keys of -1 (padding) are skipped. Returns ``(status, own_keys, own_prios,
    foreign_keys, foreign_prios, misfits)``: ``status`` is ``BAD_PRIORITY`` (NaN, inf or
    negative) or ``BAD_KEY`` (negative, or an owner outside ``0..world-1``) before
    anything is split; own keys come back with their shard bits cleared, and own keys
    that name no slot of this shard's layout are only counted (``misfits``).
    """
    n = keys.shape[0]
    for i in range(n):
        p = prios[i]
        if not (p >= 0.0 and p < np.inf):
            return BAD_PRIORITY, keys[:0], prios[:0], keys[:0], prios[:0], 0
        k = keys[i]
        if k != -1 and (k < 0 or (k >> SHARD_SHIFT) >= world):
            return BAD_KEY, keys[:0], prios[:0], keys[:0], prios[:0], 0
    own_k, own_p = np.empty(n, np.int64), np.empty(n, np.float32)
    for_k, for_p = np.empty(n, np.int64), np.empty(n, np.float32)
    n_own = n_for = misfits = 0
    for i in range(n):
        k = keys[i]
        if k == -1:
            continue
        if (k >> SHARD_SHIFT) != rank:
            for_k[n_for], for_p[n_for] = k, prios[i]
            n_for += 1
            continue
        row = (k >> ROW_SHIFT) & (MAX_ROWS - 1)
        slot = (k >> SLOT_SHIFT) & (MAX_SLOTS - 1)
        if row >= num_streams or slot >= stream_capacity:
            misfits += 1
            continue
        own_k[n_own], own_p[n_own] = k & _LOCAL_BITS, prios[i]
        n_own += 1
    return OK, own_k[:n_own], own_p[:n_own], for_k[:n_for], for_p[:n_for], misfits
