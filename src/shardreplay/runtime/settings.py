"""TrainSettings: every setting of a training run, documented, validated, YAML-ready."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardreplay.errors import ConfigError


@dataclass(frozen=True)
class TrainSettings:
    """A distributed Ape-X DQN run. Every field is also a ``shardreplay train`` flag.

    Attributes:
        env_id: gymnasium id with Discrete actions and a flat vector observation.
        learners: learner ranks (shards of the replay buffer).
        actors: actor processes the learners start here (each runs ``envs_per_actor``
            environments).
        remote_actors: actors started elsewhere (``shardreplay actor --actor-id`` from
            ``actors`` on, ``--num-actors`` = actors + remote_actors) that reach the
            learners through a ``file://`` or ``redis://`` transport; the shards are sized
            for them.
        envs_per_actor: environments (streams) per actor.
        transport: ``local``, ``file:///dir`` or ``redis://host:port/db``.
        policy_url: where weights are published ('' = ``file://<run_dir>/policy``,
            or the Redis URL when the transport is Redis).
        sample_mode: ``exact`` (one global distribution) or ``local`` (own shard, weighted).
        prefetch: batches each learner rank draws per replay exchange. 1: every update
            samples the current priorities; k > 1: 1/k of the collectives per update, a
            batch may miss the priority updates of up to k - 1 earlier updates.
        pipeline: run each learner rank's replay exchanges on a background thread over
            the buffer's own process group, so the exchange for the next update overlaps
            this one's training: a batch misses the priority updates of at most the one
            update before it (``prefetch`` of them with prefetch > 1). ``--no-pipeline``
            samples in the learner's thread.
        run_dir: where config, metrics, checkpoints and the plot go ('' = runs/<time>).
        total_env_steps: stop after this many environment steps (all actors).
        max_minutes: stop after this wall time.
        stop_return: stop when the evaluation mean return reaches this (<= 0: never).
        eval_episodes: episodes of the greedy policy per evaluation.
        eval_interval_updates: learner updates between quick evaluations.
        quick_eval_episodes: episodes of a quick evaluation; when its mean reaches
            ``stop_return``, a full evaluation of ``eval_episodes`` decides.
        batch_size: windows sampled per rank per update.
        n_step: n of the n-step return (the window is n + 1 steps).
        gamma: discount.
        lr: Adam learning rate.
        target_update_interval: updates between target-network copies.
        hidden: hidden layer sizes of the Q-network.
        replay_capacity: steps of replay per learner rank.
        alpha: prioritization exponent.
        beta_start, beta_end, beta_updates: beta schedule over updates.
        samples_per_insert: how often each inserted step is sampled on average.
        min_replay: global windows before learning starts.
        chunk_steps: steps per stream in an actor chunk.
        queued_chunks_per_actor: chunks that may wait in the transport per actor; a
            short queue keeps data fresh (actors block, then act with the newest policy).
        epsilon_base, epsilon_exponent: Ape-X exploration per stream.
        epsilon_warmup_steps: exploration starts at 1 and falls linearly to each stream's
            Ape-X epsilon over this many environment steps (all actors together).
        publish_interval_updates: updates between weight broadcasts.
        checkpoint_interval_updates: updates between checkpoints (0: only at the end).
        collective_timeout_s: how long ranks wait for each other.
        max_actor_restarts: restarts per actor after a crash.
        seed: base seed.
        delivery_log_dir: when set, each actor started here appends one JSON line
            ``{"actor_id", "sequence", "steps"}`` to ``DIR/actor-<id>.jsonl`` for every
            chunk its transport accepted: an audit of what was delivered ('' = none).
        progress: show a live progress bar (rank 0).
    """

    env_id: str = "CartPole-v1"
    learners: int = 1
    actors: int = 2
    remote_actors: int = 0
    envs_per_actor: int = 4
    transport: str = "local"
    policy_url: str = ""
    sample_mode: str = "exact"
    prefetch: int = 1
    pipeline: bool = True
    run_dir: str = ""
    total_env_steps: int = 200_000
    max_minutes: float = 10.0
    stop_return: float = 475.0
    eval_episodes: int = 20
    eval_interval_updates: int = 500
    quick_eval_episodes: int = 5
    batch_size: int = 64
    n_step: int = 3
    gamma: float = 0.99
    lr: float = 2.3e-3
    target_update_interval: int = 10
    hidden: tuple[int, ...] = (256, 256)
    replay_capacity: int = 100_000
    alpha: float = 0.6
    beta_start: float = 0.4
    beta_end: float = 1.0
    beta_updates: int = 20_000
    samples_per_insert: float = 32.0
    min_replay: int = 1000
    chunk_steps: int = 8
    queued_chunks_per_actor: int = 2
    epsilon_base: float = 0.4
    epsilon_exponent: float = 7.0
    epsilon_warmup_steps: int = 8000
    publish_interval_updates: int = 25
    checkpoint_interval_updates: int = 0
    collective_timeout_s: float = 300.0
    max_actor_restarts: int = 3
    seed: int = 0
    delivery_log_dir: str = ""
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive = ("learners", "envs_per_actor", "total_env_steps", "batch_size", "n_step",
                    "target_update_interval", "replay_capacity", "beta_updates", "chunk_steps",
                    "publish_interval_updates", "eval_episodes", "eval_interval_updates",
                    "queued_chunks_per_actor", "quick_eval_episodes", "prefetch")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if min(self.actors, self.remote_actors, self.max_actor_restarts,
               self.checkpoint_interval_updates) < 0:
            raise ConfigError("actors, remote_actors, max_actor_restarts and "
                              "checkpoint_interval_updates must be >= 0")
        if self.remote_actors and self.transport in ("", "local", "local://"):
            raise ConfigError("remote_actors need a transport they can reach: "
                              "--transport file:///shared/dir or redis://host:port/db")
        if self.sample_mode not in ("exact", "local"):
            raise ConfigError(f"sample_mode must be 'exact' or 'local', got {self.sample_mode!r}")
        if not 0 < self.gamma <= 1 or self.lr <= 0 or self.samples_per_insert <= 0:
            raise ConfigError("need 0 < gamma <= 1, lr > 0 and samples_per_insert > 0")
        if self.max_minutes <= 0 or self.collective_timeout_s <= 0:
            raise ConfigError("max_minutes and collective_timeout_s must be > 0")
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))

    @property
    def window(self) -> int:
        """Steps per sampled window: ``n_step + 1``."""
        return self.n_step + 1

    @property
    def total_actors(self) -> int:
        """Actors of the run: started here plus remote ones."""
        return self.actors + self.remote_actors

    def streams_of_shard(self, shard: int) -> int:
        """Streams (rows) learner ``shard`` holds: its actors' environments (at least 1)."""
        actors = len(range(shard, max(self.total_actors, 1), self.learners))
        return max(actors, 1) * self.envs_per_actor

    def actors_of_shard(self, shard: int) -> int:
        """Actors (local and remote) whose streams go to learner ``shard``."""
        return len(range(shard, self.total_actors, self.learners))

    def row_of(self, actor_id: int, stream: int) -> int:
        """The row of an actor's stream in its shard."""
        return (actor_id // self.learners) * self.envs_per_actor + stream

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-ready settings."""
        d = dataclasses.asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainSettings:
        """Settings from a dict (YAML); unknown keys are an error.

        Raises:
            ConfigError: an unknown key or a bad value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown setting(s) {unknown}; see shardreplay train --help")
        d = dict(d)
        if "hidden" in d:
            d["hidden"] = tuple(d["hidden"])
        try:
            return cls(**d)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"bad setting: {exc}") from exc

    def with_run_dir(self, run_dir: Path) -> TrainSettings:
        """A copy with ``run_dir`` set (and the default policy URL resolved)."""
        redis = self.transport.startswith(("redis://", "rediss://", "unix://"))
        policy = self.policy_url or (self.transport if redis else f"file://{Path(run_dir).resolve()}/policy")
        return dataclasses.replace(self, run_dir=str(run_dir), policy_url=policy)
