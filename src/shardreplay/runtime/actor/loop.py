"""The actor: steps a gymnasium vector env with the run's policy (:mod:`shardreplay.runtime.algos`)
and ships chunks of ``chunk_steps`` steps to the transport of the learner shard that owns
each stream (:mod:`shardreplay.runtime.stream_layout`). New weights are picked up with a
cheap version check; a failed send is retried with a back-off (the same chunk: the learner
drops a duplicate); SIGTERM / SIGINT stop it after the current step, sending what it holds."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shardreplay import _signals
from shardreplay._io import storage_error
from shardreplay.errors import ConfigError, ShardReplayError, TransportError, TransportTimeout
from shardreplay.gym.steps import GymStepConverter
from shardreplay.policy import open_subscriber
from shardreplay.policy.broadcast import FINISHED, RunInfo, describe_version, split_version, wait_for_policy
from shardreplay.runtime.actor.settings import (  # re-exported: the actor's public names
    AGREED,
    ActorSettings,
    actor_seed,
    resolve,
)
from shardreplay.runtime.algos import algorithm
from shardreplay.runtime.algos.base import ActorPolicy, published_hidden
from shardreplay.runtime.envs import describe_env, env_source, make_vector_env
from shardreplay.runtime.routing import shard_transport
from shardreplay.runtime.stream_layout import SHARD_SEQUENCE_SHIFT, StreamLayout
from shardreplay.spec import StepType
from shardreplay.spec.spec import flatten
from shardreplay.transport.base import Transport
from shardreplay.transport.codec import Chunk
from shardreplay.transport.urls import parse_medium

__all__ = ["AGREED", "ActorSettings", "Chunker", "Shipper", "actor_seed", "check_rings_reach", "resolve",
           "run"]

log = logging.getLogger("shardreplay.actor")
_SAID_FULL: set[int] = set()  # actors that logged their spool full (once per process)


def run(settings: ActorSettings, transport: Mapping[int, Transport] | Transport | None = None,
        stop: threading.Event | None = None) -> dict[str, int]:
    """Run one actor until stopped or ``max_env_steps``; returns counters: ``env_steps``,
    ``chunks`` (sent: on the wire when the writer's ``send`` returned; the delivery log,
    ``--delivery-log-dir``, lists those the medium confirmed), ``send_retries`` (back-pressure
    waits and transport failures) and ``policy_updates``.

    The first policy decides the run served (:class:`RunInfo`, which :func:`resolve` fills
    ``settings`` from); when another run takes the policy URL over, the actor follows it
    (docs/semantics.md, "Runs, learner lives and policy versions"). ``transport``: the
    shards' transports by shard when already open (``local`` rings, made by the parent; a
    single one serves shard 0), None to open them from the run's URL. ``stop``: set to end
    the loop (None: a new event, set by SIGTERM / SIGINT).

    Raises:
        ConfigError: a bad environment, or settings that contradict the learner's.
        TransportTimeout: no first policy within ``policy_wait_s``.
    """
    if stop is None:
        stop = event = threading.Event()
        _signals.install(dict.fromkeys((signal.SIGTERM, signal.SIGINT), lambda *_: event.set()))
    given = {0: transport} if isinstance(transport, Transport) else transport
    counters = {"env_steps": 0, "chunks": 0, "send_retries": 0, "policy_updates": 0}
    # numpy weights: a policy that needs torch converts them (torch.as_tensor shares them)
    subscriber = open_subscriber(settings.policy_url, check_interval_s=settings.policy_check_interval_s,
                                 as_numpy=True)
    try:
        first = _first_policy(subscriber, settings, stop)
        if first is None:  # stopped before any policy came: nothing was played, nothing to send
            log.info("actor %d stopped while waiting for its first policy", settings.actor_id)
            return counters
        while first is not None:
            info = RunInfo.of(first)
            served = resolve(settings, info)
            first = _serve(served, info, first, given, subscriber, stop, counters)
            if first is not None and FINISHED in first.weights:
                first = _first_policy(subscriber, settings, stop)
    finally:
        subscriber.close()
    log.info("actor %d stopped: %s", settings.actor_id, counters)
    return counters


def _serve(s: ActorSettings, info: RunInfo | None, first: Any, given: Mapping[int, Transport] | None,
           subscriber: Any, stop: threading.Event, counters: dict[str, int]) -> Any:
    """Act for the run of ``first`` until stopped or it ends; returns the first policy of
    the next run when another run took over the policy URL, else None."""
    env_id, envs, chunk_steps = s.env_id, s.envs_per_actor, s.chunk_steps
    if env_id is None or envs is None or chunk_steps is None or s.num_shards is None or s.num_actors is None:
        raise ShardReplayError(f"actor {s.actor_id}: settings not resolved before serving (a bug)")
    source = env_source(env_id, s.env_import or "", s.env_kwargs or "")
    algo = algorithm(s.algo or "dqn")
    env_info = describe_env(source, algo.actions)
    spec = algo.transition_spec(env_info, published_hidden(first.weights, s.hidden))
    layout = StreamLayout(s.num_actors, envs, s.num_shards)
    groups = layout.groups(s.actor_id)
    if given is None and parse_medium(s.transport).kind == "local":
        raise ConfigError(f"the run at {s.policy_url} uses the local transport, which only its learners' "
                          "own actors reach: train with --transport file:///shared/dir or redis://...")
    if given is not None:
        check_rings_reach(s.actor_id, groups, given)
    run_id = info.run_id if info is not None else ""
    transports = {k: given[k] if given is not None else shard_transport(
        s.transport, spec, k, run_id=run_id, queued_chunks_per_actor=s.queued_chunks_per_actor,
        actors=layout.actors_of_shard(k), compression=s.compression or "none") for k in groups}
    if info is not None:
        log.info("actor %d: serving run %s (life %d) on %s, shard(s) %s", s.actor_id, info.run_id, info.life,
                 s.transport, ", ".join(str(k) for k in groups))
    env, obs = make_vector_env(source, envs, s.seed)
    try:
        feed = _PolicyFeed(subscriber, stop, first.run_id, info.settings if info is not None else None)
        if s.device != "cpu":  # refused before any network is made; a CPU actor never imports torch for it
            from shardreplay.runtime.devices import check_cuda

            check_cuda("--device", s.device)
        policy = algo.make_policy(first.weights, env_info, s)  # holding the first weights
        one_compute_thread()  # after the policy: it may have loaded torch
        version = int(first.version)
        state = policy.initial_state(envs)
        run_steps = info.env_steps if info is not None else 0  # the run's steps when this actor joined
        played = 0
        converter = GymStepConverter.from_env(env)
        converter.reset(obs)
        shipper = Shipper(s.actor_id, groups, transports, chunk_steps, stop, counters,
                          send_timeout_s=s.send_timeout_s, delivery_log=s.delivery_log, feed=feed)
        try:
            while not stop.is_set() and (s.max_env_steps is None or counters["env_steps"] < s.max_env_steps):
                update = feed.take()
                if feed.finished:
                    log.info("actor %d: the learners finished training; stopping", s.actor_id)
                    break
                if feed.next_run is not None and feed.next_run.run_id != first.run_id:
                    log.warning("actor %d: the policy at %s now belongs to run %s (this actor served run "
                                "%s): switching to it", s.actor_id, s.policy_url,
                                feed.next_run.run_id or "(unnamed)", first.run_id or "(unnamed)")
                    break
                if feed.next_run is not None:
                    log.warning("actor %d: the learners of run %s changed settings (a resume with other "
                                "settings, e.g. another number of learners): taking them", s.actor_id,
                                first.run_id or "(unnamed)")
                    break
                if update is not None:
                    _warn_if_back(s.actor_id, version, update.version)
                    policy.load(update.weights)
                    version = int(update.version)
                    counters["policy_updates"] += 1
                obs, state, steps = play_step(policy, env, converter, obs, state,
                                              run_steps + played * s.num_actors)
                counters["env_steps"] += envs
                played += envs
                for step in steps:
                    shipper.add(step, version)
            shipper.flush()
        finally:
            shipper.close()
        return feed.next_run
    finally:
        env.close()


def check_rings_reach(actor_id: int, shards: Iterable[int], rings: Mapping[int, Any]) -> None:
    """The ``local`` rings handed to actor ``actor_id`` cover every shard it feeds.

    Raises:
        ConfigError: a shard whose ring lives in another process tree (fewer actors than
            learners under torchrun with the local transport).
    """
    missing = set(shards) - set(rings)
    if missing:
        raise ConfigError(f"actor {actor_id} feeds shards {sorted(shards)}, but the local rings of shards "
                          f"{sorted(missing)} live in other processes: with fewer actors than learners "
                          "under torchrun use --transport file:///dir or redis://..., or --actors >= "
                          "--learners")


def one_compute_thread() -> None:
    """Run this process's numpy BLAS calls, and torch's where torch is loaded, on one
    thread (process-wide: call it in a process that runs an actor)."""
    # A machine runs many actors, each acting on a few observations: OpenBLAS's threads (one
    # per core) only spin (benchmarks/startup/RESULTS-actor.md). The loaded library is limited.
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # called, not entered: the limit stays


def play_step(policy: ActorPolicy, env: Any, converter: GymStepConverter, obs: np.ndarray, state: Any,
              run_steps: int) -> tuple[np.ndarray, Any, list[dict[str, Any]]]:
    """One vector-env step acted by ``policy`` from ``state``; returns the next
    observations, the next state and the completed steps of every stream, each with the
    fields ``policy.stored`` gives for the state it was acted from (R2D2's ``h``, ``c``)."""
    held = policy.stored(state)
    actions, state = policy.act(obs, state, run_steps)
    obs, reward, terminated, truncated, info = env.step(actions)
    steps = []
    for step, ids in converter.step(actions, obs, reward, terminated, truncated, info):
        # SAME_STEP envs: the LAST steps of the streams ``ids`` follow, acted from the new state
        extra = held if ids is None else {k: v[ids] for k, v in policy.stored(state).items()}
        steps.append({**step, **extra})
    # NEXT_STEP envs show an episode's final observation one step after its end: the
    # state restarts where the next observation is an episode's first, not at the end.
    return obs, policy.end_episodes(state, converter.next_step_types == StepType.FIRST), steps


def _warn_if_back(actor_id: int, held: int, new: int) -> None:
    """A newer learner life with fewer updates: the learner resumed from an older
    checkpoint. The actor follows it (it serves that learner); say so once."""
    (held_life, held_updates), (new_life, new_updates) = split_version(held), split_version(new)
    if new_life > held_life and new_updates < held_updates:
        log.warning("actor %d: the learner went back from policy version %s to %s (it resumed from an "
                    "older checkpoint); following it", actor_id, describe_version(held),
                    describe_version(new))


class _PolicyFeed:
    """The subscriber, polled from the loop and from a blocked send: a new policy is held
    for the loop; a 'finished' one sets the stop flag (no learner will take more); one of
    another run than ``run_id``, or of the same run with other agreed ``settings`` (a
    resume on another number of learners), is kept in ``next_run`` (the loop switches to
    it)."""

    def __init__(self, subscriber: Any, stop: threading.Event, run_id: str,
                 settings: dict[str, Any] | None = None) -> None:
        self._subscriber = subscriber
        self._stop = stop
        self._run_id = run_id
        self._settings = settings
        self._held: Any = None
        self.finished = False
        self.next_run: Any = None

    def refresh(self) -> None:
        """Poll once (nothing more once another run's policy came)."""
        if self.next_run is not None:
            return
        update = self._subscriber.poll()
        if update is not None and (update.run_id != self._run_id or self._changed(update)):
            self.next_run = update
        elif update is not None and FINISHED in update.weights:
            self.finished = True
            self._stop.set()
        elif update is not None:
            self._held = update

    def _changed(self, update: Any) -> bool:
        """The update carries other agreed settings than those served."""
        info = RunInfo.of(update)
        return self._settings is not None and info is not None and info.settings != self._settings

    def take(self) -> Any:
        """The newest policy not yet taken, or None."""
        self.refresh()
        update, self._held = self._held, None
        return update


def _first_policy(subscriber: Any, s: ActorSettings, stop: threading.Event) -> Any:
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


class Chunker:
    """Buffers one step per stream (``stream_ids``, ``[S]``) at a time and emits a
    :class:`Chunk` of ``actor_id`` every ``chunk_steps`` (``T``) steps, numbered from
    ``first_sequence`` (above any number this actor id used before: a restarted actor
    starts from a clock reading). ``select``: the steps added hold every env of the actor,
    keep rows ``stream_ids`` of them (one chunker per shard the actor feeds).
    """

    def __init__(self, actor_id: int, stream_ids: np.ndarray, chunk_steps: int,
                 first_sequence: int = 0, *, select: bool = False) -> None:
        self.actor_id = actor_id
        self.stream_ids = np.asarray(stream_ids, np.int64)
        self._select = select
        self.chunk_steps = chunk_steps
        self.sequence = first_sequence
        self._steps: list[dict[str, np.ndarray]] = []
        self._min_version: int | None = None

    def add(self, step: dict[str, Any], policy_version: int) -> Chunk | None:
        """Add one step of every stream; returns a full chunk when ``T`` steps are in."""
        self._steps.append({k: np.asarray(v)[self.stream_ids] if self._select else np.asarray(v)
                            for k, v in flatten(step).items()})
        self._min_version = policy_version if self._min_version is None else \
            min(self._min_version, policy_version)
        return self.flush() if len(self._steps) >= self.chunk_steps else None

    def flush(self) -> Chunk | None:
        """The steps gathered so far as a chunk (None when empty)."""
        if not self._steps:
            return None
        names = self._steps[0].keys()
        steps = {k: np.stack([s[k] for s in self._steps], axis=1) for k in names}
        steps["step_type"] = steps["step_type"].astype(np.uint8)
        if "discount" in steps:
            steps["discount"] = steps["discount"].astype(np.float32)
        chunk = Chunk(actor_id=self.actor_id, sequence=self.sequence,
                      policy_version=int(self._min_version or 0), stream_ids=self.stream_ids,
                      steps=steps, priorities=None)
        self.sequence += 1
        self._steps, self._min_version = [], None
        return chunk


class _DeliveryLog:
    """``ActorSettings.delivery_log``: one line per chunk the transport confirmed (a
    pipelining writer's lines wait until its ``in_flight`` drops below them: docs/semantics.md,
    "Delivery audit"). One ``write`` on an ``O_APPEND`` descriptor per line: a line is whole
    or absent after the actor is killed (not fsynced: a machine crash may lose the tail).
    """

    def __init__(self, path: str | None) -> None:
        self._waiting: dict[Any, deque[bytes]] = {}  # per writer, oldest first
        self._fd: int | None = None
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ConfigError(f"cannot open the delivery log {path}: {exc}; "
                                  "give a writable --delivery-log path") from exc

    def record(self, chunk: Chunk, writer: Any) -> None:
        """``chunk`` was sent through ``writer``: log it once ``writer`` confirms it."""
        if self._fd is not None:
            line = {"actor_id": chunk.actor_id, "sequence": chunk.sequence,
                    "steps": chunk.num_streams * chunk.num_steps}
            self._waiting.setdefault(writer, deque()).append((json.dumps(line) + "\n").encode())
            self.confirm(writer)

    def confirm(self, writer: Any) -> None:
        """Log the chunks sent through ``writer`` that it no longer has in flight."""
        lines = self._waiting.get(writer)
        keep = int(getattr(writer, "in_flight", 0))
        while self._fd is not None and lines and len(lines) > keep:
            os.write(self._fd, lines.popleft())
        if lines is not None and not lines:
            del self._waiting[writer]  # a writer of an earlier life is not kept

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Shipper:
    """An actor's outgoing side: a :class:`Chunker` per shard its streams feed (``groups``:
    :meth:`StreamLayout.groups`), the shards' writers, the send loop (retries, reconnects,
    back-pressure) and the delivery log (``delivery_log``: its path, None: none). ``stop``
    set: what cannot be sent now is given up; ``counters`` counts ``chunks`` and
    ``send_retries`` (a send that waited ``send_timeout_s`` for room is one); ``feed``: the
    policy feed polled between retries (None: the sender follows no policy).

    Raises:
        ConfigError: the delivery log cannot be opened.
    """

    def __init__(self, actor_id: int, groups: Mapping[int, np.ndarray], transports: Mapping[int, Transport],
                 chunk_steps: int, stop: threading.Event, counters: dict[str, int], *, send_timeout_s: float,
                 delivery_log: str | None = None, feed: _PolicyFeed | None = None) -> None:
        clock = time.time_ns() // 1000  # a new life's sequences exceed the last life's
        self.chunkers = {k: Chunker(actor_id, streams, chunk_steps, select=len(groups) > 1,
                                    first_sequence=(k << SHARD_SEQUENCE_SHIFT) + clock)
                         for k, streams in groups.items()}
        self.transports, self.stop, self.counters, self.feed = transports, stop, counters, feed
        self.send_timeout_s = send_timeout_s
        self.delivered = _DeliveryLog(delivery_log)
        self.writers = {k: t.writer() for k, t in transports.items()}

    def add(self, step: dict[str, Any], version: int) -> int:
        """Add one step of every stream (acted by policy ``version``); returns the chunks sent."""
        return sum(self._send(k, chunker.add(step, version)) for k, chunker in self.chunkers.items())

    def flush(self) -> None:
        """Send the partial chunks held."""
        for k, chunker in self.chunkers.items():
            self._send(k, chunker.flush())

    def close(self) -> None:
        """Close the writers (waiting for what is in flight) and the delivery log."""
        for writer in self.writers.values():
            writer.close()
            self.delivered.confirm(writer)
        self.delivered.close()

    def _send(self, k: int, chunk: Chunk | None) -> int:
        """Send ``chunk`` to shard ``k`` with retries, reopening the writer after a transport
        failure; given up when stopping or another run took over. Returns 1 for a chunk."""
        if chunk is None:
            return 0
        backoff = 0.1
        while True:
            writer = self.writers[k]
            try:
                # Stopping: a short wait, the learner (if still there) is draining for us.
                writer.send(chunk, timeout_s=min(self.send_timeout_s, 2.0) if self.stop.is_set()
                            else self.send_timeout_s)
                self.counters["chunks"] += 1
                self.delivered.record(chunk, writer)  # logged once the transport confirms it
                return 1
            except TransportTimeout:
                self.counters["send_retries"] += 1  # the learner is busy: back-pressure (or gone)
                self.delivered.confirm(writer)  # the wait read the replies of the chunks before
                if self.feed is not None:
                    self.feed.refresh()
            except TransportError as exc:
                self.counters["send_retries"] += 1
                full = storage_error(exc)
                if full is None:
                    log.warning("actor %d: send failed (%s); reconnecting in %.1f s", chunk.actor_id, exc,
                                backoff)
                else:  # a full spool: back off, the learner frees room as it reads (said once)
                    (log.debug if chunk.actor_id in _SAID_FULL else log.warning)(
                        "actor %d: %s; backing off until the learner frees room", chunk.actor_id, full)
                    _SAID_FULL.add(chunk.actor_id)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                writer.close()
                self.delivered.confirm(writer)
                self.writers[k] = self.transports[k].writer()
            if self.stop.is_set() or (self.feed is not None and self.feed.next_run is not None):
                return 1  # stopping: give up on a chunk the learner does not take now
