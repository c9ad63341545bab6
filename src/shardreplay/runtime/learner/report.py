"""What a learner run reports: the metrics window behind each row of ``metrics.csv``,
the row itself, and the run-wide counts of the final summary.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from shardreplay.runtime.learner.sync import LoopSync, SummedRecord


@dataclass
class MetricsWindow:
    """Steps, updates, the last loss and policy lag since ``t`` (a metrics row's span)."""

    steps: int = 0
    updates: int = 0
    t: float = field(default_factory=time.monotonic)
    loss: float = math.nan
    lag_sum: int = 0
    lag_n: int = 0

    def count(self, sync: LoopSync) -> None:
        """Add the run-wide steps and policy lag of one loop sync."""
        self.steps += sync.steps
        self.lag_sum += sync.lag_sum
        self.lag_n += sync.lag_count

    def reset(self, now: float) -> None:
        """Start the next window at ``now`` (the last loss stays until a new one)."""
        self.steps = self.updates = self.lag_sum = self.lag_n = 0
        self.t = now


def metrics_row(window: MetricsWindow | None, sync: LoopSync | None, *, now: float, wall_s: float,
                counters: dict[str, int], recent_returns: np.ndarray,
                eval_return: float | None) -> dict[str, Any]:
    """One row of ``metrics.csv`` over ``window`` (None: a row without rates, loss and
    lag), with the buffer size of ``sync`` (None: not known yet).

    ``recent_returns`` holds the last finished return of each stream (NaN: none yet).
    """
    if window is None:
        steps = updates = loss = math.nan
        dt, lag = 1.0, None
    else:
        steps, updates, loss = window.steps, window.updates, window.loss
        dt = max(now - window.t, 1e-9)
        lag = window.lag_sum / window.lag_n if window.lag_n else None
    recent = recent_returns[~np.isnan(recent_returns)]
    return {"wall_s": wall_s, "env_steps": counters["env_steps"], "updates": counters["updates"],
            "replay_size": None if sync is None else sync.replay_size,
            "env_steps_per_s": steps / dt, "updates_per_s": updates / dt,
            "samples_per_insert": counters["samples"] / max(counters["env_steps"], 1),
            "policy_lag": lag, "recent_return": float(recent.mean()) if recent.size else None,
            "eval_return": eval_return, "loss": loss}


@dataclass(frozen=True)
class RunCounts(SummedRecord):
    """Run-wide counts for the summary, summed over ranks.

    Attributes:
        actor_restarts: actor processes restarted after they died.
        actors_given_up: actors not restarted again (too many restarts).
        chunks_rejected: chunks refused (corrupt, outside the shard, ...).
        chunks_duplicate: chunks received again and dropped.
        foreign_chunks_ignored: chunks of other runs left on the medium.
        ingest_log_replayed: chunks this life replayed from the write-ahead logs.
        ingest_log_rerouted: of those, chunks of actors this life no longer runs (a
            resume with fewer actors), written to the streams of their stand-in.
        ingest_log_torn: torn or damaged log records ignored at the replay.
        ingest_log_peak_bytes: the logs' largest size over this life (summed over shards).
        ingest_log_bytes: the logs' size at the end (the chunks newer than the newest
            complete checkpoint, and sealed segments whose checkpoint other ranks were
            still finishing).
        rollouts_dropped_segments: rollouts archive segments deleted beyond
            ``--keep-rollouts-max-gb`` in this life.
    """

    actor_restarts: int = 0
    actors_given_up: int = 0
    chunks_rejected: int = 0
    chunks_duplicate: int = 0
    foreign_chunks_ignored: int = 0
    ingest_log_replayed: int = 0
    ingest_log_rerouted: int = 0
    ingest_log_torn: int = 0
    ingest_log_peak_bytes: int = 0
    ingest_log_bytes: int = 0
    rollouts_dropped_segments: int = 0
    what: ClassVar[str] = "summary"

    def as_dict(self) -> dict[str, int]:
        """The counts under their summary names."""
        return dataclasses.asdict(self)


def stop_reason(*, solved: bool, env_steps: int, total_env_steps: int, elapsed_s: float,
                max_minutes: float, storage: bool = False) -> str:
    """Why the run ended (rank 0's view): solved, env_steps, time, storage (a rank's
    file system refused a write) or signal."""
    if solved:
        return "solved"
    if storage:
        return "storage"
    if env_steps >= total_env_steps:
        return "env_steps"
    return "time" if elapsed_s >= max_minutes * 60 else "signal"
