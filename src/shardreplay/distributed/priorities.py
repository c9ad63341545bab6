"""Priority updates of a :class:`ShardedReplayBuffer`: each routed to the shard that owns
its key (part of the buffer, in its own file to keep each file to one purpose).

Strict (``prefetch=1``, no pipeline): updates for other shards travel at once in two
all_to_alls (counts, then records). Lazy (``prefetch > 1`` or ``pipeline=True``): they
are queued (:class:`PendingUpdates`) and travel with the next exchange.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardreplay.buffer.checks import (
    as_index_array,
    as_priority_array,
    check_priorities,
    foreign_key,
    not_prioritized,
)
from shardreplay.distributed.pending import PendingUpdates
from shardreplay.errors import ConfigError, InvalidKeyError, ShardReplayError
from shardreplay.kernels.routing import BAD_KEY, BAD_PRIORITY, split_updates

if TYPE_CHECKING:
    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.buffer.shard import Shard
    from shardreplay.distributed.group import Collectives


class PriorityRouting:
    """The priority half of :class:`ShardedReplayBuffer` (a mixin: it uses the buffer's
    shard, collectives, queue and counters)."""

    local: ReplayBuffer
    _shard: Shard
    rank: int
    world_size: int
    prefetch: int
    _xcomm: Collectives
    _pending: PendingUpdates
    _tags: np.ndarray  # every shard's key tag (0: not known yet)

    @property
    def _lazy(self) -> bool:
        raise NotImplementedError

    def _guard(self) -> AbstractContextManager:
        raise NotImplementedError

    # -- priorities ------------------------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Route each priority to the shard that owns its key.

        With ``prefetch=1`` and no pipeline this is collective (every rank calls it, in
        the same order) and every update has landed on its owner when it returns. With
        ``prefetch > 1`` or ``pipeline=True`` it is local: updates for this rank's shard
        are applied at once, the others are queued and routed by the next exchange (the
        next refill :meth:`sample` starts, or :meth:`flush_updates`), before it draws.

        Keys of -1 (padding from an empty shard in local mode) are skipped. Stale keys
        are ignored and counted on the owner (its ``info().stale_updates``).

        Returns:
            The number of updates this rank's shard applied in this call (from any rank
            when strict; its own when lazy).

        Raises:
            ConfigError: the shards are not prioritized (priorities would change nothing).
            InvalidPriorityError / InvalidKeyError: this rank's input was bad (keys must
                be this buffer's: see ``spec/keys.py``); it still joined the exchange
                (with nothing to send) so no peer hangs, and nothing of its input was
                applied or queued.
            CollectiveTimeout: a peer rank did not join in time.
        """
        if self._lazy:
            with self._guard():  # the background exchange reads and writes the shard too
                own_keys, own_prios, foreign_keys, foreign_prios = self._split_updates(keys, priorities)
                self._pending.add(foreign_keys, foreign_prios)
                return self._apply_own(own_keys, own_prios)
        error: ShardReplayError | None = None
        try:
            own_keys, own_prios, foreign_keys, foreign_prios = self._split_updates(keys, priorities)
        except ShardReplayError as exc:
            error = exc
            own_keys = foreign_keys = np.empty(0, np.int64)
            own_prios = foreign_prios = np.empty(0, np.float32)
        applied = self._apply_own(own_keys, own_prios)
        pending = PendingUpdates(self.world_size)
        pending.add(foreign_keys, foreign_prios)
        payload, send_counts = pending.take()
        routed_top = float(foreign_prios.max()) if foreign_prios.size else 0.0
        foreign, may_raise = self._exchange_counts(send_counts, routed_top)
        applied += self._route(payload, foreign)
        if may_raise:
            self._agree_max()
        if error is not None:
            raise error
        return applied

    def _exchange_counts(self, send_counts: np.ndarray, routed_top: float) -> tuple[np.ndarray, bool]:
        """Tell every owner how many updates come from here, and every rank this shard's
        running maximum (so new steps everywhere get the global maximum at once) and the
        largest priority routed from here. Returns the ``[from, to]`` count matrix
        :meth:`_route` needs, and whether a routed priority exceeds every shard's maximum
        (the same answer on every rank: every rank sees every rank's two figures)."""
        k = self.world_size
        mine = np.empty((k, 3), np.int64)
        mine[:, 0] = send_counts
        mine[:, 1] = np.float64(self._shard.max_priority).view(np.int64)
        mine[:, 2] = np.float64(routed_top).view(np.int64)
        got = self._xcomm.all_to_all(torch.from_numpy(mine.ravel()), [3] * k, [3] * k,
                                    "ShardedReplayBuffer.update_priorities(counts)").cpu().numpy()
        got = got.reshape(k, 3)
        known = float(got[:, 1].view(np.float64).max())
        self._shard.raise_max_priority(known)
        foreign = np.zeros((k, k), np.int64)
        foreign[self.rank], foreign[:, self.rank] = send_counts, got[:, 0]
        return foreign, float(got[:, 2].view(np.float64).max()) > known

    def _agree_max(self) -> None:
        """Spread the owners' running maxima after routed updates landed: only applied
        priorities count (an owner skips a stale key, as one buffer does), so the sender's
        value cannot be taken on trust."""
        mine = torch.tensor([np.float64(self._shard.max_priority).view(np.int64)], dtype=torch.int64)
        got = self._xcomm.all_gather(mine, "ShardedReplayBuffer.update_priorities(max priority)")
        self._shard.raise_max_priority(float(got.cpu().numpy().reshape(-1).view(np.float64).max()))

    def _max_seen(self) -> float:
        """The largest priority this shard applied or learnt from the others (routed
        priorities count only once their owner applied them)."""
        return self._shard.max_priority

    def _flush(self, pending: PendingUpdates) -> int:
        """Route ``pending`` to the owners (collective on the exchange group)."""
        mine = torch.from_numpy(pending.counts.copy())
        foreign = self._xcomm.all_gather(mine, "ShardedReplayBuffer.flush_updates(counts)").cpu().numpy()
        return self._route(pending.take()[0], foreign) if foreign.any() else 0

    def _route(self, payload: np.ndarray, foreign: np.ndarray) -> int:
        """Send payload rows to their owners (``foreign[r, o]`` rows from rank r to owner
        o) and apply what arrives here."""
        got = self._xcomm.all_to_all(torch.from_numpy(payload), foreign[self.rank].tolist(),
                                    foreign[:, self.rank].tolist(),
                                    "ShardedReplayBuffer.update_priorities(records)").cpu().numpy()
        return self._shard.apply_routed(got[:, 0], got[:, 1].view(np.float64).astype(np.float32))

    def learn_key_tags(self, tags: Any) -> None:
        """Note every shard's key tag (from an exchange, or a checkpoint load's agreement)."""
        self._tags = np.asarray(tags).astype(np.int64)

    def _split_updates(self, keys: Any, priorities: Any) -> tuple[np.ndarray, ...]:
        """Checked ``(own keys with shard 0, own priorities, foreign keys, foreign
        priorities)``; padding keys (-1) dropped.

        Raises:
            ConfigError: the shards are not prioritized.
            InvalidKeyError / InvalidPriorityError: bad input (nothing was changed).
        """
        if self.local.sampler_name != "prioritized":
            raise ConfigError(not_prioritized(self.local.sampler_name))
        keys_np = np.ascontiguousarray(as_index_array(keys, "keys"))
        prios = np.ascontiguousarray(as_priority_array(priorities, keys_np.shape))
        self._tags[self.rank] = self._shard.key_tag  # a checkpoint load may have changed it
        status, bad, own_k, own_p, for_k, for_p = split_updates(
            keys_np, prios, self.rank, self._tags, self.local.capacity)
        if status == BAD_PRIORITY:
            check_priorities(prios, keys_np.shape)  # raises with the precise reason
        if status == BAD_KEY:
            raise InvalidKeyError(foreign_key(keys_np, bad, "sharded buffer"))
        return own_k, own_p, for_k, for_p

    def _apply_own(self, keys: np.ndarray, prios: np.ndarray) -> int:
        return self._shard.apply_priorities(keys, prios) if keys.size else 0
