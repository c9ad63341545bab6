"""The key codec: the bit layout of keys and its compiled encode, decode and checks.

Bit layout (most significant first, 63 bits used so keys stay non-negative)::

    | shard: 10 | tag: 14 | place: 28 | generation: 11 |

``spec/keys.py`` is the Python-facing side (what each field means, tags, vectorised
helpers); everything that reads or writes key bits goes through this module.
"""

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
def encode_keys(shard, tag, place, generation):
    """:func:`encode_key` of every entry of the int64 arrays (one length)."""
    out = np.empty(place.shape[0], np.int64)
    for j in range(place.shape[0]):
        out[j] = encode_key(shard[j], tag[j], place[j], generation[j])
    return out


@numba.njit(cache=True, nogil=True)
def decode_keys(keys):
    """``(shard, tag, place, generation)`` int64 arrays of int64 ``keys``."""
    n = keys.shape[0]
    shard, tag = np.empty(n, np.int64), np.empty(n, np.int64)
    place, gen = np.empty(n, np.int64), np.empty(n, np.int64)
    for j in range(n):
        k = keys[j]
        shard[j], tag[j], place[j], gen[j] = key_shard_of(k), key_tag_of(k), key_place_of(k), key_gen_of(k)
    return shard, tag, place, gen


@numba.njit(cache=True, nogil=True)
def shards_of(keys):
    """:func:`key_shard_of` of every key (int64 array)."""
    out = np.empty(keys.shape[0], np.int64)
    for j in range(keys.shape[0]):
        out[j] = key_shard_of(keys[j])
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
    """Check keys and priorities; map keys to flat slots and mark the stale ones
    (generation other than the slot's write count ``generation[slot]`` plus the key
    ``epoch``); the buffer has ``size`` slots.

    Returns ``(status, bad, slots, current)``: status 0 when all is well, 1 when
    priority ``bad`` is negative or not finite, 2 when key ``bad`` is not a key of this
    buffer (negative, shard other than 0, another key ``tag``, or a place past the end).
    """
    n = keys.shape[0]
    slots = np.empty(n, np.int64)
    current = np.empty(n, np.bool_)
    for j in range(n):
        p = priorities[j]
        if not (p >= 0.0 and p < np.inf):
            return 1, j, slots, current
        k = keys[j]
        if not key_fits(k, tag, size):
            return 2, j, slots, current
        s = key_place_of(k)
        slots[j] = s
        written = np.int64(generation[s])  # 0: never written, no key names it
        current[j] = written > 0 and key_gen_of(written + epoch) == key_gen_of(k)
    return 0, -1, slots, current
