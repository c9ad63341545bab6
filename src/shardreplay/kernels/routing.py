"""Compiled per-key work of routing priority updates (one pass instead of a dozen
numpy temporaries per learner step)."""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)
from shardreplay.kernels.keys import LOCAL_MASK, key_place_of, key_shard_of, key_tag_of

OK, BAD_PRIORITY, BAD_KEY = 0, 1, 2
_LOCAL_BITS = np.int64(LOCAL_MASK)


@numba.njit(cache=True, nogil=True)
def split_updates(keys: np.ndarray, prios: np.ndarray, rank: int, tags: np.ndarray,
                  size: int) -> tuple:
    """Check every ``(key, priority)`` and split them by owner.

    ``tags[o]`` is the key tag of owner shard ``o`` (0 when not known yet: no key
    matches it); ``size`` is this shard's slot count. Keys of -1 (padding) are skipped.
    Returns ``(status, bad, own_keys, own_prios, foreign_keys, foreign_prios)``:
    ``status`` is ``BAD_PRIORITY`` (priority ``bad`` is NaN, inf or negative) or
    ``BAD_KEY`` (key ``bad`` is negative, names no owner, carries another tag than its
    owner's, or names no place of this shard) before anything is split; own keys come
    back with their shard bits cleared.
    """
    n = keys.shape[0]
    world = tags.shape[0]
    for i in range(n):
        p = prios[i]
        if not (p >= 0.0 and p < np.inf):
            return BAD_PRIORITY, i, keys[:0], prios[:0], keys[:0], prios[:0]
        k = keys[i]
        if k == -1:
            continue
        owner = key_shard_of(k)
        if k < 0 or owner >= world or key_tag_of(k) != tags[owner]:
            return BAD_KEY, i, keys[:0], prios[:0], keys[:0], prios[:0]
        if owner == rank and key_place_of(k) >= size:
            return BAD_KEY, i, keys[:0], prios[:0], keys[:0], prios[:0]
    own_k, own_p = np.empty(n, np.int64), np.empty(n, np.float32)
    for_k, for_p = np.empty(n, np.int64), np.empty(n, np.float32)
    n_own = n_for = 0
    for i in range(n):
        k = keys[i]
        if k == -1:
            continue
        if key_shard_of(k) != rank:
            for_k[n_for], for_p[n_for] = k, prios[i]
            n_for += 1
            continue
        own_k[n_own], own_p[n_own] = k & _LOCAL_BITS, prios[i]
        n_own += 1
    return OK, -1, own_k[:n_own], own_p[:n_own], for_k[:n_for], for_p[:n_for]
