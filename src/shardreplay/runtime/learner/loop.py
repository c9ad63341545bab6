"""One learner rank of a training run: ingest, learn, publish, evaluate, checkpoint. All
ranks run the same loop in lock-step, deciding from one summed :class:`LoopSync` per
iteration over collectives of their own; rank 0's duties are its :class:`Lead`'s, saving,
resuming and the ingest log :class:`LearnerCheckpoints`'.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.checkpoint import checkpoint_dir, latest_complete, load_manifest
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.distributed.group import Collectives, lost_peer_error, peer_lost
from shardreplay.errors import ShardReplayError
from shardreplay.policy.broadcast import pack_version
from shardreplay.runtime.actor.loop import ActorSettings, actor_seed, check_rings_reach
from shardreplay.runtime.actor.processes import ActorPool
from shardreplay.runtime.algos import algorithm
from shardreplay.runtime.devices import place
from shardreplay.runtime.envs import describe_env
from shardreplay.runtime.learner.checkpoints import LearnerCheckpoints, commit_resume
from shardreplay.runtime.learner.ingest import Ingestor
from shardreplay.runtime.learner.lead import Lead
from shardreplay.runtime.learner.state import Lineage, MetricsWindow, Progress, StorageGuard
from shardreplay.runtime.learner.sync import (
    DRAIN_CHUNKS,
    MAX_UPDATES_PER_ITERATION,
    LoopSync,
    RunCounts,
    agreed_settings,
    learner_trigger,
    make_limiter,
    minutes_due,
)
from shardreplay.runtime.learner.wal import LossLog, archive_retention
from shardreplay.runtime.policy_file import LearnerRecord
from shardreplay.runtime.routing import foreign_backlog, settings_transport
from shardreplay.runtime.run_identity import RunIdentity, read_identity, upcoming_life
from shardreplay.runtime.settings import TrainSettings
from shardreplay.samplers.schedules import LinearSchedule
from shardreplay.spec import Field, Spec
from shardreplay.spec.fields import VERSION_FIELD
from shardreplay.transport.base import Transport
from shardreplay.transport.urls import parse_medium

log = logging.getLogger("shardreplay.learner")
_ACTOR_STOP_S = 10.0  # actors get this long to send what they hold and exit


class Learner:
    """This rank's shard, its algorithm's learning (:mod:`shardreplay.runtime.algos`), actors
    and bookkeeping (see the module docstring), for ``settings`` with ``run_dir`` and
    ``policy_url`` resolved. ``transport``: this shard's (None: opened from the URL);
    ``rings``: every shard's ``local`` ring, for actors that feed several shards (None: only
    this rank's). ``resume`` restores checkpoint ``checkpoint_id`` (None: the newest
    complete one; newer ones are set aside once every rank restored), with its replay
    unless ``replay`` is False (``--no-replay``: weights, optimizer and counters; no log
    replay either).
    """

    def __init__(self, settings: TrainSettings, transport: Transport | None = None,
                 resume: bool = False, *, rings: Sequence[Transport] | None = None,
                 checkpoint_id: int | None = None, replay: bool = True) -> None:
        self.s = settings
        self.replay_restored = replay  # False: the rate limiter fills the empty replay first
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # The learners' own collectives (the loop's sync, resume, log replay, summaries),
        # beside the buffer's: its exchanges and checkpoint loads keep theirs.
        self.comm = Collectives(None, settings.learners.collective_timeout_s)
        self.run_dir = Path(settings.run.run_dir)
        self.trigger = learner_trigger(settings, self.run_dir)  # signals, requests, periodic saves
        self.algo = algorithm(settings.learners.algo)
        env = describe_env(settings.run.source, self.algo.actions)
        spec = self.algo.transition_spec(env, settings.learners.hidden)
        placement = place(settings.learners.device, self.rank, self.world)
        stored = versioned(spec, self.run_dir / "checkpoints" if resume and replay else None, checkpoint_id)
        self.buffer = make_shard_buffer(settings, stored, self.rank, placement.device)
        self.agent = self.algo.make_agent(env, settings, self.world, placement)
        self.progress = Progress()
        self.storage = StorageGuard(self.rank)
        self.ckpts = LearnerCheckpoints(self.run_dir, self.rank, self.world, self.comm, self.storage,
                                        settings.checkpoints.keep_last)
        restored = "none"  # the id of the checkpoint restored (for loss reports)
        # A resumed life is recorded (run.json, config.json) only once every rank restored;
        # until then every rank takes the life that comes next from the files as they are.
        self.lineage = Lineage((upcoming_life(self.run_dir, settings.transport.run_id) if resume
                                else read_identity(self.run_dir)) or RunIdentity("", 0))
        if resume:
            restored = str(self.ckpts.resume(self.buffer, self.agent, self.progress, self.lineage,
                                             checkpoint_id, replay))
            if self.rank == 0:
                commit_resume(self.run_dir, self.lineage.identity, settings.stored(), restored=int(restored),
                              chosen=checkpoint_id is not None)
        source = settings.replay.prefill or settings.replay.offline
        # A resumed replay holds the dataset already.
        self.dataset_steps = self._prefill(source) if source and not (resume and replay) else 0
        self.losses = LossLog(self.run_dir, self.rank)
        run_id = self.lineage.identity.run_id
        self.foreign = foreign_backlog(settings.transport.url, self.rank, run_id)  # logged there
        transport = transport or settings_transport(settings, spec, self.rank, run_id=run_id)
        self.ingestor = Ingestor(transport.reader(), self.buffer, settings, self.lineage.stored,
                                 shard=self.rank, losses=self.losses)
        keep = settings.checkpoints  # --keep-rollouts: the log's segments become the archive
        retention = archive_retention(self.run_dir, spec, int(keep.keep_rollouts_max_gb * 1e9)) \
            if keep.keep_rollouts else None
        self.replayed = self.ckpts.open_log(
            self.ingestor, durable=parse_medium(settings.transport.url).kind != "local",
            resume_newest=checkpoint_id is None, restored=restored,
            policy_version=self.policy_version, retention=retention, replay=replay)
        self.lead = Lead(settings, self.world, self.algo, env, self.agent, placement, self.progress,
                         self.storage, self.lineage, resume) if self.rank == 0 else None
        # A local ring exists only in this process tree: its actors must get this very
        # object (under torchrun nobody passed one in); other media are opened by URL.
        local = parse_medium(settings.transport.url).kind == "local"
        actors = [] if settings.replay.offline else \
            actor_settings_of_shard(settings, self.rank, self.world, self.progress.counters["env_steps"])
        reach = dict(enumerate(rings)) if rings is not None else {self.rank: transport}
        if local:
            for a in actors:
                check_rings_reach(a.actor_id, settings.streams.groups(a.actor_id), reach)
        self.actors = ActorPool(actors, reach if local else None, settings.actors.max_restarts)

    @property
    def policy_version(self) -> int:
        """The published version of the current weights: (learner life, updates) packed."""
        return pack_version(self.lineage.identity.life, self.progress.counters["version"])

    def _prefill(self, source: str) -> int:
        """Deal the Minari dataset ``minari:ID`` into this rank's shard (every rank reads
        only its own episodes; no collective); returns the steps dealt here."""
        from shardreplay.offline import prefill

        report = prefill(self.buffer, source.removeprefix("minari:"))
        log.info("shard %d prefilled with %d episodes (%d steps) of Minari dataset %s", self.rank,
                 report["episodes"], report["steps"], source.removeprefix("minari:"))
        return int(report["steps"])

    # -- checkpoints (how: :class:`LearnerCheckpoints`) -----------------------------------
    def save(self, background: bool = False) -> Path:
        """Save a checkpoint (:meth:`LearnerCheckpoints.save`; a refused write is kept in
        :attr:`storage`) whose id is the update count, or one more than the last id saved
        or found: every rank derives it from the same agreed counters."""
        cid = max(self.progress.counters["updates"], self.ckpts.last_id + 1)
        # None, not -inf, before any evaluation: the record stays standard JSON.
        best = self.progress.best_eval if math.isfinite(self.progress.best_eval) else None
        record = LearnerRecord(dict(self.progress.counters), best, self.progress.wall_s(), self.s.to_dict(),
                               self.ingestor.state_dict())
        self.ingestor.report_lost()  # what the medium gave back by now was not lost
        agent = self.agent if self.rank == 0 else None  # rank 0 saves the agent's state
        return self.ckpts.save(cid, self.buffer, self.ingestor, record, agent, background=background)

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train until a stop condition; checkpoint; stop actors. Returns the summary."""
        self._publish()
        if not self.trigger.stop_requested:  # stopped while starting: the first sync ends the run, actorless
            self.actors.start()
        started = self.progress.started = time.monotonic()
        try:
            self._loop(started)
        except BaseException as exc:
            self._stop_actors()
            # Local only (after the one in flight): every rank keeps its part even when a peer is gone.
            self.save()
            self._close_reader()
            self.buffer.close()
            if peer_lost(exc):  # DDP's all-reduce in backward: gloo's raw text otherwise
                raise lost_peer_error(exc, f"training failed on rank {self.rank} of {self.world}") from exc
            raise
        self._stop_actors()
        # What the actors sent while stopping is in the shards: count it (all ranks agree).
        self._sync_counted(started)
        if self.progress.solved_state is not None:  # save, publish and evaluate the agent that passed
            self.agent.load_state_dict(self.progress.solved_state)
        path = self._agreed_save()
        self.buffer.close()  # its background thread and process group (pipeline)
        self._close_reader()  # after the save: queued acknowledgements go out (Redis)
        summary = self._summary(started, path)
        if self.lead is not None:
            if not self.storage.stop and summary["stopped_by"] in ("solved", "env_steps", "time"):
                # Not saved in the counters: a resumed run publishes from its saved version again.
                self.lead.publish(self.policy_version + 1, finished=True)
            self.lead.close(summary, self.ingestor.last_return)  # the final evaluation is the last row
        # What the run could not write: the launcher and the command's last line say it
        # (a rank that only agreed to stop says so: under torchrun it reports alone).
        summary["storage_error"] = None if self.storage.error is None else str(self.storage.error)
        summary["storage_stop"] = self.storage.stop or self.storage.error is not None
        return summary

    def _agreed_save(self, background: bool = False) -> Path:
        """A save every rank makes at the same point: queued priority updates (prefetch >
        1 or pipeline) reach their owners first, so the checkpoint holds them."""
        if self.s.replay.prefetch > 1 or self.s.replay.pipeline:
            self.buffer.flush_updates()
        return self.save(background)

    def _close_reader(self) -> None:
        try:
            self.ingestor.close()
        except ShardReplayError as exc:  # unsent acknowledgements: the stored record drops what comes again
            log.warning("rank %d: closing the transport reader failed: %s", self.rank, exc)

    def _stop_actors(self) -> None:
        """Stop this rank's actors, draining meanwhile so their last chunks land here."""
        def drain() -> None:
            try:
                self._drain(0.05)
            except ShardReplayError as exc:  # a broken transport must not block the stop
                log.warning("rank %d: draining while actors stop failed: %s", self.rank, exc)
                time.sleep(0.05)

        self.actors.stop(timeout_s=_ACTOR_STOP_S, while_waiting=drain)

    def _loop(self, started: float) -> None:
        limiter = make_limiter(self.s, self.world)
        c = self.progress.counters
        if self.replay_restored:  # --no-replay: this life fills its empty replay first, as a new run
            limiter.inserts, limiter.samples = c["env_steps"], c["samples"]
        per_update = self.s.learners.batch_size * self.world
        offline = bool(self.s.replay.offline)  # the replay holds all there is: no actors, no limit
        drain_steps = DRAIN_CHUNKS * self.s.actors.chunk_steps * self.s.actors.envs_per_actor
        window = self.progress.window = MetricsWindow()
        while True:
            # Not draining while the learner is behind is the back-pressure actors feel.
            if not offline and limiter.can_insert(min(drain_steps * self.world, limiter.max_insert_size)):
                wait = 0.0 if limiter.can_sample(per_update) else 0.02
                self._drain(wait)
            g = self._sync_counted(started)
            if g.steps > 0:
                limiter.insert(min(g.steps, limiter.max_insert_size))
            self.progress.actors_gone = g.actors_gone(self.s.actors.remote)
            if g.should_stop or self.progress.actors_gone:
                break
            self.ckpts.finish(wait=False)
            if g.should_save or self.trigger.periodic_due(self.progress.counters["updates"]):
                self._agreed_save(background=True)  # training goes on while it is written
            for _ in range(MAX_UPDATES_PER_ITERATION):
                if not offline and not limiter.can_sample(per_update):
                    break
                window.loss = self._update()
                if not offline:
                    limiter.sample(per_update)
                window.updates += 1
            self.ckpts.trim(self.ingestor.wal)
            if self.lead is not None:  # a row a second, and one right after each evaluation
                self.lead.record(self.ingestor.last_return, due=False)

    def _drain(self, wait_s: float) -> None:
        """Take chunks in. A refused log write leaves them stored but unacknowledged
        (the medium gives them again to the next life; the checkpoint's record drops
        those it holds): nothing is lost, and the rank votes to stop."""
        with self.storage.writing():
            self.ingestor.drain(DRAIN_CHUNKS, wait_s, self.policy_version)

    def _sync_counted(self, started: float) -> LoopSync:
        """:meth:`_sync`, with its steps and policy lag counted into the run and the
        current metrics window (so the final row holds what arrived after the last one)."""
        g = self._sync(started)
        self.progress.counters["env_steps"] += g.steps
        self.progress.window.count(g)
        return g

    def _sync(self, started: float) -> LoopSync:
        st = self.ingestor.take_stats()
        refused = self.storage.error is not None
        spent = self.progress.counters["env_steps"] >= self.s.run.total_env_steps
        stop = self.trigger.stop_requested or spent or self.progress.solved or refused
        late = time.monotonic() - started >= self.s.run.max_minutes * 60
        # Periodic by time: rank 0's clock decides, the vote makes every rank save together.
        # A log holding a shard's capacity of steps asks for one too (which trims it).
        due = self.rank == 0 and minutes_due(self.s.checkpoints.interval_minutes, self.ckpts.saved_at,
                                             time.monotonic())
        request = self.trigger.request_pending() or self.ingestor.log_full() or due
        live = self.actors.check()  # restarts those that died (within the bound)
        # The ingestor sums whole version differences, so its float lag sum is an integer.
        mine = LoopSync(steps=st.steps, replay_size=len(self.buffer.local), stop_votes=int(stop),
                        save_votes=int(request), lag_sum=int(st.lag_sum), lag_count=st.lag_count,
                        storage_votes=int(refused), time_votes=int(late), live_actors=live,
                        actors_given_up=len(self.actors.given_up))
        g = mine.summed(self.comm)
        self.progress.last_sync = g
        self.storage.stop = self.storage.stop or g.storage_votes > 0
        if g.should_save:  # every rank clears its flag; rank 0 removes the request file
            with self.storage.writing():
                self.trigger.request_served(remove_file=self.rank == 0)
        return g

    def _update(self) -> float:
        batch = self.buffer.sample(self.s.learners.batch_size)
        priorities, loss = self.agent.learn(batch)
        self.buffer.update_priorities(batch.keys, priorities)
        self.progress.counters["updates"] += 1
        self.progress.counters["samples"] += self.s.learners.batch_size * self.world
        u = self.progress.counters["updates"]
        if u % self.s.learners.publish_interval_updates == 0:
            self.progress.counters["version"] = u
            self._publish()
        if self.lead is not None and u % self.s.run.eval_interval_updates == 0:
            self.lead.periodic_evaluation()
        return loss

    def _publish(self) -> None:
        if self.lead is not None:
            self.lead.publish(self.policy_version)

    def _summary(self, started: float, checkpoint_path: Path) -> dict[str, Any]:
        ing, got = self.ingestor, self.ingestor.reader.stats
        # Once every rank saved (this all-reduce), the final checkpoint is complete: the
        # log segments it holds go now, not at the next life's first checkpoint.
        self.comm.all_reduce_sum(torch.zeros(1, dtype=torch.int64), "saved")
        self.ckpts.trim(ing.wal, force=True)
        counts = RunCounts(actor_restarts=sum(self.actors.restarts.values()),
                           actors_given_up=len(self.actors.given_up),
                           chunks_rejected=got.total_rejected + ing.total_rejected,
                           chunks_duplicate=got.duplicates + ing.total_duplicates,
                           foreign_chunks_ignored=sum(self.foreign.values()),
                           ingest_log_replayed=self.replayed.stored,
                           ingest_log_rerouted=self.replayed.rerouted,
                           ingest_log_torn=self.replayed.torn + self.replayed.damaged,
                           ingest_log_peak_bytes=0 if ing.wal is None else ing.wal.peak_bytes,
                           ingest_log_bytes=0 if ing.wal is None else ing.wal.size_bytes,
                           rollouts_dropped_segments=0 if ing.wal is None else ing.wal.dropped_segments,
                           dataset_steps=self.dataset_steps).summed(self.comm).as_dict()
        summary: dict[str, Any] = {"rank": self.rank, **self.progress.counters,
                                   "wall_s": round(time.monotonic() - started, 1),
                                   "checkpoint": str(checkpoint_path), **counts,
                                   "resumed_from": self.lineage.resumed,
                                   "run_id": self.lineage.identity.run_id,
                                   "learner_life": self.lineage.identity.life,
                                   "policy_version": self.policy_version,
                                   "offline": self.s.replay.offline or None}
        if self.lead is not None:
            self.lead.final(summary)
        return summary


def versioned(spec: Spec, resumed: Path | None = None, checkpoint_id: int | None = None) -> Spec:
    """The spec a training run's shards store: ``spec`` and the int64 field
    :data:`~shardreplay.spec.fields.VERSION_FIELD` (the policy version of the chunk that
    brought each step, as the ingest writes it); ``spec`` alone when ``resumed`` (the
    checkpoints a resume restores replay from) holds checkpoint ``checkpoint_id`` (None:
    the newest complete one) saved without it."""
    if resumed is not None and checkpoint_id is None:
        checkpoint_id = latest_complete(resumed, hashes=False)
    with contextlib.suppress(ShardReplayError):  # a damaged checkpoint: the resume says so
        if resumed is not None and checkpoint_id is not None and \
                VERSION_FIELD not in load_manifest(checkpoint_dir(resumed, checkpoint_id)).spec:
            return spec
    return Spec({**spec.fields, VERSION_FIELD: Field((), np.int64)})


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

