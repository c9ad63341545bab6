"""The priority router of a :class:`ShardedReplayBuffer`: each update goes to the shard
that owns its key. It owns the queue of updates for other shards and every shard's key tag.

Updates travel in :meth:`PriorityRouter.send`, in the all_to_all of what every rank tells
the others: at once (:meth:`~PriorityRouter.update_now`), or queued in
:class:`PendingUpdates` until the next exchange (docs/semantics.md, "Sharded sampling").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardreplay.buffer.checks import (
    as_index_array,
    as_priority_array,
    check_priorities,
    foreign_key,
    not_prioritized,
)
from shardreplay.buffer.shard import Shard
from shardreplay.distributed.group import Collectives, Released
from shardreplay.errors import ConfigError, InvalidKeyError, ShardReplayError
from shardreplay.kernels import exchange as kernels
from shardreplay.kernels.keys import BAD_KEY, BAD_PRIORITY, split_updates

_UPDATE_OPS = ("ShardedReplayBuffer.update_priorities(counts and updates)",
               "ShardedReplayBuffer.update_priorities(updates past the slot)")
_FLUSH_OPS = ("ShardedReplayBuffer.flush_updates(counts)", "ShardedReplayBuffer.flush_updates(updates)")
STATS_OPS = ("ShardedReplayBuffer.sample(stats and queued updates)",
             "ShardedReplayBuffer.sample(queued updates past the slot)")


class PendingUpdates:
    """Foreign ``(key, priority)`` pairs in call order (grouped by owner when sent)."""

    def __init__(self) -> None:
        self._keys: list[np.ndarray] = []
        self._prios: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(keys.size for keys in self._keys)

    def add(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """Queue checked keys (owner bits set) and their priorities."""
        if keys.size:
            self._keys.append(keys)
            self._prios.append(priorities)

    def restore(self, older: PendingUpdates) -> None:
        """Put back what :meth:`detach` moved out (it goes before anything queued since)."""
        self._keys[:0], self._prios[:0] = older._keys, older._prios

    def detach(self) -> PendingUpdates:
        """Everything queued, moved into a new queue (this one is left empty)."""
        moved = PendingUpdates()
        moved._keys, moved._prios = self._keys, self._prios
        self._keys, self._prios = [], []
        return moved

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """Everything queued, in call order, as ``(int64 keys, float32 priorities)``, and clear."""
        moved = self.detach()
        if not moved._keys:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        return np.concatenate(moved._keys), np.concatenate(moved._prios)


class PriorityRouter:
    """Routes priority updates to their owner shards over ``comm`` (the exchange group;
    collective where it says so)."""

    def __init__(self, shard: Shard, comm: Collectives) -> None:
        self._shard = shard
        self._comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.pending = PendingUpdates()
        # Every shard's key tag (0: not known yet), learnt at each exchange and checkpoint
        # load, so keys that are no keys of this buffer are refused where they are passed.
        self.tags = np.zeros(self.world_size, np.int64)
        # Updates per owner that travel in the first all_to_all of :meth:`send`, per call site.
        self._slots: dict[str, int] = {}

    def learn_key_tags(self, tags: Any) -> None:
        """Note every shard's key tag (from an exchange, or a checkpoint load's agreement)."""
        self.tags = np.asarray(tags).astype(np.int64)

    def queue(self, keys: Any, priorities: Any) -> int:
        """Apply this shard's updates, queue the others' (no collective); the number applied.

        Raises:
            ConfigError / InvalidKeyError / InvalidPriorityError: as :meth:`split`
                (nothing applied or queued).
        """
        own_keys, own_prios, foreign_keys, foreign_prios = self.split(keys, priorities)
        self.pending.add(foreign_keys, foreign_prios)
        return self._apply_own(own_keys, own_prios)

    def update_now(self, keys: Any, priorities: Any) -> int:
        """Apply this shard's updates and route the others at once (collective: :meth:`send`,
        and one all_gather when a routed priority exceeds every shard's maximum); the
        updates this shard applied, from any rank. A rank whose input is bad still joins,
        with nothing to send, then raises. Only without a pipeline.

        Raises:
            ConfigError / InvalidKeyError / InvalidPriorityError: this rank's input was bad.
            CollectiveTimeout: a peer rank did not join in time.
        """
        error: ShardReplayError | None = None
        try:
            own_keys, own_prios, foreign_keys, foreign_prios = self.split(keys, priorities)
        except ShardReplayError as exc:
            error = exc
            own_keys = foreign_keys = np.empty(0, np.int64)
            own_prios = foreign_prios = np.empty(0, np.float32)
        applied = self._apply_own(own_keys, own_prios)
        pending = PendingUpdates()
        pending.add(foreign_keys, foreign_prios)
        # Every rank's running maximum (new steps everywhere get the global one at once)
        # and the largest priority routed from here.
        routed_top = float(foreign_prios.max()) if foreign_prios.size else 0.0
        head = np.array([self._shard.max_priority, routed_top], np.float64).view(np.int64)
        rows, got = self.send(head, pending, _UPDATE_OPS)
        applied += got
        maxima = rows[:, :2].copy().view(np.float64)
        known = float(maxima[:, 0].max())
        self._shard.raise_max_priority(known)
        if float(maxima[:, 1].max()) > known:
            self._agree_max()
        if error is not None:
            raise error
        return applied

    def flush(self, pending: PendingUpdates, released: Released | None = None) -> int:
        """Route ``pending`` to the owners (collective: one all_to_all of the counts, and
        one more when any rank has updates queued); the number applied here. The
        collectives wait inside ``released()`` (the runner's lock let go)."""
        return self.send(np.empty(0, np.int64), pending, _FLUSH_OPS, released, slot=0)[1]

    def send(self, head: np.ndarray, pending: PendingUpdates, ops: tuple[str, str],
             released: Released | None = None,
             while_waiting: Callable[[], Any] | None = None, slot: int | None = None
             ) -> tuple[np.ndarray, int]:
        """Send ``head`` (an int64 row) and ``pending``'s counts to every rank, and each owner
        up to ``slot`` of its updates, in one all_to_all (``slot``: by default sized by the
        last call with these ``ops`` that sent any, alike on every rank: all see every
        count); the rest follows in a second one when any rank has some (rare after the
        first call). What arrives is applied, each sender's in its order. ``ops`` names the
        two collectives; they wait inside ``released()``; ``while_waiting`` runs meanwhile.
        Returns every rank's row (``[K, len(head) + K]``: its head, then its count per
        owner), and the number of updates applied here.
        """
        k, me, h = self.world_size, self.rank, head.size
        slot = self._slots.get(ops[0], 0) if slot is None else slot
        block, payload, counts = kernels.pack_updates(*pending.take(), head, k, slot)
        got = self._comm.all_to_all(block, [1] * k, [1] * k, ops[0], while_waiting=while_waiting,
                                    released=released)
        # got[r, h + o]: updates rank r sends owner o. Sized for the next call from the last
        # counts that were not all 0 (alike on every rank), with room to vary from step to step.
        top = int(got[:, h:h + k].max())
        if top:
            self._slots[ops[0]] = top + top // 4 + 8
        extra = np.empty((0, 2), np.int64)
        if top > slot:  # alike on every rank: every rank sees every count
            rest, firsts = np.maximum(got[:, h:h + k] - slot, 0), np.cumsum(counts) - counts
            send = np.concatenate([payload[firsts[o] + slot:firsts[o] + counts[o]] for o in range(k)])
            extra = self._comm.all_to_all(send, rest[me].tolist(), rest[:, me].tolist(), ops[1],
                                          released=released)
        keys, prios = kernels.unpack_updates(got, h, me, slot, extra)
        applied = self._shard.apply_routed(keys, prios)
        return got[:, :h + k], applied

    def split(self, keys: Any, priorities: Any) -> tuple[np.ndarray, ...]:
        """Checked ``(own keys with shard 0, own priorities, foreign keys, foreign
        priorities)``; padding keys (-1) dropped.

        Raises:
            ConfigError: the shards are not prioritized.
            InvalidKeyError / InvalidPriorityError: bad input (nothing was changed).
        """
        sampler = self._shard.sampler_name
        if sampler != "prioritized":
            raise ConfigError(not_prioritized(sampler))
        keys_np = np.ascontiguousarray(as_index_array(keys, "keys"))
        prios = np.ascontiguousarray(as_priority_array(priorities, keys_np.shape))
        self.tags[self.rank] = self._shard.key_tag  # a checkpoint load may have changed it
        status, bad, own_k, own_p, for_k, for_p = split_updates(
            keys_np, prios, self.rank, self.tags, self._shard.capacity)
        if status == BAD_PRIORITY:
            check_priorities(prios, keys_np.shape)  # raises with the precise reason
        if status == BAD_KEY:
            raise InvalidKeyError(foreign_key(keys_np, bad, "sharded buffer"))
        return own_k, own_p, for_k, for_p

    def _agree_max(self) -> None:
        """Spread the owners' running maxima after routed updates landed: only applied
        priorities count (an owner skips a stale key, as one buffer does), so the sender's
        value cannot be taken on trust."""
        mine = np.array([self._shard.max_priority], np.float64)
        got = self._comm.all_gather(mine, "ShardedReplayBuffer.update_priorities(max priority)")
        self._shard.raise_max_priority(float(got.max()))

    def _apply_own(self, keys: np.ndarray, prios: np.ndarray) -> int:
        return self._shard.apply_priorities(keys, prios) if keys.size else 0
