"""What checkpoint and runtime code reach behind a :class:`ShardedReplayBuffer`'s public
surface, through one accessor (as ``shard_of_buffer`` gives a ``ReplayBuffer``'s Shard)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from shardreplay.distributed.exchange import ExchangeStrategy, ShardChoice
from shardreplay.distributed.group import Collectives
from shardreplay.distributed.priorities import PriorityRouter
from shardreplay.distributed.runner import InlineRunner


@dataclass
class ShardedInternals:
    """The parts of one sharded buffer that checkpoints, the runtime and tests use.

    Attributes:
        collectives: the group's collectives (the caller's group: loads agree on it).
        exchange_group: the group exchanges run on (the buffer's own when pipelined).
        router: the priority router (queued updates, key tags).
        choice: the shard-choice RNG (saved with a checkpoint part).
        runner: inline or background (lock, thread, prefetched batches).
        strategy: the mode's exchange strategy.
    """

    collectives: Collectives
    exchange_group: Collectives
    router: PriorityRouter
    choice: ShardChoice
    runner: InlineRunner
    strategy: ExchangeStrategy

    def learn_key_tags(self, tags: Any) -> None:
        """Note every shard's key tag (a checkpoint load's agreement tells them)."""
        self.router.learn_key_tags(tags)

    def sharding_state(self) -> dict[str, Any]:
        """This rank's own state beside its shard, JSON-ready: the shard-choice RNG (saved
        with a checkpoint part; the max priority is the shard's own, saved with it). Waits
        for a background exchange first (it draws from the RNG)."""
        self.runner.settle()
        return self.choice.state()

    def load_sharding_state(self, state: Any) -> None:
        """Restore what :meth:`sharding_state` returned (a checkpoint load does this). The
        ``routed_max`` of older checkpoints is ignored: it could hold a priority its owner
        found stale, and the owners' applied maxima are in their shards' sampler state.

        Raises:
            ConfigError: ``state`` is not from :meth:`sharding_state` (nothing changes).
        """
        self.choice.load_state(state)


class HoldsInternals(Protocol):
    """A ShardedReplayBuffer, as far as :func:`internals_of` needs."""

    _internals: ShardedInternals


def internals_of(buffer: HoldsInternals) -> ShardedInternals:
    """The :class:`ShardedInternals` behind ``buffer`` (a ``ShardedReplayBuffer``): the one
    internal accessor checkpoints, the runtime and tests use."""
    return buffer._internals
