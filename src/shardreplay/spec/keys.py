"""Keys: one int64 that names a sampled window for later priority updates.

Bit layout (most significant first, 63 bits used so keys stay non-negative)::

    | shard: 10 | row: 16 | slot: 24 | generation: 13 |

``slot`` is the window start's index inside its stream ring; ``generation`` is the low
13 bits of the slot's write counter, bumped each time the slot is overwritten, so a key
whose data was overwritten since it was sampled is recognised as stale.
"""

from __future__ import annotations

import numpy as np

SHARD_BITS, ROW_BITS, SLOT_BITS, GEN_BITS = 10, 16, 24, 13
MAX_SHARDS = 1 << SHARD_BITS
MAX_ROWS = 1 << ROW_BITS
MAX_SLOTS = 1 << SLOT_BITS
GEN_MASK = (1 << GEN_BITS) - 1
SLOT_SHIFT = GEN_BITS
ROW_SHIFT = GEN_BITS + SLOT_BITS
SHARD_SHIFT = GEN_BITS + SLOT_BITS + ROW_BITS


def pack_keys(shard: np.ndarray | int, row: np.ndarray, slot: np.ndarray,
              generation: np.ndarray) -> np.ndarray:
    """Pack (shard, row, slot, generation) into int64 keys (vectorised)."""
    shard = np.asarray(shard, np.int64)
    return ((shard << SHARD_SHIFT) | (row.astype(np.int64) << ROW_SHIFT)
            | (slot.astype(np.int64) << SLOT_SHIFT) | (generation.astype(np.int64) & GEN_MASK))


def unpack_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_keys`: returns (shard, row, slot, generation) int64 arrays."""
    keys = keys.astype(np.int64, copy=False)
    return (keys >> SHARD_SHIFT, (keys >> ROW_SHIFT) & (MAX_ROWS - 1),
            (keys >> SLOT_SHIFT) & (MAX_SLOTS - 1), keys & GEN_MASK)


def key_shard(keys: np.ndarray) -> np.ndarray:
    """The shard index of each key."""
    return keys.astype(np.int64, copy=False) >> SHARD_SHIFT


def with_shard(keys: np.ndarray, shard: int) -> np.ndarray:
    """The same keys with their shard field set to ``shard``."""
    local = keys.astype(np.int64, copy=False) & ((1 << SHARD_SHIFT) - 1)
    return local | (np.int64(shard) << SHARD_SHIFT)
