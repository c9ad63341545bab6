"""References of kernels/keys.py and kernels/routing.py."""

from __future__ import annotations

import numpy as np

from shardreplay.kernels.codes import GEN_BITS, PLACE_BITS, SHARD_BITS, TAG_BITS

_WIDTHS = (("shard", SHARD_BITS), ("tag", TAG_BITS), ("place", PLACE_BITS), ("generation", GEN_BITS))


def encode_keys(shard: np.ndarray, tag: np.ndarray, place: np.ndarray, generation: np.ndarray) -> np.ndarray:
    """Fields laid side by side, most significant first, by multiplication."""
    key = np.zeros(place.shape[0], np.int64)
    for (_name, bits), values in zip(_WIDTHS, (shard, tag, place, generation), strict=True):
        key = key * (1 << bits) + (np.asarray(values, np.int64) % (1 << bits))
    return key


def decode_keys(keys: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(shard, tag, place, generation)`` by division, least significant field first."""
    rest = np.asarray(keys, np.int64).copy()
    out = []
    for _name, bits in reversed(_WIDTHS):
        out.append(rest % (1 << bits))
        rest //= 1 << bits
    return tuple(reversed(out))


def key_fits(keys: np.ndarray, tag: int, size: int) -> np.ndarray:
    """Not negative, shard 0, tag ``tag``, place below ``size``."""
    shard, k_tag, place, _gen = decode_keys(np.maximum(keys, 0))
    return (keys >= 0) & (shard == 0) & (k_tag == tag) & (place < size)


def writes(pos: np.ndarray, slots: np.ndarray, cap: int) -> np.ndarray:
    """Times each flat slot was written: positions ``p < pos[row]`` with ``p % cap == slot``."""
    row, slot = np.divmod(slots, cap)
    return np.array([np.count_nonzero(np.arange(pos[r]) % cap == s) for r, s in zip(row, slot, strict=True)],
                    np.int64).reshape(-1)


def resolve_keys(keys: np.ndarray, priorities: np.ndarray, generation: np.ndarray, size: int,
                 epoch: int, tag: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """``(status, bad, slots, current)`` as kernels.keys.resolve_keys documents (slots and
    current are meaningful only when status is 0)."""
    bad_prio = ~(np.isfinite(priorities) & (priorities >= 0))
    bad_key = ~key_fits(keys, tag, size)
    first = np.flatnonzero(bad_prio | bad_key)
    if first.size:
        j = int(first[0])
        return (1 if bad_prio[j] else 2), j, np.empty(0, np.int64), np.empty(0, bool)
    _shard, _tag, slots, gen = decode_keys(keys)
    written = generation[slots].astype(np.int64)
    return 0, -1, slots, (written > 0) & ((written + epoch) % (1 << GEN_BITS) == gen)


def split_updates(keys: np.ndarray, prios: np.ndarray, rank: int, tags: np.ndarray, size: int) -> tuple:
    """As kernels.routing.split_updates documents: the first bad entry, else own keys
    (shard bits cleared) and foreign keys, padding (-1) dropped, order kept."""
    for i in range(keys.shape[0]):
        if not (np.isfinite(prios[i]) and prios[i] >= 0):
            return 1, i
        k = int(keys[i])
        if k == -1:
            continue
        shard, k_tag, place, _gen = (int(x[0]) for x in decode_keys(np.array([max(k, 0)])))
        if k < 0 or shard >= tags.shape[0] or k_tag != tags[shard] or (shard == rank and place >= size):
            return 2, i
    keep = keys != -1
    own = keep & (decode_keys(np.maximum(keys, 0))[0] == rank)
    foreign = keep & ~own
    local = keys[own] % (1 << (TAG_BITS + PLACE_BITS + GEN_BITS))
    return 0, -1, local, prios[own].astype(np.float32), keys[foreign], prios[foreign].astype(np.float32)
