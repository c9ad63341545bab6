"""One learner rank of a training run: ingest, learn, publish, evaluate, checkpoint.

All ranks run the same loop in lock-step. Every decision that leads into a collective
(learn now? how many updates? stop? save?) is taken from a :class:`LoopSync` summed over
ranks by one all-reduce per iteration, so all ranks issue the same collectives in the
same order (:mod:`shardreplay.runtime.learner.sync`). Rank 0 publishes weights, evaluates
and records metrics (:mod:`shardreplay.runtime.learner.report`). The learner decides when
to save and what its state is; saving, resuming and the ingest log's replay, sealing and
trimming are :class:`~shardreplay.runtime.learner.checkpoints.LearnerCheckpoints`'. The
ranks agree over collectives of their own (not the buffer's).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardreplay._io import atomic_write_bytes
from shardreplay.distributed.group import Collectives, lost_peer_error, peer_lost
from shardreplay.errors import ShardReplayError
from shardreplay.policy import open_publisher
from shardreplay.policy.broadcast import FINISHED, RunInfo, pack_version
from shardreplay.runtime.actor.processes import ActorPool
from shardreplay.runtime.algos import algorithm
from shardreplay.runtime.devices import place
from shardreplay.runtime.envs import describe_env, reward_threshold
from shardreplay.runtime.learner.checkpoints import LearnerCheckpoints
from shardreplay.runtime.learner.evaluate import evaluate
from shardreplay.runtime.learner.ingest import Ingestor
from shardreplay.runtime.learner.metrics import MetricsRecorder, plot_learning_curve
from shardreplay.runtime.learner.report import MetricsWindow, RunCounts, metrics_row, stop_reason
from shardreplay.runtime.learner.resume import commit_resume, learner_files
from shardreplay.runtime.learner.setup import (
    actor_settings_of_shard,
    check_rings_reach,
    log_foreign_backlog,
    make_shard_buffer,
    warn_if_taking_over,
)
from shardreplay.runtime.learner.state import Lineage, Progress, StorageGuard
from shardreplay.runtime.learner.sync import (
    DRAIN_CHUNKS,
    MAX_UPDATES_PER_ITERATION,
    LoopSync,
    agreed_settings,
    learner_trigger,
    make_limiter,
    minutes_due,
)
from shardreplay.runtime.learner.wal import ROLLOUTS_DIR, SPEC_FILE, LossLog, Retention
from shardreplay.runtime.policy_file import LearnerRecord, best_return, keep_if_best, policy_metadata
from shardreplay.runtime.routing import chunk_bytes, scheme_of, shard_transport
from shardreplay.runtime.run_identity import RunIdentity, read_identity, upcoming_life
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import Spec
from shardreplay.transport.base import Transport
from shardreplay.transport.packing import pack

log = logging.getLogger("shardreplay.learner")
_ACTOR_STOP_S = 10.0  # actors get this long to send what they hold and exit


class Learner:
    """This rank's shard, its algorithm's learning (:mod:`shardreplay.runtime.algos`), actors
    and bookkeeping (see the module docstring).

    Args:
        settings: the run's settings (``run_dir`` and ``policy_url`` resolved).
        transport: this shard's transport object (``local`` rings made by the launcher)
            or None to open it from the URL.
        rings: every shard's ``local`` ring (made by the launcher), for the actors this
            rank starts (one may feed several shards); None: only this rank's.
        checkpoint_id: with ``resume``, the checkpoint to continue from (None: the newest
            complete one); newer ones are set aside once every rank restored.
        resume: restore the newest complete checkpoint of ``run_dir`` first.
        replay: with ``resume``, restore the replay too (False, ``--no-replay``: weights,
            optimizer and counters only; the ingest logs are not replayed either).
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
        env = self.env = describe_env(settings.run.source, self.algo.actions)
        # The mean return that solves the run (None: none does), and where it came from.
        self.target, self.target_from = settings.run.stop_target(reward_threshold(settings.run.source))
        spec = self.algo.transition_spec(env, settings.learners.hidden)
        self.placement = place(settings.learners.device, self.rank, self.world)
        self.buffer = make_shard_buffer(settings, spec, self.rank, self.placement.device)
        self.agent = self.algo.make_agent(env, settings, self.world, self.placement)
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
            restored = self._resume(checkpoint_id, replay)
            if self.rank == 0:
                self.progress.best_eval = max(self.progress.best_eval, best_return(self.run_dir))
                commit_resume(self.run_dir, self.lineage.identity, settings.stored(),
                              newer_than=checkpoint_id)
        self.losses = LossLog(self.run_dir, self.rank)
        self.foreign = log_foreign_backlog(settings.transport.url, self.rank, self.lineage.identity.run_id)
        transport = transport or shard_transport(
            settings.transport.url, spec, self.rank, run_id=self.lineage.identity.run_id,
            queued_chunks_per_actor=settings.actors.queued_chunks_per_actor,
            actors=settings.actors_of_shard(self.rank),
            chunk_size_bytes=chunk_bytes(spec, settings.actors.envs_per_actor,
                                         settings.actors.chunk_steps))
        self.ingestor = Ingestor(transport.reader(), self.buffer, settings, self.lineage.stored,
                                 shard=self.rank, losses=self.losses)
        self.replayed, self.log_scan = self.ckpts.open_log(
            self.ingestor, durable=scheme_of(settings.transport.url) != "local",
            resume_newest=checkpoint_id is None, restored=restored, owns_actor=self._owns_actor,
            policy_version=self.policy_version, retention=_retention(settings, self.run_dir, spec),
            replay=replay)
        if self.rank == 0:
            warn_if_taking_over(settings.transport.policy_url, self.lineage.identity.run_id)
        self.publisher = open_publisher(settings.transport.policy_url) if self.rank == 0 else None
        self.metrics = MetricsRecorder(self.run_dir, settings.run.total_env_steps, settings.run.progress) \
            if self.rank == 0 else None
        # A local ring exists only in this process tree: its actors must get this very
        # object (under torchrun nobody passed one in); other media are opened by URL.
        local = scheme_of(settings.transport.url) == "local"
        actors = actor_settings_of_shard(settings, self.rank, self.world, self.progress.counters["env_steps"])
        reach = dict(enumerate(rings)) if rings is not None else {self.rank: transport}
        if local:
            check_rings_reach(settings, actors, reach)
        self.actors = ActorPool(actors, reach if local else None, settings.actors.max_restarts)

    def _owns_actor(self, actor_id: int) -> bool:
        """Whether this rank holds any of ``actor_id``'s streams in this life's routing
        (an actor it no longer runs: those of its stand-in, which take its logged chunks)."""
        route = self.s.streams.stand_in(actor_id)
        return route is not None and bool((self.s.streams.shards(route) == self.rank).any())

    @property
    def policy_version(self) -> int:
        """The published version of the current weights: (learner life, updates) packed."""
        return pack_version(self.lineage.identity.life, self.progress.counters["version"])

    # -- checkpoints (how: :class:`LearnerCheckpoints`) -----------------------------------
    def _resume(self, checkpoint_id: int | None, replay: bool) -> str:
        """Restore the newest complete checkpoint; returns its id (for loss reports)."""
        r = self.ckpts.resume(self.buffer, self.agent, checkpoint_id, replay)
        self.progress.counters.update(r.counters)
        self.progress.best_eval, self.progress.wall_offset_s = r.best_eval, r.wall_offset_s
        self.lineage.stored = r.stored
        self.lineage.resumed = r.report
        return str(r.checkpoint_id)

    def save(self, background: bool = False) -> Path:
        """Save a checkpoint (:meth:`LearnerCheckpoints.save`; a refused write is kept in
        :attr:`storage` and leaves the newest complete one as it was). Its id is the
        update count, or one more than the last id saved or found when no update happened
        since: every rank derives it from the same agreed counters.
        """
        cid = max(self.progress.counters["updates"], self.ckpts.last_id + 1)
        # None, not -inf, before any evaluation: the record stays standard JSON.
        best = self.progress.best_eval if math.isfinite(self.progress.best_eval) else None
        record = LearnerRecord(dict(self.progress.counters), best, self.progress.wall_s(), self.s.to_dict(),
                               self.ingestor.state_dict())
        # Every rank its record, rank 0 the agent too (written before its part, covered by the manifest).
        files = learner_files(record, self.rank, self.world, self.agent if self.rank == 0 else None)
        self.ingestor.report_lost()  # what the medium gave back by now was not lost
        return self.ckpts.save(cid, self.buffer, self.ingestor, background=background, files=files)

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
        if self.publisher is not None and not self.storage.stop and \
                (self._budget_reached(started) or self.progress.solved):
            self._publish_finished()
        if self.metrics is not None:  # the final evaluation is the run's last row
            self._record(self.progress.last_sync, self.progress.window)
            with self.storage.writing():
                self.metrics.close(summary["stopped_by"], summary["final_eval_return"])
            summary["learning_curve"] = None  # also when the file system refused the drawing
            if self.s.run.plot:
                with self.storage.writing():
                    curve = plot_learning_curve(self.run_dir)  # None: no metrics to draw
                    summary["learning_curve"] = None if curve is None else str(curve)
            self._write_summary(summary)
        # What the run could not write: the launcher and the command's last line say it
        # (a rank that only agreed to stop says so: under torchrun it reports alone).
        summary["storage_error"] = None if self.storage.error is None else str(self.storage.error)
        summary["storage_stop"] = self.storage.stop or self.storage.error is not None
        return summary

    def _write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json`` (rank 0), with the refused write named when there was one."""
        if self.storage.error is not None:
            summary = {**summary, "storage_error": str(self.storage.error)}
        with self.storage.writing():
            atomic_write_bytes(self.run_dir / "summary.json", json.dumps(summary, indent=1).encode())

    def _stop_reason(self, started: float) -> str:
        """Why the run ended (rank 0's view): solved, env_steps, time or signal."""
        return stop_reason(solved=self.progress.solved, env_steps=self.progress.counters["env_steps"],
                           total_env_steps=self.s.run.total_env_steps,
                           elapsed_s=time.monotonic() - started, max_minutes=self.s.run.max_minutes,
                           storage=self.storage.stop)

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
        drain_steps = DRAIN_CHUNKS * self.s.actors.chunk_steps * self.s.actors.envs_per_actor
        last_metrics = time.monotonic()
        window = self.progress.window = MetricsWindow()
        while True:
            # Not draining while the learner is behind is the back-pressure actors feel.
            if limiter.can_insert(min(drain_steps * self.world, limiter.max_insert_size)):
                wait = 0.0 if limiter.can_sample(per_update) else 0.02
                self._drain(wait)
            g = self._sync_counted(started)
            if g.steps > 0:
                limiter.insert(min(g.steps, limiter.max_insert_size))
            if g.should_stop:
                break
            self.ckpts.finish(wait=False)
            if g.should_save or self.trigger.periodic_due(self.progress.counters["updates"]):
                self._agreed_save(background=True)  # training goes on while it is written
            for _ in range(MAX_UPDATES_PER_ITERATION):
                if not limiter.can_sample(per_update):
                    break
                window.loss = self._update()
                limiter.sample(per_update)
                window.updates += 1
            self.actors.check()
            self.ckpts.trim(self.ingestor.wal)
            # A row a second, and one right after each evaluation (its point on the curve).
            evaluated = self.progress.evals > self.progress.evals_recorded
            if self.rank == 0 and (evaluated or time.monotonic() - last_metrics >= 1.0):
                self._record(g, window)
                last_metrics = time.monotonic()

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
        stop = self.trigger.stop_requested or self._budget_reached(started) or self.progress.solved or refused
        # Periodic by time: rank 0's clock decides, the vote makes every rank save together.
        # A log holding a shard's capacity of steps asks for one too (which trims it).
        due = self.rank == 0 and minutes_due(self.s.checkpoints.interval_minutes, self.ckpts.saved_at,
                                             time.monotonic())
        request = self.trigger.request_pending() or self.ingestor.log_full() or due
        # The ingestor sums whole version differences, so its float lag sum is an integer.
        mine = LoopSync(steps=st.steps, replay_size=len(self.buffer.local), stop_votes=int(stop),
                        save_votes=int(request), lag_sum=int(st.lag_sum), lag_count=st.lag_count,
                        storage_votes=int(refused))
        g = mine.summed(self.comm)
        self.progress.last_sync = g
        self.storage.stop = self.storage.stop or g.storage_votes > 0
        if g.should_save:  # every rank clears its flag; rank 0 removes the request file
            with self.storage.writing():
                self.trigger.request_served(remove_file=self.rank == 0)
        return g

    def _budget_reached(self, started: float) -> bool:
        return (self.progress.counters["env_steps"] >= self.s.run.total_env_steps
                or time.monotonic() - started >= self.s.run.max_minutes * 60)

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
        if self.rank == 0 and u % self.s.run.eval_interval_updates == 0:
            self._periodic_evaluation()
        return loss

    def _periodic_evaluation(self) -> None:
        """A quick evaluation; when it reaches the target or beats the best so far, a full
        one decides (whether the run is solved, and whether ``best/`` takes this network:
        a few episodes' luck would otherwise make a network "best")."""
        s = self.s
        episodes = min(s.run.quick_eval_episodes, s.run.eval_episodes)
        result = self._evaluate(episodes)
        reached = self.target is not None and result >= self.target
        if episodes < s.run.eval_episodes and (reached or result > self.progress.best_eval):
            result = self._evaluate(s.run.eval_episodes)
        if self.target is not None and result >= self.target:
            self.progress.solved = True  # the ranks stop a few updates later: keep what passed
            self.progress.solved_state = copy.deepcopy(self.agent.state_dict())

    def _run_meta(self) -> dict[str, str]:
        """The run description published with the weights (actors take their settings,
        channel and seed from it)."""
        return RunInfo(run_id=self.lineage.identity.run_id, life=self.lineage.identity.life,
                       env_steps=self.progress.counters["env_steps"], seed=self.s.run.seed,
                       transport=self.s.transport.url,
                       settings=agreed_settings(self.s, self.world)).to_meta()

    def _publish(self) -> None:
        if self.publisher is not None:
            state = {k: v.detach().cpu() for k, v in self.agent.module.state_dict().items()}
            with self.storage.writing():
                self.publisher.publish(self.policy_version, state, meta=self._run_meta())

    def _publish_finished(self) -> None:
        """Tell remote actors that training reached its end (not after a stop signal: the
        run may be resumed, and its actors should wait for it)."""
        assert self.publisher is not None
        state = {k: v.detach().cpu() for k, v in self.agent.module.state_dict().items()}
        state[FINISHED] = torch.ones(1)
        # Not saved in the counters: a resumed run publishes from its saved version again.
        with self.storage.writing():
            self.publisher.publish(self.policy_version + 1, state, meta=self._run_meta())

    def _evaluate(self, episodes: int | None = None) -> float:
        returns = evaluate(self.algo.greedy(self.agent.module), self.s.run.source,
                           episodes or self.s.run.eval_episodes,
                           seed=10_000 + self.progress.counters["updates"], device=self.placement.device)
        self.progress.last_eval = float(np.mean(returns))
        self.progress.evals += 1
        if len(returns) >= self.s.run.eval_episodes:  # best/ is chosen on full evaluations only
            self._keep_best(self.progress.last_eval, len(returns))
            self.progress.best_eval = max(self.progress.best_eval, self.progress.last_eval)
        log.info("evaluation after %d updates: mean return %.1f over %d episodes",
                 self.progress.counters["updates"], self.progress.last_eval, len(returns))
        return self.progress.last_eval

    def _keep_best(self, eval_return: float, episodes: int) -> None:
        """``best/policy.safetensors``: the network of the evaluation just made when it
        beat the best so far, written atomically (rank 0), with its evaluation and update."""
        c = self.progress.counters
        meta = policy_metadata(self.s, self.env, updates=c["updates"],
                               env_steps=c["env_steps"], eval_episodes=episodes, source="best evaluation",
                               run_id=self.lineage.identity.run_id)
        with self.storage.writing():
            keep_if_best(self.run_dir, self.agent.module, meta, eval_return, self.progress.best_eval)

    def _record(self, g: LoopSync | None, window: MetricsWindow | None) -> None:
        """One metrics row over ``window`` (rates, loss, policy lag; None: a row without
        them). An evaluation appears in the first row after it, only there; the final
        row comes after the final evaluation."""
        assert self.metrics is not None
        now = time.monotonic()
        evaluated = self.progress.evals > self.progress.evals_recorded
        with self.storage.writing():
            self.metrics.record(metrics_row(window, g, now=now, wall_s=self.progress.wall_s(),
                                            counters=self.progress.counters,
                                            recent_returns=self.ingestor.last_return,
                                            eval_return=self.progress.last_eval if evaluated else None),
                                last_eval=self.progress.last_eval)
        self.progress.evals_recorded = self.progress.evals
        if window is not None:
            window.reset(now)

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
                           ingest_log_torn=len(self.log_scan.torn) + len(self.log_scan.damaged),
                           ingest_log_peak_bytes=0 if ing.wal is None else ing.wal.peak_bytes,
                           ingest_log_bytes=0 if ing.wal is None else ing.wal.size_bytes,
                           rollouts_dropped_segments=0 if ing.wal is None else ing.wal.dropped_segments,
                           ).summed(self.comm).as_dict()
        summary: dict[str, Any] = {"rank": self.rank, **self.progress.counters,
                                   "wall_s": round(time.monotonic() - started, 1),
                                   "checkpoint": str(checkpoint_path), **counts,
                                   "resumed_from": self.lineage.resumed,
                                   "run_id": self.lineage.identity.run_id,
                                   "learner_life": self.lineage.identity.life,
                                   "policy_version": self.policy_version}
        if self.rank == 0:
            summary["final_eval_return"] = self._evaluate(self.s.run.eval_episodes)
            best = self.progress.best_eval
            summary["best_eval_return"] = best if math.isfinite(best) else None
            summary["solved"] = self.progress.solved
            summary["eval_episodes"] = self.s.run.eval_episodes
            summary["stop_return"], summary["stop_return_from"] = self.target, self.target_from
            summary["stopped_by"] = self._stop_reason(started)
            summary["run_dir"] = str(self.run_dir)
            self._write_summary(summary)
        return summary


def _retention(settings: TrainSettings, run_dir: Path, spec: Spec) -> Retention | None:
    """``--keep-rollouts``: the ingest log keeps its segments in ``<run_dir>/rollouts``,
    chunks that came unpacked packed with LZ4 (None: not asked for)."""
    c = settings.checkpoints
    if not c.keep_rollouts:
        return None
    (run_dir / ROLLOUTS_DIR).mkdir(exist_ok=True)
    # Not sorted: a reader decodes the chunks with the fields in this order.
    atomic_write_bytes(run_dir / ROLLOUTS_DIR / SPEC_FILE, json.dumps(spec.to_dict()).encode())
    return Retention(run_dir / ROLLOUTS_DIR, int(c.keep_rollouts_max_gb * 1e9),
                     pack=functools.partial(pack, spec=spec, codec="lz4"))
