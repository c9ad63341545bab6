"""Keys: one int64 that names a sampled window for later priority updates (the bit layout
and the rules: docs/semantics.md, "Keys" and the points after it; the compiled codec and
checks: :mod:`shardreplay.kernels.keys`)."""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

from shardreplay.kernels import codes
from shardreplay.kernels.codes import GEN_MASK, MAX_PLACES, MAX_SHARDS, NUM_TAGS, TAG_MASK, TAG_SHIFT
from shardreplay.kernels.lazy import lazy

if TYPE_CHECKING:
    from shardreplay.kernels import keys as codec
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    codec = lazy("shardreplay.kernels.keys")

__all__ = ["GEN_MASK", "MAX_PLACES", "MAX_SHARDS", "NUM_TAGS", "TAG_MASK", "TAG_SHIFT", "is_key_tag",
           "key_shard", "new_key_tag", "unpack_keys", "with_shard"]


def _fresh_counter() -> itertools.count:
    return itertools.count(int.from_bytes(os.urandom(4), "little") % NUM_TAGS)


# Tags of this process's buffers: a random start (processes differ, forked ones too),
# then consecutive.
_next_tag = _fresh_counter()


def _reseed_after_fork() -> None:
    global _next_tag
    _next_tag = _fresh_counter()


os.register_at_fork(after_in_child=_reseed_after_fork)


def new_key_tag() -> int:
    """A key tag for a new buffer: never 0, and different from the previous
    ``NUM_TAGS - 1`` tags handed out in this process."""
    return 1 + next(_next_tag) % NUM_TAGS


def is_key_tag(value: object) -> TypeGuard[int | np.integer]:
    """Whether ``value`` is a usable key tag (an int in ``1 .. NUM_TAGS``)."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        return False
    return 1 <= int(value) <= NUM_TAGS


def unpack_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode keys: returns (shard, tag, place, generation) int64 arrays
    of the shape of ``keys``.

    ``divmod(place, stream_capacity)`` gives the (row, slot) of the window start.
    """
    keys = np.asarray(keys, np.int64)
    return (keys >> codes.SHARD_SHIFT, (keys >> TAG_SHIFT) & TAG_MASK,
            (keys >> codes.PLACE_SHIFT) & codes.PLACE_MASK, keys & GEN_MASK)


def key_shard(keys: np.ndarray) -> np.ndarray:
    """The shard index of each key."""
    return np.asarray(keys, np.int64) >> codes.SHARD_SHIFT


def with_shard(keys: np.ndarray, shard: int) -> np.ndarray:
    """The same keys with their shard field set to ``shard``."""
    keys = np.asarray(keys)
    return codec.with_shard(np.ascontiguousarray(keys, np.int64).reshape(-1), shard).reshape(keys.shape)
