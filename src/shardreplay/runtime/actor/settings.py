"""An actor's settings, and how the run description the learners publish with every policy
(:class:`~shardreplay.policy.broadcast.RunInfo`) fills in those actors must share (kept
apart from the loop, so the learner and the CLI build them without it)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from shardreplay.errors import ConfigError
from shardreplay.policy.broadcast import RunInfo

log = logging.getLogger("shardreplay.actor")
# Settings an actor must share with the learners, published with every policy: an actor
# takes those it leaves None; one it was given otherwise is an error (the learner would
# train on data it does not expect).
AGREED = ("algo", "num_actors", "num_shards", "env_id", "env_import", "env_kwargs", "network", "compression",
          "envs_per_actor", "chunk_steps", "queued_chunks_per_actor", "epsilon_base", "epsilon_exponent",
          "epsilon_warmup_steps")
# Used for a policy that publishes no settings (a publisher that names no run).
_UNPUBLISHED = {"algo": "dqn", "env_id": "CartPole-v1", "env_import": "", "env_kwargs": "", "network": "mlp",
                "compression": "none", "envs_per_actor": 4, "chunk_steps": 16,
                "queued_chunks_per_actor": None, "epsilon_base": 0.4, "epsilon_exponent": 7.0,
                "epsilon_warmup_steps": 0}


@dataclass(frozen=True)
class ActorSettings:
    """What one actor runs.

    The settings in :data:`AGREED` (None: take the learner's) come from the run the
    policy at ``policy_url`` belongs to; one given here that differs from it is a
    :class:`ConfigError` naming both values. Those that are also ``shardreplay train``
    settings mean what ``train --help`` says (docs/multi-machine.md); the others:

    Attributes:
        actor_id: this actor's id (0-based); also picks its learner shard.
        num_actors: actors in the run (for the Ape-X epsilon of each stream).
        num_shards: learner shards (ranks).
        transport: ``local``, ``file:///dir`` or ``redis://host:port/db`` ('' = the
            learner's, as it published it; give it where this machine reaches the
            medium at another address).
        policy_url: where the learner publishes weights (``file:///dir`` or ``redis://``).
        hidden: hidden layer sizes of the Q-network; the first policy's weights decide
            (a remote actor need not know the learner's choice).
        seed: environment and exploration seed (None: derived from the run's seed, as
            for the learners' own actors).
        max_env_steps: stop after this many vector steps (None: until stopped).
        policy_wait_s: how long to wait for the first policy.
        send_timeout_s: one attempt's wait for room in the transport.
        policy_check_interval_s: how often to look for new weights.
        device: where the actor runs its network (cpu, cuda or cuda:N): a setting of
            this machine, not agreed with the learners.
        delivery_log: a file to which one JSON line ``{"actor_id", "sequence", "steps"}``
            is appended for every chunk the transport accepted (an audit of what this
            actor was told was delivered); None: no log.
    """

    actor_id: int
    algo: str | None = None
    num_actors: int | None = None
    num_shards: int | None = None
    env_id: str | None = None
    env_import: str | None = None
    env_kwargs: str | None = None
    network: str | None = None
    compression: str | None = None
    envs_per_actor: int | None = None
    chunk_steps: int | None = None
    transport: str = ""
    policy_url: str = ""
    hidden: tuple[int, ...] = (128, 128)
    epsilon_base: float | None = None
    epsilon_exponent: float | None = None
    epsilon_warmup_steps: int | None = None
    seed: int | None = None
    max_env_steps: int | None = None
    policy_wait_s: float = 120.0
    send_timeout_s: float = 5.0
    queued_chunks_per_actor: int | None = None
    policy_check_interval_s: float = 0.2
    delivery_log: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.actor_id < 0 or (self.num_actors is not None and self.actor_id >= self.num_actors):
            raise ConfigError(f"actor_id must lie in [0, {self.num_actors}), got {self.actor_id}")
        if any(v is not None and v < 1 for v in (self.envs_per_actor, self.chunk_steps, self.num_shards,
                                                 self.queued_chunks_per_actor)):
            raise ConfigError("envs_per_actor, chunk_steps, num_shards and queued_chunks_per_actor "
                              "must be >= 1")
        if not self.policy_url:
            raise ConfigError("policy_url is required (file:///dir or redis://host:port/db)")


def resolve(s: ActorSettings, info: RunInfo | None) -> ActorSettings:
    """``s`` with every :data:`AGREED` setting, the transport and the seed filled in from
    the run ``info`` describes.

    Raises:
        ConfigError: a setting of ``s`` contradicts the run's (one line: the flag, its
            value and the learner's), or neither gives ``num_actors`` / ``num_shards``
            / a transport.
    """
    published = info.settings if info is not None else {}
    values: dict[str, Any] = {}
    for name in AGREED:
        flag = "--" + name.replace("_", "-")
        mine = getattr(s, name)
        if name in published:
            theirs = published[name]
            if mine is not None and mine != theirs:
                raise ConfigError(f"{flag} {mine} contradicts the learner's {theirs} (published with the "
                                  f"policy at {s.policy_url}): leave {flag} out to take the learner's")
            values[name] = theirs
        elif mine is not None:
            values[name] = mine
        elif name in _UNPUBLISHED:
            values[name] = _UNPUBLISHED[name]
        else:
            raise ConfigError(f"the policy at {s.policy_url} publishes no run settings (an older learner?): "
                              f"give {flag}")
    values["transport"] = s.transport or (info.transport if info is not None else "")
    if not values["transport"]:
        raise ConfigError(f"the policy at {s.policy_url} names no transport: give --transport")
    if s.seed is None and info is not None and info.seed is not None:
        values["seed"] = actor_seed(info.seed, s.actor_id, info.env_steps)
    return dataclasses.replace(s, **values)


def actor_seed(run_seed: int, actor_id: int, env_steps: int) -> int:
    """The seed of actor ``actor_id`` started when the run had ``env_steps`` steps: fixed
    by the run's seed; a resumed run plays new episodes. Below 2**32: numpy's legacy
    ``RandomState`` (MinAtar's envs) refuses larger seeds."""
    return (run_seed * 7919 + actor_id + 104_729 * env_steps) % 2**32
