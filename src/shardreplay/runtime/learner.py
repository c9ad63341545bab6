"""One learner rank of a training run: ingest, learn, publish, evaluate, checkpoint.

All ranks run the same loop in lock-step. Every decision that leads into a collective
(learn now? how many updates? stop? save?) is taken from counters summed over ranks by
one all-reduce per iteration, so all ranks issue the same collectives in the same order
(LESSONS.md 12). Rank 0 publishes weights, evaluates and records metrics.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardreplay import checkpoint
from shardreplay.buffer.rate_limiter import RateLimiter
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.checkpoint.manifest import checkpoint_dir
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import CheckpointError, IncompleteCheckpointError, ShardReplayError
from shardreplay.policy import open_publisher, open_subscriber
from shardreplay.policy.broadcast import pack_version
from shardreplay.runtime.actor import AGREED, FINISHED, ActorSettings, RunInfo, actor_seed
from shardreplay.runtime.dqn import DoubleDqn, DqnSettings
from shardreplay.runtime.envs import env_spaces, transition_spec
from shardreplay.runtime.evaluate import evaluate
from shardreplay.runtime.ingest import Ingestor
from shardreplay.runtime.journal import IngestJournal, LossLog, read_old_journals
from shardreplay.runtime.metrics import MetricsRecorder, plot_learning_curve
from shardreplay.runtime.processes import ActorPool
from shardreplay.runtime.qnet import QNetwork
from shardreplay.runtime.routing import (
    chunk_bytes,
    foreign_backlog,
    scheme_of,
    shard_for_actor,
    shard_transport,
)
from shardreplay.runtime.run_identity import RunIdentity, read_identity
from shardreplay.runtime.settings import TrainSettings
from shardreplay.runtime.stored_ids import StoredIds, merge_stored
from shardreplay.samplers.schedules import LinearSchedule
from shardreplay.transport.base import Transport

log = logging.getLogger("shardreplay.learner")
LEARNER_STATE = "learner_state.pt"
# Counters summed over ranks each iteration (positions in the all-reduced vector).
_STEPS, _REPLAY, _STOP, _SAVE, _RET_SUM, _RET_N, _LAG_SUM, _LAG_N, _REJECTED = range(9)
_DRAIN_CHUNKS = 16  # chunks one rank takes in per iteration at most
_MAX_UPDATES_PER_ITERATION = 8
_ACTOR_STOP_S = 10.0  # actors get this long to send what they hold and exit


class _Flags:
    """Signal flags: SIGTERM/SIGINT ask to stop, SIGUSR1 asks for a checkpoint."""

    def __init__(self) -> None:
        self.stop = False
        self.save = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGUSR1, self._save)

    def _stop(self, *_args: Any) -> None:
        self.stop = True

    def _save(self, *_args: Any) -> None:
        self.save = True


class Learner:
    """This rank's shard, Q-learning, actors and bookkeeping (see the module docstring).

    Args:
        settings: the run's settings (``run_dir`` and ``policy_url`` resolved).
        transport: this shard's transport object (``local`` rings made by the launcher)
            or None to open it from the URL.
        resume: restore the newest complete checkpoint of ``run_dir`` first.
    """

    def __init__(self, settings: TrainSettings, transport: Transport | None = None,
                 resume: bool = False) -> None:
        self.s = settings
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.run_dir = Path(settings.run.run_dir)
        self.flags = _Flags()
        self.flags.install()
        obs_size, self.num_actions = env_spaces(settings.run.env_id)
        self.spec = transition_spec(obs_size)
        self.buffer = self._make_buffer()
        net = QNetwork(obs_size, self.num_actions, settings.learners.hidden)
        if self.world > 1:
            net = DistributedDataParallel(net)
        self.agent = DoubleDqn(net, DqnSettings(gamma=settings.learners.gamma, lr=settings.learners.lr,
                                                target_update_interval=settings.learners.target_update_interval))
        self.counters = {"env_steps": 0, "updates": 0, "version": 0, "samples": 0}
        self.best_eval = -math.inf
        self.last_eval: float | None = None
        self._evals = 0  # evaluations so far; a metrics row shows an evaluation once
        self._evals_recorded = 0
        self._window = _fresh_window()  # the metrics row being gathered
        self.wall_offset_s = 0.0  # wall time of earlier lives: a resumed run's time axis goes on
        self._started = time.monotonic()
        self.solved = False
        self._solved_state: dict[str, Any] | None = None  # rank 0: the agent that passed
        self._saved_at = -1
        self._last_checkpoint = -1  # ids only grow: a save never meets a complete one
        self.resumed: dict[str, Any] | None = None
        self._stored = StoredIds()  # restored: chunks already in the checkpoint
        self._restored: dict[str, int] | None = None  # this shard's restore, for every save
        restored = "none"
        if resume:
            restored = self._resume()
        # Before this life opens its journal: the chunks earlier lives acknowledged that
        # the checkpoint lacks (rank 0 also takes the shards that no longer exist).
        self._old_journals = read_old_journals(
            self.run_dir / "ingest", lambda k: k == self.rank or (self.rank == 0 and k >= self.world),
            self._stored, restored)
        self.losses = LossLog(self.run_dir, self.rank)
        # prepare_run_dir wrote it before the ranks met (a run dir of an older version
        # has none: its channels keep their unnamed names).
        self.identity = read_identity(self.run_dir) or RunIdentity("", 0)
        self.foreign = self._foreign_backlog()
        self.transport = transport or shard_transport(
            settings.transport.url, self.spec, self.rank, run_id=self.identity.run_id,
            queued_chunks_per_actor=settings.actors.queued_chunks_per_actor,
            actors=settings.actors_of_shard(self.rank),
            chunk_size_bytes=chunk_bytes(self.spec, settings.actors.envs_per_actor,
                                         settings.actors.chunk_steps))
        self.ingestor = Ingestor(self.transport.reader(), self.buffer.local, settings, self._stored,
                                 shard=self.rank, journal=IngestJournal(self.run_dir / "ingest", self.rank),
                                 losses=self.losses, suspects=self._old_journals,
                                 write_lock=self.buffer.write_lock)
        if self.rank == 0:
            self._warn_if_taking_over()
        self.publisher = open_publisher(settings.transport.policy_url) if self.rank == 0 else None
        self._last_sync: np.ndarray | None = None
        self.metrics = MetricsRecorder(self.run_dir, settings.run.total_env_steps, settings.run.progress) \
            if self.rank == 0 else None
        # A local ring exists only in this process tree: its actors must get this very
        # object (under torchrun nobody passed one in); other media are opened by URL.
        local = scheme_of(settings.transport.url) == "local"
        self.actors = ActorPool(self._actor_settings(), self.transport if local else None,
                                settings.actors.max_restarts)

    def _make_buffer(self) -> ShardedReplayBuffer:
        s, r = self.s, self.s.replay
        streams = s.streams_of_shard(self.rank)
        capacity = max(r.capacity // streams, s.window)
        local = ReplayBuffer(self.spec, num_streams=streams, stream_capacity=capacity, window=s.window,
                             sampler="prioritized", alpha=r.alpha,
                             beta=LinearSchedule(r.beta_start, r.beta_end, r.beta_updates),
                             seed=s.run.seed * 1000 + self.rank)
        return ShardedReplayBuffer(local, timeout_s=s.learners.collective_timeout_s, prefetch=r.prefetch,
                                   pipeline=r.pipeline, mode=r.sample_mode)

    def _actor_settings(self) -> list[ActorSettings]:
        s = self.s
        mine = [a for a in range(s.actors.count) if shard_for_actor(a, self.world) == self.rank]
        agreed = self._agreed_settings()
        return [ActorSettings(actor_id=a, transport=s.transport.url, policy_url=s.transport.policy_url,
                              hidden=s.learners.hidden,
                              seed=actor_seed(s.run.seed, a, self.counters["env_steps"]), **agreed,
                              delivery_log=(str(Path(s.actors.delivery_log_dir) / f"actor-{a}.jsonl")
                                            if s.actors.delivery_log_dir else None))
                for a in mine]

    def _agreed_settings(self) -> dict[str, Any]:
        return agreed_settings(self.s, self.world)

    def _foreign_backlog(self) -> dict[str, int]:
        """Chunks other runs left for this shard on the medium (never read): logged once."""
        if scheme_of(self.s.transport.url) == "local":
            return {}
        try:
            found = foreign_backlog(self.s.transport.url, self.rank, self.identity.run_id)
        except ShardReplayError as exc:
            log.warning("rank %d: could not look for other runs' chunks: %s", self.rank, exc)
            return {}
        if found:
            log.warning("rank %d: %d chunk(s) of other runs wait on %s (%s); this run (%s) ignores them: "
                        "delete them when those runs are over", self.rank, sum(found.values()),
                        self.s.transport.url, ", ".join(f"{k}: {v}" for k, v in sorted(found.items())),
                        self.identity.run_id or "unnamed")
        return found

    def _warn_if_taking_over(self) -> None:
        """Say so when the policy URL holds another run's policy that did not finish: its
        actors will switch to this run (two runs must not share a policy URL)."""
        subscriber = open_subscriber(self.s.transport.policy_url, check_interval_s=0)
        try:
            current = subscriber.poll()
        except ShardReplayError as exc:
            log.warning("could not read the policy at %s: %s", self.s.transport.policy_url, exc)
            return
        finally:
            subscriber.close()
        if current is not None and current.run_id != self.identity.run_id and FINISHED not in current.weights:
            log.warning("the policy at %s belongs to run %s, which has not finished: this run (%s) takes "
                        "it over and that run's actors will switch to this one. Give concurrent runs "
                        "their own --policy-url", self.s.transport.policy_url, current.run_id or "(unnamed)",
                        self.identity.run_id)

    @property
    def policy_version(self) -> int:
        """The published version of the current weights: (learner life, updates) packed."""
        return pack_version(self.identity.life, self.counters["version"])

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def _ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def _resume(self) -> str:
        """Restore the newest complete checkpoint; returns its id (for loss reports)."""
        report = checkpoint.load(self._ckpt_root, self.buffer, fallback=True)
        state = torch.load(report.directory / LEARNER_STATE, weights_only=True)
        self.agent.load_state_dict(state["agent"])
        self.counters.update({k: int(v) for k, v in report.extra["counters"].items()})
        best = report.extra.get("best_eval")
        self.best_eval = -math.inf if best is None else float(best)
        self.wall_offset_s = float(report.extra.get("wall_s") or 0.0)
        parts = checkpoint.read_manifest(report.directory)["parts"]
        self._stored = merge_stored(p.get("extra", {}).get("ingest") for p in parts)
        # Every rank lists the same directory before anyone saves again, so all agree.
        self._last_checkpoint = max(checkpoint.list_checkpoints(self._ckpt_root), default=-1)
        self._restored = report.counts()
        mine = [report.steps, report.dropped_episodes, report.dropped_steps, report.sealed_episodes,
                report.sealed_steps]
        total = self.buffer.collectives.all_reduce_sum(torch.tensor(mine, dtype=torch.float64),
                                                       "resume steps")
        steps, dropped_eps, dropped_steps, sealed_eps, sealed_steps = (int(x) for x in total.tolist())
        if steps + dropped_steps != report.saved_steps:
            # The loader accounts for every saved step; anything else is a bug that must
            # not be saved over the checkpoint it came from.
            raise CheckpointError(f"resume from {report.directory}: {steps} steps restored and "
                                  f"{dropped_steps} dropped, but the checkpoint holds "
                                  f"{report.saved_steps}; not continuing")
        self.resumed = {"checkpoint": report.directory.name, "checkpoint_id": report.checkpoint_id,
                        "saved_shards": report.saved_shards, "shards": self.world,
                        "saved_steps": report.saved_steps, "steps": steps,
                        "dropped_episodes": dropped_eps, "dropped_steps": dropped_steps,
                        "sealed_episodes": sealed_eps, "sealed_steps": sealed_steps,
                        "skipped": report.skipped}
        if self.rank == 0:
            log.log(logging.WARNING if dropped_steps else logging.INFO,
                    "resumed from %s (%d shard(s) -> %d): %d of its %d steps restored; dropped %d "
                    "episodes (%d steps) beyond the new capacity, sealed %d episodes (%d steps) cut to "
                    "fit a row; counters %s", report.directory.name, report.saved_shards, self.world,
                    steps, report.saved_steps, dropped_eps, dropped_steps, sealed_eps, sealed_steps,
                    self.counters)
        return str(report.checkpoint_id)

    def save(self) -> Path:
        """Save a checkpoint: rank 0 writes the learner state first, every rank its part
        (no collective, so it also works from a stopping or failing rank).

        The id is the update count, or one more than the last id this run saved or
        found, when no update happened since (stopping during warm-up, or right after
        a resume): every rank derives it from the same agreed counters.
        """
        cid = max(self.counters["updates"], self._last_checkpoint + 1)
        self._last_checkpoint = cid
        directory = checkpoint_dir(self._ckpt_root, cid)
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{LEARNER_STATE}.tmp"
            torch.save({"agent": self.agent.state_dict()}, tmp)
            tmp.replace(directory / LEARNER_STATE)
        # None, not -inf, before any evaluation: the manifest stays standard JSON.
        best = self.best_eval if math.isfinite(self.best_eval) else None
        extra = {"counters": dict(self.counters), "best_eval": best, "wall_s": self._wall_s(),
                 "settings": self.s.to_dict(), "ingest": self.ingestor.state_dict()}
        if self._old_journals.files:  # what the medium gave back by now was not lost
            self.losses.report_lost(self._old_journals)
        path = checkpoint.save(self.buffer, self._ckpt_root, cid, extra=extra, restored=self._restored)
        if self.ingestor.journal is not None:
            self.ingestor.journal.rotate(cid, checkpoint.latest_complete(self._ckpt_root))
        return path

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train until a stop condition; checkpoint; stop actors. Returns the summary."""
        self._publish()
        self.actors.start()
        started = self._started = time.monotonic()
        try:
            self._loop(started)
        except BaseException:
            self._stop_actors()
            self.save()  # local only: every rank keeps its part even when a peer is gone
            self._close_reader()
            self.buffer.close()
            raise
        self._stop_actors()
        # What the actors sent while stopping is in the shards: count it (all ranks agree).
        self._sync_counted(started)
        if self._solved_state is not None:  # save, publish and evaluate the agent that passed
            self.agent.load_state_dict(self._solved_state)
        path = self._agreed_save()
        self.buffer.close()  # its background thread and process group (pipeline)
        self._close_reader()  # after the save: queued acknowledgements go out (Redis)
        summary = self._summary(started, path)
        if self.publisher is not None and (self._budget_reached(started) or self._solved()):
            self._publish_finished()
        if self.metrics is not None:  # the final evaluation is the run's last row
            self._record(self._last_sync, self._window)
            self.metrics.close(summary["stopped_by"], summary["final_eval_return"])
            summary["learning_curve"] = str(plot_learning_curve(self.run_dir))
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _wall_s(self) -> float:
        """Wall time of the run over all its lives (a resumed run goes on from its checkpoint's)."""
        return round(self.wall_offset_s + time.monotonic() - self._started, 2)

    def _stop_reason(self, started: float) -> str:
        """Why the run ended (rank 0's view): solved, env_steps, time or signal."""
        if self.solved:
            return "solved"
        if self.counters["env_steps"] >= self.s.run.total_env_steps:
            return "env_steps"
        return "time" if time.monotonic() - started >= self.s.run.max_minutes * 60 else "signal"

    def _agreed_save(self) -> Path:
        """A save every rank makes at the same point: queued priority updates (prefetch >
        1 or pipeline) reach their owners first, so the checkpoint holds them."""
        if self.s.replay.prefetch > 1 or self.s.replay.pipeline:
            self.buffer.flush_updates()
        return self.save()

    def _close_reader(self) -> None:
        try:
            self.ingestor.close()
        except ShardReplayError as exc:  # unsent acknowledgements: the stored record drops what comes again
            log.warning("rank %d: closing the transport reader failed: %s", self.rank, exc)

    def _stop_actors(self) -> None:
        """Stop this rank's actors, draining meanwhile so their last chunks land here."""
        def drain() -> None:
            try:
                self.ingestor.drain(_DRAIN_CHUNKS, 0.05, self.policy_version)
            except ShardReplayError as exc:  # a broken transport must not block the stop
                log.warning("rank %d: draining while actors stop failed: %s", self.rank, exc)
                time.sleep(0.05)

        self.actors.stop(timeout_s=_ACTOR_STOP_S, while_waiting=drain)

    def _make_limiter(self) -> RateLimiter:
        limiter = make_limiter(self.s, self.world)
        limiter.inserts = self.counters["env_steps"]
        limiter.samples = self.counters["samples"]
        return limiter

    def _loop(self, started: float) -> None:
        limiter = self._make_limiter()
        per_update = self.s.learners.batch_size * self.world
        drain_steps = _DRAIN_CHUNKS * self.s.actors.chunk_steps * self.s.actors.envs_per_actor
        last_metrics = time.monotonic()
        window = self._window = _fresh_window()
        while True:
            # Not draining while the learner is behind is the back-pressure actors feel.
            if limiter.can_insert(min(drain_steps * self.world, limiter.max_insert_size)):
                wait = 0.0 if limiter.can_sample(per_update) else 0.02
                self.ingestor.drain(_DRAIN_CHUNKS, wait, self.policy_version)
            g = self._sync_counted(started)
            if g[_STEPS] > 0:
                limiter.insert(int(min(g[_STEPS], limiter.max_insert_size)))
            if g[_STOP] > 0:
                break
            if g[_SAVE] > 0 or self._periodic_save():
                self._agreed_save()
            for _ in range(_MAX_UPDATES_PER_ITERATION):
                if not limiter.can_sample(per_update):
                    break
                window["loss"] = self._update()
                limiter.sample(per_update)
                window["updates"] += 1
            self.actors.check()
            # A row a second, and one right after each evaluation (its point on the curve).
            evaluated = self._evals > self._evals_recorded
            if self.rank == 0 and (evaluated or time.monotonic() - last_metrics >= 1.0):
                self._record(g, window)
                last_metrics = time.monotonic()

    def _sync_counted(self, started: float) -> np.ndarray:
        """:meth:`_sync`, with its steps and policy lag counted into the run and the
        current metrics window (so the final row holds what arrived after the last one)."""
        g = self._sync(started)
        self.counters["env_steps"] += int(g[_STEPS])
        self._window["steps"] += int(g[_STEPS])
        self._window["lag_sum"] += g[_LAG_SUM]
        self._window["lag_n"] += g[_LAG_N]
        return g

    def _periodic_save(self) -> bool:
        k, u = self.s.checkpoints.interval_updates, self.counters["updates"]
        if k > 0 and u > 0 and u % k == 0 and self._saved_at != u:
            self._saved_at = u
            return True
        return False

    def _sync(self, started: float) -> np.ndarray:
        st = self.ingestor.take_stats()
        stop = self.flags.stop or self._budget_reached(started) or self._solved()
        request = self.flags.save or (self.run_dir / "checkpoint.request").exists()
        self.flags.save = False
        local = torch.tensor([st.steps, len(self.buffer.local), float(stop), float(request),
                              sum(st.returns), len(st.returns), st.lag_sum, st.lag_count, st.rejected],
                             dtype=torch.float64)
        g = self.buffer.collectives.all_reduce_sum(local, "train loop sync").cpu().numpy()
        self._last_sync = g
        if g[_SAVE] > 0 and self.rank == 0:
            (self.run_dir / "checkpoint.request").unlink(missing_ok=True)
        return g

    def _budget_reached(self, started: float) -> bool:
        return (self.counters["env_steps"] >= self.s.run.total_env_steps
                or time.monotonic() - started >= self.s.run.max_minutes * 60)

    def _solved(self) -> bool:
        return self.solved

    def _update(self) -> float:
        batch = self.buffer.sample(self.s.learners.batch_size)
        priorities, loss = self.agent.learn(batch)
        self.buffer.update_priorities(batch.keys, priorities)
        self.counters["updates"] += 1
        self.counters["samples"] += self.s.learners.batch_size * self.world
        u = self.counters["updates"]
        if u % self.s.learners.publish_interval_updates == 0:
            self.counters["version"] = u
            self._publish()
        if self.rank == 0 and u % self.s.run.eval_interval_updates == 0:
            self._periodic_evaluation()
        return loss

    def _periodic_evaluation(self) -> None:
        """A quick evaluation; when it reaches ``stop_return``, the full one decides."""
        s = self.s
        quick = self._evaluate(min(s.run.quick_eval_episodes, s.run.eval_episodes))
        if s.run.stop_return > 0 and quick >= s.run.stop_return:
            self.solved = self._evaluate(s.run.eval_episodes) >= s.run.stop_return
            if self.solved:  # the ranks stop a few updates later: keep what passed
                self._solved_state = copy.deepcopy(self.agent.state_dict())

    def _run_meta(self) -> dict[str, str]:
        """The run description published with the weights (actors take their settings,
        channel and seed from it)."""
        return RunInfo(run_id=self.identity.run_id, life=self.identity.life,
                       env_steps=self.counters["env_steps"], seed=self.s.run.seed,
                       transport=self.s.transport.url,
                       settings=self._agreed_settings()).to_meta()

    def _publish(self) -> None:
        if self.publisher is not None:
            state = {k: v.detach().cpu() for k, v in self.agent.module.state_dict().items()}
            self.publisher.publish(self.policy_version, state, meta=self._run_meta())

    def _publish_finished(self) -> None:
        """Tell remote actors that training reached its end (not after a stop signal: the
        run may be resumed, and its actors should wait for it)."""
        assert self.publisher is not None
        state = {k: v.detach().cpu() for k, v in self.agent.module.state_dict().items()}
        state[FINISHED] = torch.ones(1)
        # Not saved in the counters: a resumed run publishes from its saved version again.
        self.publisher.publish(self.policy_version + 1, state, meta=self._run_meta())

    def _evaluate(self, episodes: int | None = None) -> float:
        returns = evaluate(self.agent.module, self.s.run.env_id, episodes or self.s.run.eval_episodes,
                           seed=10_000 + self.counters["updates"])
        self.last_eval = float(np.mean(returns))
        self._evals += 1
        self.best_eval = max(self.best_eval, self.last_eval)
        log.info("evaluation after %d updates: mean return %.1f over %d episodes",
                 self.counters["updates"], self.last_eval, len(returns))
        return self.last_eval

    def _record(self, g: np.ndarray | None, window: dict[str, Any] | None) -> None:
        """One metrics row over ``window`` (rates, loss, policy lag; None: a row without
        them). An evaluation appears in the first row after it, only there; the final
        row comes after the final evaluation."""
        assert self.metrics is not None
        now = time.monotonic()
        w = window or {"steps": math.nan, "updates": math.nan, "t": now - 1.0, "loss": math.nan,
                       "lag_n": 0}
        dt = max(now - w["t"], 1e-9)
        recent = self.ingestor.last_return[~np.isnan(self.ingestor.last_return)]
        self.metrics.record({
            "wall_s": self._wall_s(), "env_steps": self.counters["env_steps"],
            "updates": self.counters["updates"], "replay_size": None if g is None else int(g[_REPLAY]),
            "env_steps_per_s": w["steps"] / dt, "updates_per_s": w["updates"] / dt,
            "samples_per_insert": self.counters["samples"] / max(self.counters["env_steps"], 1),
            "policy_lag": w["lag_sum"] / w["lag_n"] if w["lag_n"] else None,
            "recent_return": float(recent.mean()) if recent.size else None,
            "eval_return": self.last_eval if self._evals > self._evals_recorded else None,
            "loss": w["loss"]}, last_eval=self.last_eval)
        self._evals_recorded = self._evals
        if window is not None:
            window.update(steps=0, updates=0, t=now, lag_sum=0.0, lag_n=0.0)

    def _summary(self, started: float, checkpoint_path: Path) -> dict[str, Any]:
        ing, got = self.ingestor, self.ingestor.reader.stats
        mine = torch.tensor([sum(self.actors.restarts.values()), len(self.actors.given_up),
                             got.total_rejected + ing.total_rejected, got.duplicates + ing.total_duplicates,
                             sum(self.foreign.values())], dtype=torch.float64)
        restarts, given_up, rejected, duplicates, foreign = \
            self.buffer.collectives.all_reduce_sum(mine, "summary").tolist()
        summary: dict[str, Any] = {"rank": self.rank, **self.counters,
                                   "wall_s": round(time.monotonic() - started, 1),
                                   "checkpoint": str(checkpoint_path),
                                   "actor_restarts": int(restarts), "actors_given_up": int(given_up),
                                   "chunks_rejected": int(rejected), "chunks_duplicate": int(duplicates),
                                   "resumed_from": self.resumed, "run_id": self.identity.run_id,
                                   "learner_life": self.identity.life,
                                   "policy_version": self.policy_version,
                                   "foreign_chunks_ignored": int(foreign)}
        if self.rank == 0:
            summary["final_eval_return"] = self._evaluate(self.s.run.eval_episodes)
            summary["best_eval_return"] = self.best_eval if math.isfinite(self.best_eval) else None
            summary["solved"] = self.solved
            summary["eval_episodes"] = self.s.run.eval_episodes
            summary["stop_return"] = self.s.run.stop_return
            summary["stopped_by"] = self._stop_reason(started)
            summary["run_dir"] = str(self.run_dir)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def agreed_settings(settings: TrainSettings, world: int) -> dict[str, Any]:
    """The settings every actor of a run on ``world`` learner ranks must share with them
    (:data:`shardreplay.runtime.actor.AGREED`), as the learners publish them."""
    a = settings.actors
    values = {"num_actors": settings.total_actors, "num_shards": world, "env_id": settings.run.env_id,
              "envs_per_actor": a.envs_per_actor, "chunk_steps": a.chunk_steps,
              "queued_chunks_per_actor": a.queued_chunks_per_actor, "epsilon_base": a.epsilon_base,
              "epsilon_exponent": a.epsilon_exponent, "epsilon_warmup_steps": a.epsilon_warmup_steps}
    if set(values) != set(AGREED):
        raise ShardReplayError(f"agreed settings {sorted(values)} differ from {sorted(AGREED)} (a bug)")
    return values


def make_limiter(settings: TrainSettings, world: int) -> RateLimiter:
    """The samples-per-insert limiter of a run on ``world`` learner ranks, over GLOBAL
    counts: every rank feeds it the same all-reduced numbers, so every rank takes the
    same decisions.

    One loop iteration inserts at most ``max_insert`` steps over all ranks: each rank
    drains at most ``_DRAIN_CHUNKS`` chunks of ``chunk_steps * envs_per_actor`` steps,
    and only ranks with actors receive any, so ``min(world, actors)`` ranks (bounded
    here by the number of actors, which keeps the figures of runs with fewer ranks than
    actors as they were). The window ``offset -+ slack`` is twice as wide as an insert
    batch plus a sample batch needs, on any number of ranks.

    Raises:
        ConfigError: settings the limiter rejects (a non-positive ratio).
    """
    s = settings
    per_update = s.learners.batch_size * world
    max_insert = _DRAIN_CHUNKS * s.actors.chunk_steps * s.actors.envs_per_actor * max(s.total_actors, 1)
    slack = 2 * (max_insert * s.replay.samples_per_insert + per_update)
    offset = s.replay.min_replay * s.replay.samples_per_insert
    return RateLimiter(s.replay.samples_per_insert, min_size_to_sample=s.replay.min_replay,
                       error_buffer=(offset - slack, offset + slack),
                       max_insert_size=max_insert, max_sample_size=per_update)


def settings_for_resume(run_dir: Path, overrides: dict[str, Any]) -> TrainSettings:
    """The settings a run was started with (``config.json``), with ``overrides`` applied.

    Raises:
        IncompleteCheckpointError: ``run_dir`` holds no config.
    """
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise IncompleteCheckpointError(f"{path}: missing; is {run_dir} a shardreplay run directory?")
    saved = TrainSettings.from_dict(json.loads(path.read_text()))
    return saved.updated({**overrides, "run_dir": str(run_dir)})


def _fresh_window() -> dict[str, Any]:
    """An empty metrics window: steps, updates, loss and policy lag since ``t``."""
    return {"steps": 0, "updates": 0, "t": time.monotonic(), "loss": math.nan, "lag_sum": 0.0, "lag_n": 0.0}
