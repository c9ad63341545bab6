"""The actor: steps a gymnasium vector env with a recent policy and ships chunks.

Each of its streams (one per env) explores with its own Ape-X epsilon. Steps go into
chunks of ``chunk_steps`` steps, sent to the transport of the learner shard that owns
this actor (:func:`shardreplay.runtime.routing.shard_for_actor`). New weights are
picked up with a cheap version check. A transport failure is retried with a back-off
(the same chunk, so a duplicate is dropped by the learner); SIGTERM / SIGINT stop the
actor after the current step, sending what it holds.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardreplay.errors import ConfigError, TransportError, TransportTimeout
from shardreplay.policy import open_subscriber
from shardreplay.policy.broadcast import wait_for_policy
from shardreplay.runtime.chunker import Chunker
from shardreplay.runtime.envs import env_spaces, make_vector_env, transition_spec
from shardreplay.runtime.gym_steps import GymStepConverter
from shardreplay.runtime.qnet import QNetwork, apex_epsilons, epsilon_greedy
from shardreplay.runtime.routing import shard_for_actor, shard_transport
from shardreplay.transport.base import Transport
from shardreplay.transport.codec import Chunk

log = logging.getLogger("shardreplay.actor")
# A tensor of this name in a published policy says: training is over, actors may exit.
FINISHED = "shardreplay.finished"


@dataclass(frozen=True)
class ActorSettings:
    """What one actor runs.

    Attributes:
        actor_id: this actor's id (0-based); also picks its learner shard.
        num_actors: actors in the run (for the Ape-X epsilon of each stream).
        num_shards: learner shards (ranks).
        env_id: gymnasium id (discrete actions, flat vector observations).
        envs_per_actor: vector env size = streams of this actor.
        chunk_steps: steps per stream in one chunk.
        transport: ``local``, ``file:///dir`` or ``redis://host:port/db``.
        policy_url: where the learner publishes weights (``file:///dir`` or ``redis://``).
        hidden: hidden layer sizes of the Q-network; the first policy's weights decide
            (a remote actor need not know the learner's choice).
        epsilon_base, epsilon_exponent: Ape-X exploration ``base^(1 + exponent i/(N-1))``.
        epsilon_warmup_steps: exploration starts at 1 and falls linearly to the Ape-X
            epsilon over this many environment steps of the whole run (each actor counts
            its own steps times ``num_actors``).
        seed: environment and exploration seed (None: random).
        max_env_steps: stop after this many vector steps (None: until stopped).
        policy_wait_s: how long to wait for the first policy.
        send_timeout_s: one attempt's wait for room in the transport.
        queued_per_actor: chunks that may wait in the medium per actor (None: its default).
        policy_check_interval_s: how often to look for new weights.
        delivery_log: a file to which one JSON line ``{"actor_id", "sequence", "steps"}``
            is appended for every chunk the transport accepted (an audit of what this
            actor was told was delivered); None: no log.
    """

    actor_id: int
    num_actors: int
    num_shards: int
    env_id: str = "CartPole-v1"
    envs_per_actor: int = 4
    chunk_steps: int = 16
    transport: str = "local"
    policy_url: str = ""
    hidden: tuple[int, ...] = (128, 128)
    epsilon_base: float = 0.4
    epsilon_exponent: float = 7.0
    epsilon_warmup_steps: int = 0
    seed: int | None = None
    max_env_steps: int | None = None
    policy_wait_s: float = 120.0
    send_timeout_s: float = 5.0
    queued_per_actor: int | None = None
    policy_check_interval_s: float = 0.2
    delivery_log: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.actor_id < self.num_actors:
            raise ConfigError(f"actor_id must lie in [0, {self.num_actors}), got {self.actor_id}")
        if self.envs_per_actor < 1 or self.chunk_steps < 1 or self.num_shards < 1:
            raise ConfigError("envs_per_actor, chunk_steps and num_shards must be >= 1")
        if not self.policy_url:
            raise ConfigError("policy_url is required (file:///dir or redis://host:port/db)")


class StopFlag:
    """Set by SIGTERM / SIGINT (or by the caller) to end the actor loop."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self, *_args: Any) -> None:
        """Ask the loop to stop (usable as a signal handler)."""
        self._event.set()

    def is_set(self) -> bool:
        """True once a stop was asked."""
        return self._event.is_set()

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Route ``signals`` (default SIGTERM and SIGINT) here (main thread only)."""
        for sig in signals:
            signal.signal(sig, self.set)


def run(settings: ActorSettings, transport: Transport | None = None,
        stop: StopFlag | None = None) -> dict[str, int]:
    """Run one actor until stopped or ``max_env_steps``; returns counters.

    Args:
        settings: what to run.
        transport: the shard's transport when already open (``local`` rings are made
            by the parent and passed in); None opens it from ``settings.transport``.
        stop: a stop flag (None: a new one, wired to SIGTERM / SIGINT).

    Raises:
        ConfigError: a bad environment or settings.
        TransportTimeout: no first policy within ``policy_wait_s``.
    """
    if stop is None:
        stop = StopFlag()
        stop.install()
    obs_size, num_actions = env_spaces(settings.env_id)
    spec = transition_spec(obs_size)
    shard = shard_for_actor(settings.actor_id, settings.num_shards)
    transport = transport or shard_transport(
        settings.transport, spec, shard, queued_per_actor=settings.queued_per_actor,
        actors=len(range(shard, settings.num_actors, settings.num_shards)))
    env, obs = make_vector_env(settings.env_id, settings.envs_per_actor, settings.seed)
    try:
        return _loop(settings, env, obs, num_actions, transport, stop)
    finally:
        env.close()


def _loop(settings: ActorSettings, env: Any, obs: np.ndarray, num_actions: int,
          transport: Transport, stop: StopFlag) -> dict[str, int]:
    s = settings
    torch.set_num_threads(1)
    subscriber = open_subscriber(s.policy_url, check_interval_s=s.policy_check_interval_s)
    counters = {"env_steps": 0, "chunks": 0, "send_retries": 0, "policy_updates": 0}
    try:
        first = _first_policy(subscriber, s, stop)
    except BaseException:
        subscriber.close()
        raise
    if first is None:  # stopped before any policy came: nothing was played, nothing to send
        subscriber.close()
        log.info("actor %d stopped while waiting for its first policy", s.actor_id)
        return counters
    feed = _PolicyFeed(subscriber, stop)
    net = QNetwork(obs.shape[1], num_actions, _hidden_of(first.weights, obs.shape[1], num_actions, s))
    version = _load(net, first)
    rng = np.random.default_rng(s.seed)
    eps = apex_epsilons(s.envs_per_actor, s.actor_id * s.envs_per_actor, s.num_actors * s.envs_per_actor,
                        s.epsilon_base, s.epsilon_exponent)
    converter = GymStepConverter.from_env(env)
    converter.reset(obs)
    chunker = Chunker(s.actor_id, np.arange(s.envs_per_actor), s.chunk_steps,
                      first_sequence=time.time_ns() // 1000)
    delivered = _DeliveryLog(s.delivery_log)
    writer = transport.writer()
    try:
        while not stop.is_set() and (s.max_env_steps is None or counters["env_steps"] < s.max_env_steps):
            update = feed.take()
            if feed.finished:
                log.info("actor %d: the learners finished training; stopping", s.actor_id)
                break
            if update is not None:
                version = _load(net, update)
                counters["policy_updates"] += 1
            with torch.no_grad():
                explore = _warmup(eps, counters["env_steps"] * s.num_actors, s.epsilon_warmup_steps)
                actions = epsilon_greedy(net(torch.as_tensor(obs, dtype=torch.float32)), explore, rng)
            obs, reward, terminated, truncated, info = env.step(actions)
            counters["env_steps"] += s.envs_per_actor
            for step, _ids in converter.step(actions, obs, reward, terminated, truncated, info):
                chunk = chunker.add(step, version)
                if chunk is not None:
                    writer = _send(chunk, writer, transport, stop, counters, s.send_timeout_s, feed,
                                   delivered)
        last = chunker.flush()
        if last is not None:
            writer = _send(last, writer, transport, stop, counters, s.send_timeout_s, feed, delivered)
    finally:
        writer.close()
        delivered.close()
        subscriber.close()
    log.info("actor %d stopped: %s", s.actor_id, counters)
    return counters


def _warmup(eps: np.ndarray, run_steps: int, warmup_steps: int) -> np.ndarray:
    """Exploration during warm-up: from 1 down to ``eps`` over ``warmup_steps``."""
    if warmup_steps <= 0 or run_steps >= warmup_steps:
        return eps
    return np.maximum(eps, 1.0 - run_steps / warmup_steps)


class _PolicyFeed:
    """The subscriber, polled from the loop and from a blocked send: a new policy is held
    for the loop; a 'finished' one sets the stop flag (no learner will take more)."""

    def __init__(self, subscriber: Any, stop: StopFlag) -> None:
        self._subscriber = subscriber
        self._stop = stop
        self._held: Any = None
        self.finished = False

    def refresh(self) -> None:
        update = self._subscriber.poll()
        if update is not None and FINISHED in update.weights:
            self.finished = True
            self._stop.set()
        elif update is not None:
            self._held = update

    def take(self) -> Any:
        """The newest policy not yet taken, or None."""
        self.refresh()
        update, self._held = self._held, None
        return update


def _first_policy(subscriber: Any, s: ActorSettings, stop: StopFlag) -> Any:
    """The first policy to act with, or None when ``stop`` was set first. A 'finished'
    one is a previous run's last word, so wait for a newer one (a resumed or new run
    publishes soon).

    Raises:
        TransportTimeout: no usable policy within ``policy_wait_s``.
    """
    log.info("actor %d: waiting up to %.0f s for a policy at %s", s.actor_id, s.policy_wait_s, s.policy_url)
    deadline = time.monotonic() + s.policy_wait_s
    while not stop.is_set():
        try:  # short waits: a stop signal must not wait for the learner
            update = wait_for_policy(subscriber, min(max(deadline - time.monotonic(), 0.0), 0.5))
        except TransportTimeout:
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"no policy at {s.policy_url} within {s.policy_wait_s} s: "
                                       "has the learner started (same --policy-url)?") from None
            continue
        if FINISHED not in update.weights:
            return update
        log.info("actor %d: the policy at %s says a run finished; waiting for a new one", s.actor_id,
                 s.policy_url)
    return None


def _hidden_of(weights: dict[str, Any], obs_size: int, num_actions: int, s: ActorSettings) -> tuple[int, ...]:
    """The hidden sizes of the published Q-network (its Linear weights ``net.<i>.weight``).

    Raises:
        ConfigError: the weights are not a Q-network for this environment.
    """
    layers = sorted((int(k.split(".")[1]), tuple(v.shape)) for k, v in weights.items()
                    if k.startswith("net.") and k.endswith(".weight") and len(v.shape) == 2)
    shapes = [shape for _i, shape in layers]
    if not shapes or shapes[0][1] != obs_size or shapes[-1][0] != num_actions:
        raise ConfigError(f"the policy at {s.policy_url} (layers {shapes}) is not a Q-network for "
                          f"{s.env_id} ({obs_size} observations, {num_actions} actions): do the learners "
                          "train the same --env-id?")
    hidden = tuple(int(out) for out, _in in shapes[:-1])
    if hidden != tuple(s.hidden):
        log.info("actor %d: hidden sizes %s from the published policy", s.actor_id, hidden)
    return hidden


def _load(net: QNetwork, update: Any) -> int:
    net.load_state_dict({k: torch.as_tensor(v) for k, v in update.weights.items()})
    return int(update.version)


class _DeliveryLog:
    """``ActorSettings.delivery_log``: one line per chunk the transport accepted.

    One ``write`` on an ``O_APPEND`` descriptor per line: a line is whole or absent
    after the actor is killed (not fsynced: a machine crash may lose the tail).
    """

    def __init__(self, path: str | None) -> None:
        self._fd: int | None = None
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ConfigError(f"cannot open the delivery log {path}: {exc}; "
                                  "give a writable --delivery-log path") from exc

    def record(self, chunk: Chunk) -> None:
        if self._fd is not None:
            line = {"actor_id": chunk.actor_id, "sequence": chunk.sequence,
                    "steps": chunk.num_streams * chunk.num_steps}
            os.write(self._fd, (json.dumps(line) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _send(chunk: Chunk, writer: Any, transport: Transport, stop: StopFlag, counters: dict[str, int],
          timeout_s: float, feed: _PolicyFeed, delivered: _DeliveryLog) -> Any:
    """Send with retries; reopen the writer after a transport failure."""
    backoff = 0.1
    while True:
        try:
            # Stopping: a short wait, the learner (if still there) is draining for us.
            writer.send(chunk, timeout_s=min(timeout_s, 2.0) if stop.is_set() else timeout_s)
            counters["chunks"] += 1
            delivered.record(chunk)  # after the transport took it: what the actor was told
            return writer
        except TransportTimeout:
            counters["send_retries"] += 1  # the learner is busy: back-pressure (or gone)
            feed.refresh()
        except TransportError as exc:
            counters["send_retries"] += 1
            log.warning("actor %d: send failed (%s); reconnecting in %.1f s", chunk.actor_id, exc, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            writer.close()
            writer = transport.writer()
        if stop.is_set():
            return writer  # stopping: give up on a chunk the learner does not take now
