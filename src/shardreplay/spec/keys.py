"""Keys: one int64 that names a sampled window for later priority updates.

Bit layout (most significant first, 63 bits used so keys stay non-negative)::

    | shard: 10 | tag: 14 | place: 28 | generation: 11 |

- ``shard``: the rank that owns the window (0 in a single buffer); up to 1,024 shards.
- ``tag``: the buffer's *key tag*, a number in ``1 .. 16,383`` drawn when the buffer is
  made (a random start per process, then one more per buffer made in it, so buffers
  made in one process share no tag until 16,383 were made; a load takes over the saved
  buffer's tag). A key whose tag is not its owner's is not a key of
  this buffer and is rejected with ``InvalidKeyError``: tag 0 is never used, so small
  integers (``torch.arange(B)``, row indices) are always rejected; random int64 and keys
  of a buffer in another process pass the tag check with probability 1 / 16,383 (and
  must then also name a stored place of the right shard).
- ``place``: the window start's flat index in its shard, ``row * stream_capacity + slot``,
  so a shard holds at most ``num_streams * stream_capacity <= 2**28`` (268,435,456) steps.
- ``generation``: the low 11 bits of the slot's write counter plus the buffer's key epoch,
  bumped each time the slot is overwritten, so a key whose data was overwritten since it
  was sampled is recognised as stale (counted, not an error) unless exactly a multiple
  of 2,048 overwrites happened in between.

A state dict or checkpoint carries its buffer's tag, and a restore takes it over, so
keys sampled before a save are recognised after a restore (and found stale by the
generation, whose epoch a checkpoint restore raises).
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

from shardreplay.kernels.codes import (
    GEN_BITS,
    GEN_MASK,
    LOCAL_MASK,
    MAX_PLACES,
    MAX_SHARDS,
    NUM_TAGS,
    PLACE_BITS,
    PLACE_MASK,
    PLACE_SHIFT,
    SHARD_BITS,
    SHARD_SHIFT,
    TAG_BITS,
    TAG_MASK,
    TAG_SHIFT,
)
from shardreplay.kernels.lazy import lazy

if TYPE_CHECKING:
    from shardreplay.kernels import keys as codec
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    codec = lazy("shardreplay.kernels.keys")

# The codec (bit layout, encode, decode, checks) lives in kernels/keys.py, beside the
# compiled code that reads keys; these are its Python-facing names.
__all__ = ["GEN_BITS", "GEN_MASK", "LOCAL_MASK", "MAX_PLACES", "MAX_SHARDS", "NUM_TAGS", "PLACE_BITS",
           "PLACE_MASK", "PLACE_SHIFT", "SHARD_BITS", "SHARD_SHIFT", "TAG_BITS", "TAG_MASK", "TAG_SHIFT",
           "is_key_tag", "key_shard", "new_key_tag", "unpack_keys", "with_shard"]


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
    keys = np.asarray(keys)
    flat = np.ascontiguousarray(keys, np.int64).reshape(-1)
    shard, tag, place, generation = codec.decode_keys(flat)
    shape = keys.shape
    return shard.reshape(shape), tag.reshape(shape), place.reshape(shape), generation.reshape(shape)


def key_shard(keys: np.ndarray) -> np.ndarray:
    """The shard index of each key."""
    keys = np.asarray(keys)
    return codec.shards_of(np.ascontiguousarray(keys, np.int64).reshape(-1)).reshape(keys.shape)


def with_shard(keys: np.ndarray, shard: int) -> np.ndarray:
    """The same keys with their shard field set to ``shard``."""
    keys = np.asarray(keys)
    return codec.with_shard(np.ascontiguousarray(keys, np.int64).reshape(-1), shard).reshape(keys.shape)
