"""What a learner rank builds when it starts: its shard of the replay buffer, the settings
of the actors that feed it, and the warnings about other runs on the same media.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import ConfigError, ShardReplayError
from shardreplay.policy import open_subscriber
from shardreplay.policy.broadcast import FINISHED
from shardreplay.runtime.actor.loop import ActorSettings, actor_seed
from shardreplay.runtime.learner.sync import agreed_settings
from shardreplay.runtime.routing import foreign_backlog
from shardreplay.runtime.settings import TrainSettings
from shardreplay.samplers.schedules import LinearSchedule
from shardreplay.spec import Spec
from shardreplay.transport.urls import parse_medium

log = logging.getLogger("shardreplay.learner")


def make_shard_buffer(settings: TrainSettings, spec: Spec, rank: int,
                      device: torch.device | None = None) -> ShardedReplayBuffer:
    """Rank ``rank``'s shard: a prioritized buffer of this shard's streams, sampled as part
    of the one buffer of all ranks (a collective: every rank of the group calls it), its
    batches returned on ``device`` (None: the CPU; CUDA: pinned, copied without blocking).

    Raises:
        ConfigError: replay settings the buffer rejects.
    """
    s, r = settings, settings.replay
    streams = s.streams.streams_of_shard(rank)
    capacity = max(r.capacity // streams, s.window)
    local = ReplayBuffer(spec, num_streams=streams, stream_capacity=capacity, window=s.window,
                         period=s.period, sampler="prioritized", alpha=r.alpha,
                         beta=LinearSchedule(r.beta_start, r.beta_end, r.beta_updates),
                         seed=s.run.seed * 1000 + rank)
    return ShardedReplayBuffer(local, timeout_s=s.learners.collective_timeout_s, prefetch=r.prefetch,
                               pipeline=r.pipeline, mode=r.sample_mode, device=device)


def actor_settings_of_shard(settings: TrainSettings, rank: int, world: int,
                            env_steps: int) -> list[ActorSettings]:
    """The settings of the actors that send to shard ``rank`` (seeded from ``env_steps``,
    so a resumed run's actors do not repeat the episodes of the first life)."""
    s = settings
    mine = [a for a in range(s.actors.count) if s.streams.home_shard(a) == rank]
    agreed = agreed_settings(s, world)
    return [ActorSettings(actor_id=a, transport=s.transport.url, policy_url=s.transport.policy_url,
                          hidden=s.learners.hidden, seed=actor_seed(s.run.seed, a, env_steps), **agreed,
                          device=s.actors.device,
                          delivery_log=(str(Path(s.actors.delivery_log_dir) / f"actor-{a}.jsonl")
                                        if s.actors.delivery_log_dir else None))
            for a in mine]


def check_rings_reach(settings: TrainSettings, actors: list[ActorSettings], rings: Mapping[int, Any]) -> None:
    """The ``local`` rings this rank can hand its actors cover every shard they feed.

    Raises:
        ConfigError: an actor feeds a shard whose ring is in another process tree (fewer
            actors than learners under torchrun with the local transport).
    """
    for a in actors:
        feeds = set(settings.streams.groups(a.actor_id))
        missing = feeds - set(rings)
        if missing:
            raise ConfigError(f"actor {a.actor_id} feeds shards {sorted(feeds)}, "
                              f"but the local rings of shards {sorted(missing)} live in other processes: "
                              "with fewer actors than learners under torchrun use --transport file:///dir "
                              "or redis://..., or --actors >= --learners")


def log_foreign_backlog(url: str, rank: int, run_id: str) -> dict[str, int]:
    """Chunks other runs left for shard ``rank`` on the medium at ``url`` (never read),
    by run: logged once here. A medium that cannot be searched gives ``{}`` (logged)."""
    if parse_medium(url).kind == "local":
        return {}
    try:
        found = foreign_backlog(url, rank, run_id)
    except ShardReplayError as exc:
        log.warning("rank %d: could not look for other runs' chunks: %s", rank, exc)
        return {}
    if found:
        log.warning("rank %d: %d chunk(s) of other runs wait on %s (%s); this run (%s) ignores them: "
                    "delete them when those runs are over", rank, sum(found.values()), url,
                    ", ".join(f"{k}: {v}" for k, v in sorted(found.items())), run_id or "unnamed")
    return found


def warn_if_taking_over(policy_url: str, run_id: str) -> None:
    """Say so when ``policy_url`` holds another run's policy that did not finish: its
    actors will switch to this run (two runs must not share a policy URL)."""
    subscriber = open_subscriber(policy_url, check_interval_s=0)
    try:
        current = subscriber.poll()
    except ShardReplayError as exc:
        log.warning("could not read the policy at %s: %s", policy_url, exc)
        return
    finally:
        subscriber.close()
    if current is not None and current.run_id != run_id and FINISHED not in current.weights:
        log.warning("the policy at %s belongs to run %s, which has not finished: this run (%s) takes "
                    "it over and that run's actors will switch to this one. Give concurrent runs "
                    "their own --policy-url", policy_url, current.run_id or "(unnamed)", run_id)
