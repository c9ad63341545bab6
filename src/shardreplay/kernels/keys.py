"""The compiled key codec: encode, field reads and checks of keys, and the per-key work of
routing priority updates (the bit layout: docs/semantics.md, "Keys"; the widths: codes.py).
``spec/keys.py`` is the Python-facing side."""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.kernels import (
    cache_lock,  # noqa: F401  (numba's cache, safe across processes)
    codes,
)

# The bit layout is defined in codes.py (numba-free: modules above read it at import).
SHARD_BITS, TAG_BITS = codes.SHARD_BITS, codes.TAG_BITS
PLACE_BITS, GEN_BITS = codes.PLACE_BITS, codes.GEN_BITS
MAX_SHARDS, MAX_PLACES, NUM_TAGS = codes.MAX_SHARDS, codes.MAX_PLACES, codes.NUM_TAGS
GEN_MASK, PLACE_MASK = codes.GEN_MASK, codes.PLACE_MASK
TAG_MASK, SHARD_MASK = codes.TAG_MASK, codes.SHARD_MASK
PLACE_SHIFT, TAG_SHIFT, SHARD_SHIFT = codes.PLACE_SHIFT, codes.TAG_SHIFT, codes.SHARD_SHIFT
LOCAL_MASK = codes.LOCAL_MASK
# The statuses of resolve_keys and split_updates.
OK, BAD_PRIORITY, BAD_KEY = 0, 1, 2


@numba.njit(cache=True, nogil=True, inline="always")
def encode_key(shard, tag, place, generation):  # pragma: no cover - compiled
    """One key; ``generation`` is cut to its low bits, the other fields must fit."""
    return ((np.int64(shard) << SHARD_SHIFT) | (np.int64(tag) << TAG_SHIFT)
            | (np.int64(place) << PLACE_SHIFT) | (np.int64(generation) & GEN_MASK))


@numba.njit(cache=True, nogil=True, inline="always")
def key_shard_of(k):  # pragma: no cover - compiled
    """The shard field of key ``k``."""
    return k >> SHARD_SHIFT


@numba.njit(cache=True, nogil=True, inline="always")
def key_tag_of(k):  # pragma: no cover - compiled
    """The tag field of key ``k``."""
    return (k >> TAG_SHIFT) & TAG_MASK


@numba.njit(cache=True, nogil=True, inline="always")
def key_place_of(k):  # pragma: no cover - compiled
    """The place field of key ``k`` (the window start's flat index in its shard)."""
    return (k >> PLACE_SHIFT) & PLACE_MASK


@numba.njit(cache=True, nogil=True, inline="always")
def key_gen_of(k):  # pragma: no cover - compiled
    """The generation field of key ``k``."""
    return k & GEN_MASK


@numba.njit(cache=True, nogil=True, inline="always")
def key_fits(k, tag, size):  # pragma: no cover - compiled
    """Whether ``k`` can be a key of a shard-0 buffer with key ``tag`` and ``size``
    slots: not negative, shard 0, the tag, a place below ``size``."""
    return k >= 0 and (k & LOCAL_MASK) == k and key_tag_of(k) == tag and key_place_of(k) < size


@numba.njit(cache=True, nogil=True)
def keys_fit(keys, tag, size):
    """:func:`key_fits` of every key (bool array)."""
    out = np.empty(keys.shape[0], np.bool_)
    for j in range(keys.shape[0]):
        out[j] = key_fits(keys[j], tag, size)
    return out


@numba.njit(cache=True, nogil=True)
def with_shard(keys, shard):
    """The int64 ``keys`` with their shard field set to ``shard``."""
    out = np.empty(keys.shape[0], np.int64)
    high = np.int64(shard) << SHARD_SHIFT
    for j in range(keys.shape[0]):
        out[j] = (keys[j] & LOCAL_MASK) | high
    return out


@numba.njit(cache=True, nogil=True)
def resolve_keys(keys, priorities, generation, size, epoch, tag):
    """Check keys and priorities; map keys to flat slots and keep those not stale (generation
    other than the slot's write count ``generation[slot]`` plus the key ``epoch``) in order
    in ``slots[:n]``, ``prios[:n]``; the buffer has ``size`` slots. Returns ``(status, bad,
    slots, prios, n)``: status ``OK`` when all is well,
    ``BAD_PRIORITY`` when priority ``bad`` is negative or not finite, ``BAD_KEY`` when key
    ``bad`` is not a key of this buffer (negative, shard other than 0, another key ``tag``,
    or a place past the end).
    """
    n = keys.shape[0]
    slots = np.empty(n, np.int64)
    prios = np.empty(n, np.float32)
    m = 0
    for j in range(n):
        p = priorities[j]
        if not (p >= 0.0 and p < np.inf):
            return BAD_PRIORITY, j, slots, prios, 0
        k = keys[j]
        if not key_fits(k, tag, size):
            return BAD_KEY, j, slots, prios, 0
        s = key_place_of(k)
        written = np.int64(generation[s])  # 0: never written, no key names it
        if written > 0 and key_gen_of(written + epoch) == key_gen_of(k):
            slots[m], prios[m] = s, p
            m += 1
    return OK, -1, slots, prios, m


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
        own_k[n_own], own_p[n_own] = k & LOCAL_MASK, prios[i]
        n_own += 1
    return OK, -1, own_k[:n_own], own_p[:n_own], for_k[:n_for], for_p[:n_for]
