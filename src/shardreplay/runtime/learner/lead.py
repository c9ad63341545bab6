"""Rank 0's duties in a training run, none of them a collective: publishing the weights,
evaluating them (and keeping the best), the metrics rows and progress bar, the learning
curve and ``summary.json``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardreplay._io import atomic_write_bytes
from shardreplay.errors import ShardReplayError
from shardreplay.policy import open_publisher, open_subscriber
from shardreplay.policy.broadcast import FINISHED, RunInfo
from shardreplay.runtime.algos.base import Algorithm
from shardreplay.runtime.devices import Placement
from shardreplay.runtime.envs import EnvInfo, reward_threshold
from shardreplay.runtime.learner.metrics import MetricsRecorder, plot_learning_curve
from shardreplay.runtime.learner.state import Lineage, Progress, StorageGuard
from shardreplay.runtime.learner.sync import agreed_settings
from shardreplay.runtime.policy_file import best_return, evaluate, keep_if_best, policy_metadata
from shardreplay.runtime.settings import TrainSettings

log = logging.getLogger("shardreplay.learner")


class Lead:
    """What rank 0 does besides learning (see the module docstring), with the rank's
    state shared with its Learner. Every write goes through ``storage`` (a refused one is
    kept there, not raised); a ``resume`` takes the best evaluation so far from ``best/``.
    """

    def __init__(self, settings: TrainSettings, world: int, algo: Algorithm, env: EnvInfo, agent: Any,
                 placement: Placement, progress: Progress, storage: StorageGuard, lineage: Lineage,
                 resume: bool) -> None:
        self.s, self.world, self.algo, self.env, self.agent = settings, world, algo, env, agent
        self.device, self.progress, self.storage, self.lineage = placement.device, progress, storage, lineage
        self.run_dir = Path(settings.run.run_dir)
        # The mean return that solves the run (None: none does), and where it came from.
        self.target, self.target_from = settings.run.stop_target(reward_threshold(settings.run.source))
        if resume:
            progress.best_eval = max(progress.best_eval, best_return(self.run_dir))
        warn_if_taking_over(settings.transport.policy_url, lineage.identity.run_id)
        self.publisher = open_publisher(settings.transport.policy_url)
        self.metrics = MetricsRecorder(self.run_dir, settings.run.total_env_steps, settings.run.progress)
        self.recorded_at = time.monotonic()

    def publish(self, version: int, finished: bool = False) -> None:
        """Publish the agent's weights as ``version`` with the run description actors take
        their settings, channel and seed from; ``finished`` tells remote actors the run
        reached its end (not after a stop signal: a resumed run's actors should wait)."""
        state = {k: v.detach().cpu() for k, v in self.agent.module.state_dict().items()}
        if finished:
            state[FINISHED] = torch.ones(1)
        identity, s = self.lineage.identity, self.s
        meta = RunInfo(run_id=identity.run_id, life=identity.life,
                       env_steps=self.progress.counters["env_steps"], seed=s.run.seed,
                       transport=s.transport.url, settings=agreed_settings(s, self.world)).to_meta()
        with self.storage.writing():
            self.publisher.publish(version, state, meta=meta)

    def periodic_evaluation(self) -> None:
        """A quick evaluation; when it reaches the target or beats the best so far, a full
        one decides whether the run is solved and whether ``best/`` takes this network."""
        s = self.s
        episodes = min(s.run.quick_eval_episodes, s.run.eval_episodes)
        result = self.evaluate(episodes)
        reached = self.target is not None and result >= self.target
        if episodes < s.run.eval_episodes and (reached or result > self.progress.best_eval):
            result = self.evaluate(s.run.eval_episodes)
        if self.target is not None and result >= self.target:
            self.progress.solved = True  # the ranks stop a few updates later: keep what passed
            self.progress.solved_state = copy.deepcopy(self.agent.state_dict())

    def evaluate(self, episodes: int) -> float:
        """The greedy policy's mean return over ``episodes``; a full evaluation that beats
        the best so far writes ``best/policy.safetensors`` (atomically, with its evaluation
        and update)."""
        c, progress = self.progress.counters, self.progress
        returns = evaluate(self.algo.greedy(self.agent.module), self.s.run.source, episodes,
                           seed=10_000 + c["updates"], device=self.device)
        progress.last_eval = float(np.mean(returns))
        progress.evals += 1
        if len(returns) >= self.s.run.eval_episodes:  # best/ is chosen on full evaluations only
            meta = policy_metadata(self.s, self.env, updates=c["updates"], env_steps=c["env_steps"],
                                   eval_episodes=len(returns), source="best evaluation",
                                   run_id=self.lineage.identity.run_id)
            with self.storage.writing():
                keep_if_best(self.run_dir, self.agent.module, meta, progress.last_eval, progress.best_eval)
            progress.best_eval = max(progress.best_eval, progress.last_eval)
        log.info("evaluation after %d updates: mean return %.1f over %d episodes",
                 c["updates"], progress.last_eval, len(returns))
        return progress.last_eval

    def record(self, recent_returns: np.ndarray, due: bool = True) -> None:
        """One metrics row over the progress's window (with the latest sync's buffer size
        and the mean of ``recent_returns``, each stream's last finished return) when
        ``due``, a second has passed since the last, or an evaluation came since (shown in
        the first row after it, only there)."""
        now = time.monotonic()
        p, window, g = self.progress, self.progress.window, self.progress.last_sync
        evaluated = p.evals > p.evals_recorded
        if not (due or evaluated or now - self.recorded_at >= 1.0):
            return
        c, dt = p.counters, max(now - window.t, 1e-9)
        recent = recent_returns[~np.isnan(recent_returns)]  # NaN: no episode finished yet
        row = {"wall_s": p.wall_s(), "env_steps": c["env_steps"], "updates": c["updates"],
               "replay_size": None if g is None else g.replay_size,
               "env_steps_per_s": window.steps / dt, "updates_per_s": window.updates / dt,
               "samples_per_insert": c["samples"] / max(c["env_steps"], 1),
               "policy_lag": window.lag_sum / window.lag_n if window.lag_n else None,
               "recent_return": float(recent.mean()) if recent.size else None,
               "eval_return": p.last_eval if evaluated else None, "loss": window.loss}
        with self.storage.writing():
            self.metrics.record(row, last_eval=p.last_eval)
        p.evals_recorded = p.evals
        self.recorded_at = now
        window.reset(now)

    def final(self, summary: dict[str, Any]) -> None:
        """Add the final evaluation and rank 0's view of the run's end to ``summary``, and
        write it as ``summary.json`` (the first time: the files that follow may fail)."""
        final = self.evaluate(self.s.run.eval_episodes)  # it may raise the best so far
        best = self.progress.best_eval
        summary.update(final_eval_return=final, best_eval_return=best if math.isfinite(best) else None,
                       solved=self.progress.solved, eval_episodes=self.s.run.eval_episodes,
                       stop_return=self.target, stop_return_from=self.target_from,
                       stopped_by=self._stopped_by(), run_dir=str(self.run_dir))
        self.write_summary(summary)

    def _stopped_by(self) -> str:
        """Why the run ended, from the agreed counts: solved, storage (a rank's file system
        refused a write), actors (every actor gave up), env_steps, time (some rank's clock
        passed ``--max-minutes``) or signal."""
        if self.progress.solved:
            return "solved"
        if self.storage.stop:
            return "storage"
        if self.progress.actors_gone:
            return "actors"
        if self.progress.counters["env_steps"] >= self.s.run.total_env_steps:
            return "env_steps"
        g = self.progress.last_sync
        return "time" if g is not None and g.time_votes else "signal"

    def close(self, summary: dict[str, Any], recent_returns: np.ndarray) -> None:
        """The run's last metrics row (after the final evaluation), the progress bar's end,
        the learning curve (``plot``) and ``summary.json`` with the curve named."""
        self.record(recent_returns)
        with self.storage.writing():
            self.metrics.close(summary["stopped_by"], summary["final_eval_return"])
        summary["learning_curve"] = None  # also when the file system refused the drawing
        if self.s.run.plot:
            with self.storage.writing():
                curve = plot_learning_curve(self.run_dir)  # None: no metrics to draw
                summary["learning_curve"] = None if curve is None else str(curve)
        self.write_summary(summary)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json``, with the refused write named when there was one."""
        if self.storage.error is not None:
            summary = {**summary, "storage_error": str(self.storage.error)}
        with self.storage.writing():
            atomic_write_bytes(self.run_dir / "summary.json", json.dumps(summary, indent=1).encode())


def warn_if_taking_over(policy_url: str, run_id: str) -> None:
    """Warn when ``policy_url`` holds another run's unfinished policy: its actors will
    switch to this run."""
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
