"""The parts a learner rank's state is kept in: :class:`Progress` (with its
:class:`MetricsWindow`), :class:`Lineage` and :class:`StorageGuard`."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shardreplay._io import storage_error
from shardreplay.errors import ShardReplayError, StorageError
from shardreplay.runtime.learner.ingest import StoredIds
from shardreplay.runtime.learner.sync import LoopSync
from shardreplay.runtime.run_identity import RunIdentity

log = logging.getLogger("shardreplay.learner")
COUNTERS = ("env_steps", "updates", "version", "samples")  # a run's, saved in its checkpoints


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


@dataclass
class Progress:
    """What the run did so far, as this rank counts it (agreed counts where it matters).

    Attributes:
        counters: env steps, updates, the published version and samples (saved in checkpoints).
        best_eval: the best mean evaluation return of the run (over its lives).
        last_eval: the latest mean evaluation return (None: none yet).
        evals: evaluations so far; a metrics row shows an evaluation once.
        evals_recorded: ``evals`` when the latest metrics row was written.
        solved: an evaluation reached ``stop_return``.
        solved_state: rank 0: the agent that passed (saved and published at the end).
        actors_gone: the run stopped because every actor gave up (:meth:`LoopSync.actors_gone`).
        wall_offset_s: wall time of earlier lives: a resumed run's time axis goes on.
        started: when this life's loop started (monotonic seconds).
        window: the metrics row being gathered.
        last_sync: the latest summed :class:`LoopSync`.
    """

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    best_eval: float = -math.inf
    last_eval: float | None = None
    evals: int = 0
    evals_recorded: int = 0
    solved: bool = False
    solved_state: dict[str, Any] | None = None
    actors_gone: bool = False
    wall_offset_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    window: MetricsWindow = field(default_factory=MetricsWindow)
    last_sync: LoopSync | None = None

    def wall_s(self) -> float:
        """Wall time of the run over all its lives (a resumed run goes on from its checkpoint's)."""
        return round(self.wall_offset_s + time.monotonic() - self.started, 2)


@dataclass
class Lineage:
    """Where this learner life comes from.

    Attributes:
        identity: the run id and this life's number.
        stored: chunks already in the restored checkpoint.
        resumed: the restore report (None: a fresh run).
    """

    identity: RunIdentity
    stored: StoredIds = field(default_factory=StoredIds)
    resumed: dict[str, Any] | None = None


class StorageGuard:
    """The first write the file system refused (full disk, read-only), kept instead of
    raised: the ranks agree to stop, write what they still can, and the run ends naming it.

    Attributes:
        error: the first refused write of this rank (None: none).
        stop: some rank's write was refused (agreed in the loop's sync).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.error: StorageError | None = None
        self.stop = False

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Run one of this rank's writes; one the file system refuses is kept in
        :attr:`error`, not raised (the rank votes to stop at the next sync).

        Raises:
            OSError, ShardReplayError: any error that is not a refused write.
        """
        try:
            yield
        except (OSError, ShardReplayError) as exc:
            refused = storage_error(exc)
            if refused is None:
                raise
            if self.error is None:
                self.error = refused
                log.debug("rank %d: %s", self.rank, refused)
