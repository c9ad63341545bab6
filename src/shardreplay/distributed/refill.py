"""One exchange of a :class:`ShardedReplayBuffer`: route the queued priority updates,
agree on the global picture, and draw ``prefetch`` batches with the mode's strategy; and
the shard-choice RNG it draws seed proposals from (:class:`ShardChoice`, the part of a
sharded buffer a checkpoint saves beside the shard).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from shardreplay.buffer.shard import Shard
from shardreplay.distributed.drawn import Drawn
from shardreplay.distributed.exchange_stats import ExchangeStats
from shardreplay.distributed.group import Collectives, Released
from shardreplay.distributed.pending import PendingUpdates
from shardreplay.distributed.priorities import PriorityRouter
from shardreplay.errors import ConfigError, EmptyBufferError


class ExchangeStrategy(Protocol):
    """How a mode draws a rank's batches once the ranks' stats are known."""

    def start(self, n: int, k: int) -> Callable[[], Any] | None:
        """Work to run while the stats are in flight (its result goes to ``draw``)."""

    def draw(self, stats: ExchangeStats, n: int, k: int, early: Any = None,
             released: Released | None = None) -> list[Drawn]:
        """``k`` batches of ``n`` windows for this rank (collective for exact mode; its
        collectives wait inside ``released()``)."""


class ShardChoice:
    """The shard-choice RNG: one seed proposal per exchange (rank 0's is shared).

    Args:
        rng: the generator (seeded with the buffer's seed and the rank).
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def proposal(self) -> int:
        """The next seed proposal."""
        return int(self.rng.integers(0, 1 << 63))

    def state(self) -> dict[str, Any]:
        """The shard-choice RNG's state, JSON-ready."""
        return {"rng": self.rng.bit_generator.state}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned.

        Raises:
            ConfigError: ``state`` is not from :meth:`state` (nothing changes).
        """
        try:
            scratch = type(self.rng.bit_generator)()
            scratch.state = dict(state["rng"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("not a sharding state from internals_of(buffer).sharding_state(): "
                              f"{exc!r}") from exc
        self.rng.bit_generator.state = scratch.state


class Refill:
    """Draws ``prefetch`` batches per call (collective on the exchange group).

    Args:
        shard: this rank's shard.
        comm: the exchange group's collectives.
        router: the priority router (its queue travels with the exchange).
        strategy: the mode's :class:`ExchangeStrategy`.
        prefetch: batches per exchange.
        choice: the shard-choice RNG.
    """

    def __init__(self, shard: Shard, comm: Collectives, router: PriorityRouter,
                 strategy: ExchangeStrategy, prefetch: int, choice: ShardChoice) -> None:
        self._shard, self._comm = shard, comm
        self._router, self.strategy = router, strategy
        self.prefetch = prefetch
        self._choice = choice

    def __call__(self, n: int, pending: PendingUpdates, released: Released | None = None) -> list[Drawn]:
        """One exchange: route ``pending`` (and the others' queued updates), agree on the
        global picture, draw ``prefetch`` batches of ``n``. Collectives: one all_gather of
        the stats; when any rank had updates queued, one all_to_all routing them and a
        second all_gather of the stats (the draw must see them); then the strategy's.
        Every collective waits inside ``released()`` (the runner's lock let go).

        Raises:
            EmptyBufferError: no shard has a window to draw (on every rank alike).
            CollectiveTimeout: a peer rank did not join in time.
        """
        k = self.prefetch
        early = self.strategy.start(n, k) if not len(pending) else None
        box: list[Any] = []
        run = None if early is None else lambda: box.append(early())
        stats = self._gather_stats(n, pending, released, run)
        self._router.learn_key_tags(stats.key_tag)
        if stats.tail.any():  # queued priority updates first, so the draw sees them
            self._router.route(pending.take()[0], stats.tail, released)
            stats, box = self._gather_stats(n, pending, released), []
        self._shard.raise_max_priority(float(stats.max_priority.max()))
        if stats.samplable.sum() == 0 or stats.mass.sum() <= 0:
            raise EmptyBufferError("no shard has a window to sample: write more steps first")
        return self.strategy.draw(stats, n, k, box[0] if box else None, released)

    def _gather_stats(self, batch_size: int, pending: PendingUpdates, released: Released | None,
                      while_waiting: Callable[[], Any] | None = None) -> ExchangeStats:
        """Every rank's :class:`ExchangeStats` (as ``[K]`` columns)."""
        st = self._shard.stats()
        mine = ExchangeStats(st.mass, st.samplable, st.min_leaf, batch_size,
                             self._choice.proposal(), self._shard.max_priority, st.key_tag,
                             pending.counts)
        rows = self._comm.all_gather(mine.to_tensor(), "ShardedReplayBuffer.sample(all_gather stats)",
                                     while_waiting=while_waiting, released=released)
        return ExchangeStats.from_tensor(rows)
