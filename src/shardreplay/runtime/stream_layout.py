"""Which learner shard, and which row of it, each actor stream feeds: whole actors
``actor % K`` with at least as many actors as shards, else contiguous balanced blocks of
streams; recomputed from ``(actors, envs per actor, shards)`` alone (docs/semantics.md,
"Chunks across crashes", Routing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardreplay.errors import ConfigError

# A chunk's sequence carries the shard it was made for above this bit (docs/semantics.md,
# "Chunks across crashes"); actors start their sequences at a clock reading in
# microseconds (about 2**51 today), which stays below it for a century.
SHARD_SEQUENCE_SHIFT = 52
MAX_SHARDS = 2047  # shard << SHARD_SEQUENCE_SHIFT plus the clock stays a positive int64 (until ~2110)


@dataclass(frozen=True)
class StreamLayout:
    """The routing of ``num_actors x envs_per_actor`` streams over ``num_shards`` shards.

    Raises:
        ConfigError: fewer streams than shards (with at least one actor), no shard,
            more than ``MAX_SHARDS``, or no environment per actor.
    """

    num_actors: int
    envs_per_actor: int
    num_shards: int

    def __post_init__(self) -> None:
        a, e, k = self.num_actors, self.envs_per_actor, self.num_shards
        if not 1 <= k <= MAX_SHARDS or e < 1 or a < 0:
            raise ConfigError(f"need 1..{MAX_SHARDS} learners, >= 1 env per actor and >= 0 actors; "
                              f"got {k}, {e}, {a}")
        if 0 < a * e < k:
            raise ConfigError(f"--learners {k} needs at least {k} streams to feed every shard, but "
                              f"actors x envs-per-actor = {a} x {e} = {a * e}: raise --actors or "
                              f"--envs-per-actor, or use at most {a * e} learners")

    @property
    def whole_actors(self) -> bool:
        """Each actor feeds one shard (``A >= K``)."""
        return self.num_actors >= self.num_shards

    @property
    def num_streams(self) -> int:
        """Streams of the run (``A * E``)."""
        return self.num_actors * self.envs_per_actor

    def _first(self, shard: int) -> int:
        """Split mode: the first stream of ``shard`` (``ceil(shard * S / K)``)."""
        return -(-shard * self.num_streams // self.num_shards)

    def shards(self, actor_id: int) -> np.ndarray:
        """The shard of each of ``actor_id``'s envs, ``[E]``."""
        e, k = self.envs_per_actor, self.num_shards
        if self.whole_actors:
            return np.full(e, actor_id % k, np.int64)
        g = actor_id * e + np.arange(e, dtype=np.int64)
        return g * k // self.num_streams

    def rows(self, actor_id: int, envs: np.ndarray) -> np.ndarray:
        """The rows, in their shards, of ``actor_id``'s ``envs``."""
        envs = np.asarray(envs, np.int64)
        e, k = self.envs_per_actor, self.num_shards
        if self.whole_actors:
            return (actor_id // k) * e + envs
        g = actor_id * e + envs
        first = -(-(g * k // self.num_streams) * self.num_streams // k)
        return g - first

    def stand_in(self, actor_id: int) -> int | None:
        """The actor whose streams take ``actor_id``'s: itself while this routing runs it;
        for an actor it no longer runs (a resume with fewer actors), actor
        ``actor_id % num_actors`` (env ``e`` to its env ``e``), so the chunks an earlier
        life acknowledged of it are replayed, not lost. None when the run has no actors."""
        if actor_id < self.num_actors:
            return actor_id
        return actor_id % self.num_actors if self.num_actors else None

    def home_shard(self, actor_id: int) -> int:
        """The shard whose learner starts ``actor_id`` (the shard of its first env)."""
        return int(self.shards(actor_id)[0])

    def streams_of_shard(self, shard: int) -> int:
        """Rows of ``shard`` (``E`` when the run has no actors: a shard is never empty)."""
        if self.num_actors == 0:
            return self.envs_per_actor
        if self.whole_actors:
            return len(range(shard, self.num_actors, self.num_shards)) * self.envs_per_actor
        return self._first(shard + 1) - self._first(shard)

    def actors_of_shard(self, shard: int) -> int:
        """Actors with at least one stream in ``shard``."""
        return sum(shard in self.shards(a) for a in range(self.num_actors))

    def groups(self, actor_id: int) -> dict[int, np.ndarray]:
        """``{shard: envs}``: which of ``actor_id``'s envs each of its shards receives."""
        shards = self.shards(actor_id)
        return {int(k): np.flatnonzero(shards == k) for k in np.unique(shards)}
