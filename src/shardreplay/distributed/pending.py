"""Priority updates waiting for their owner shard (the lazy routing of prefetch > 1).

With ``prefetch > 1`` a :class:`ShardedReplayBuffer` applies updates for its own shard at
once and keeps the others here until the next exchange, where they travel in one
all_to_all for many learner steps instead of two collectives per step.
"""

from __future__ import annotations

import numpy as np

from shardreplay.spec.keys import key_shard, with_shard


class PendingUpdates:
    """Foreign ``(key, priority)`` pairs in call order, grouped by owner when taken.

    Args:
        world_size: number of shards (owners).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._keys: list[np.ndarray] = []
        self._prios: list[np.ndarray] = []
        self.counts = np.zeros(world_size, np.int64)

    def __len__(self) -> int:
        return int(self.counts.sum())

    def add(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """Queue checked keys (owner bits set) and their priorities."""
        if keys.size:
            self._keys.append(keys)
            self._prios.append(priorities)
            self.counts += np.bincount(key_shard(keys), minlength=self.world_size)

    def detach(self) -> PendingUpdates:
        """Everything queued, moved into a new queue (this one is left empty)."""
        moved = PendingUpdates(self.world_size)
        moved._keys, moved._prios, moved.counts = self._keys, self._prios, self.counts
        self._keys, self._prios = [], []
        self.counts = np.zeros(self.world_size, np.int64)
        return moved

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """Everything queued as ``([n, 2] int64 payload rows, per-owner counts)`` and clear.

        A payload row is ``(key with shard bits 0, float64 priority bits)``, rows sorted by
        owner (stably, so a key updated twice keeps its last priority at the owner).
        """
        counts = self.counts
        if not self._keys:
            return np.empty((0, 2), np.int64), counts.copy()
        keys, prios = np.concatenate(self._keys), np.concatenate(self._prios)
        order = np.argsort(key_shard(keys), kind="stable")
        payload = np.stack([with_shard(keys[order], 0),
                            prios[order].astype(np.float64).view(np.int64)], axis=1)
        self._keys.clear()
        self._prios.clear()
        self.counts = np.zeros(self.world_size, np.int64)
        return payload, counts
