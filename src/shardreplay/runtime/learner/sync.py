"""What the learner ranks agree on: the per-iteration :class:`LoopSync` (summed by one
all-reduce; every decision that leads into a collective is taken from it, so all ranks
issue the same collectives in the same order), the summary's :class:`RunCounts`, the
checkpoint trigger, the :class:`RateLimiter` over global counts and the settings actors
share.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from shardreplay import _signals
from shardreplay.checkpoint.triggers import CheckpointTrigger
from shardreplay.distributed.group import Collectives
from shardreplay.errors import ConfigError, ShardReplayError
from shardreplay.runtime.actor.loop import AGREED
from shardreplay.runtime.settings import TrainSettings

DRAIN_CHUNKS = 16  # chunks one rank takes in per iteration at most
MAX_UPDATES_PER_ITERATION = 8


class SummedRecord:
    """A dataclass of integer fields that travels as one int64 vector (exact at any size)
    and is summed over ranks field by field."""

    what: ClassVar[str] = "record"  # names it in errors and as the collective's operation

    def to_tensor(self) -> torch.Tensor:
        """The fields in declaration order, as an int64 tensor of shape ``[fields]``."""
        return torch.tensor([getattr(self, f.name) for f in dataclasses.fields(self)],  # type: ignore[arg-type]
                            dtype=torch.int64)

    @classmethod
    def from_tensor(cls: type[_R], tensor: torch.Tensor) -> _R:
        """Inverse of :meth:`to_tensor`.

        Raises:
            ShardReplayError: ``tensor`` is not an int64 vector of this record's length
                (ranks of different versions, a bug).
        """
        width = len(dataclasses.fields(cls))  # type: ignore[arg-type]
        if tensor.dtype != torch.int64 or tuple(tensor.shape) != (width,):
            raise ShardReplayError(f"a {cls.what} is an int64 vector of {width}, got {tensor.dtype} "
                                   f"{tuple(tensor.shape)}: do all ranks run the same shardreplay?")
        return cls(*(int(v) for v in tensor.tolist()))

    def summed(self: _R, collectives: Collectives) -> _R:
        """This record summed over all ranks (a collective: every rank calls it)."""
        return self.from_tensor(collectives.all_reduce_sum(self.to_tensor(), self.what).cpu())


_R = TypeVar("_R", bound=SummedRecord)


@dataclass(frozen=True)
class LoopSync(SummedRecord):
    """One rank's counts for an iteration of the loop; summed over ranks, the run's.

    Attributes:
        steps: env steps written into the shard since the last sync.
        replay_size: windows the shard can sample (summed: the whole buffer's).
        stop_votes: ranks asking to stop (a signal, the step budget, a solved evaluation).
        save_votes: ranks asking for a checkpoint (SIGUSR1 or ``checkpoint.request``).
        lag_sum: policy lag (updates behind) summed over the chunks taken in.
        lag_count: chunks that ``lag_sum`` covers.
        storage_votes: ranks whose file system refused a write (full disk, read-only):
            they also vote to stop, and the run ends saying so.
        time_votes: ranks whose clock passed ``--max-minutes`` (the ranks' loops start a
            little apart: the first one ends the run, and the run says it ended on time).
        live_actors: actor processes of the rank running (or just restarted).
        actors_given_up: the rank's actors not restarted again (too many restarts).
    """

    steps: int = 0
    replay_size: int = 0
    stop_votes: int = 0
    save_votes: int = 0
    lag_sum: int = 0
    lag_count: int = 0
    storage_votes: int = 0
    time_votes: int = 0
    live_actors: int = 0
    actors_given_up: int = 0
    what: ClassVar[str] = "train loop sync"

    @property
    def should_stop(self) -> bool:
        """Whether some rank asked to stop or ran out of time."""
        return self.stop_votes > 0 or self.time_votes > 0

    @property
    def should_save(self) -> bool:
        """Whether some rank asked for a checkpoint."""
        return self.save_votes > 0

    def actors_gone(self, remote: int) -> bool:
        """Whether every actor the learners started gave up and none will send again:
        ``remote`` actors started elsewhere are not watched here (the run waits for them)."""
        return self.live_actors == 0 and self.actors_given_up > 0 and remote == 0


@dataclass(frozen=True)
class RunCounts(SummedRecord):
    """Run-wide counts for the summary, summed over ranks (what each counts:
    docs/train.md, "What a run leaves")."""

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
    dataset_steps: int = 0
    what: ClassVar[str] = "summary"

    def as_dict(self) -> dict[str, int]:
        """The counts under their summary names."""
        return dataclasses.asdict(self)


def learner_trigger(settings: TrainSettings, run_dir: Path) -> CheckpointTrigger:
    """The checkpoint trigger of one learner rank, its signal handlers installed: SIGTERM /
    SIGINT (also repeated) ask to stop, SIGUSR1 or ``<run_dir>/checkpoint.request`` for a
    checkpoint (agreed in the loop's :class:`LoopSync`), and one is due every
    ``checkpoints.interval_updates`` updates (0: only at the end). A stop signal taken
    while the process was starting (:func:`shardreplay._signals.take_over`) is not lost.

    Raises:
        ConfigError: not called from the main thread (Python's rule for handlers).
    """
    trigger = CheckpointTrigger(run_dir / "checkpoints", request_dir=run_dir,
                                interval_steps=settings.checkpoints.interval_updates or None)
    trigger.install_signal_handlers(repeat_interrupt=False)
    if _signals.requested() is not None:  # after the handlers: none falls between
        trigger.request_stop()
    return trigger


def minutes_due(interval_minutes: float, saved_at: float, now: float) -> bool:
    """Whether a periodic checkpoint is due by time: ``interval_minutes`` (0: never)
    passed since the last save at ``saved_at`` (``time.monotonic()`` seconds)."""
    return interval_minutes > 0 and now - saved_at >= interval_minutes * 60


def agreed_settings(settings: TrainSettings, world: int) -> dict[str, Any]:
    """The settings every actor of a run on ``world`` learner ranks must share with them
    (:data:`shardreplay.runtime.actor.loop.AGREED`: flat setting names, and the numbers of
    actors and shards), as the learners publish them."""
    flat = settings.to_flat()
    return {name: flat[name] for name in AGREED if name in flat} | {"num_actors": settings.total_actors,
                                                                   "num_shards": world}


def make_limiter(settings: TrainSettings, world: int) -> RateLimiter:
    """The samples-per-insert limiter of a run on ``world`` learner ranks (its window:
    docs/train.md, "The replay ratio"; ``DRAIN_CHUNKS`` chunks per actor at most per insert).

    Raises:
        ConfigError: settings the limiter rejects (a non-positive ratio).
    """
    s = settings
    per_update = s.learners.batch_size * world
    max_insert = DRAIN_CHUNKS * s.actors.chunk_steps * s.actors.envs_per_actor * max(s.total_actors, 1)
    slack = 2 * (max_insert * s.replay.samples_per_insert + per_update)
    offset = s.replay.min_replay * s.replay.samples_per_insert
    return RateLimiter(s.replay.samples_per_insert, min_size_to_sample=s.replay.min_replay,
                       error_buffer=(offset - slack, offset + slack),
                       max_insert_size=max_insert, max_sample_size=per_update)


def _positive_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class RateLimiter:
    """A samples-per-insert rate limiter (Reverb's ``SampleToInsertRatio``), as plain
    counters: it keeps items sampled per item inserted near ``samples_per_insert`` once
    ``min_size_to_sample`` items were inserted, ``diff = inserted * samples_per_insert -
    sampled`` within ``error_buffer``: a number ``e`` (``offset -+ e``, ``offset =
    min_size_to_sample * samples_per_insert``) or ``(min_diff, max_diff)``. The rule, an
    example and the settings refused as able to deadlock: docs/train.md, "The replay
    ratio". ``max_insert_size`` / ``max_sample_size``: the largest ``n`` / ``m`` ever
    passed to :meth:`can_insert` and :meth:`insert` / :meth:`can_sample` and :meth:`sample`.

    Raises:
        ConfigError: a non-positive ratio or size, or a configuration that can deadlock.
    """

    def __init__(self, samples_per_insert: float, *, min_size_to_sample: int,
                 error_buffer: float | tuple[float, float], max_insert_size: int = 1,
                 max_sample_size: int = 1) -> None:
        if isinstance(samples_per_insert, bool) or not isinstance(samples_per_insert, int | float) \
                or not math.isfinite(samples_per_insert) or samples_per_insert <= 0:
            raise ConfigError(f"samples_per_insert must be a finite number > 0, got {samples_per_insert!r}")
        self.samples_per_insert = float(samples_per_insert)
        self.min_size_to_sample = _positive_int("min_size_to_sample", min_size_to_sample, 1)
        self.max_insert_size = _positive_int("max_insert_size", max_insert_size, 1)
        self.max_sample_size = _positive_int("max_sample_size", max_sample_size, 1)
        self.min_diff, self.max_diff = self._window(error_buffer)
        self._check_no_deadlock()
        self.inserts = 0
        self.samples = 0

    def _window(self, error_buffer: float | tuple[float, float]) -> tuple[float, float]:
        if isinstance(error_buffer, tuple) and len(error_buffer) == 2:
            lo, hi = (float(x) for x in error_buffer)
        elif isinstance(error_buffer, int | float) and not isinstance(error_buffer, bool) \
                and error_buffer >= 0:
            offset = self.min_size_to_sample * self.samples_per_insert
            lo, hi = offset - float(error_buffer), offset + float(error_buffer)
        else:
            raise ConfigError(f"error_buffer must be a number >= 0 or a (min_diff, max_diff) pair, "
                              f"got {error_buffer!r}")
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            raise ConfigError(f"error_buffer gives an empty or infinite window [{lo}, {hi}]")
        return lo, hi

    def _check_no_deadlock(self) -> None:
        spi, n, m = self.samples_per_insert, self.max_insert_size, self.max_sample_size
        need = n * spi + m
        if self.max_diff - self.min_diff < need:
            raise ConfigError(
                f"error_buffer window [{self.min_diff}, {self.max_diff}] is narrower than "
                f"max_insert_size * samples_per_insert + max_sample_size = {need}: inserts and "
                "samples could both block forever; widen error_buffer")
        overshoot = (self.min_size_to_sample - 1 + n) * spi
        if n > 1 and overshoot > self.max_diff:
            raise ConfigError(
                f"a batch of {n} inserts just before min_size_to_sample={self.min_size_to_sample} "
                f"would need diff {overshoot} > max_diff {self.max_diff} while sampling is not yet "
                "allowed: raise max_diff or lower max_insert_size")

    @property
    def diff(self) -> float:
        """``inserts * samples_per_insert - samples``."""
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, n: int = 1) -> bool:
        """True when inserting ``n`` items keeps the ratio within bounds.

        Raises:
            ConfigError: ``n`` outside ``1..max_insert_size``.
        """
        self._check_size("insert", n, self.max_insert_size)
        if self.inserts + n <= self.min_size_to_sample:
            return True
        return (self.inserts + n) * self.samples_per_insert - self.samples <= self.max_diff

    def can_sample(self, n: int = 1) -> bool:
        """True when sampling ``n`` items keeps the ratio within bounds.

        Raises:
            ConfigError: ``n`` outside ``1..max_sample_size``.
        """
        self._check_size("sample", n, self.max_sample_size)
        if self.inserts < self.min_size_to_sample:
            return False
        return self.diff - n >= self.min_diff

    def insert(self, n: int = 1) -> None:
        """Record ``n`` inserted items (whether or not :meth:`can_insert` allowed them).

        Raises:
            ConfigError: ``n`` outside ``1..max_insert_size``.
        """
        self._check_size("insert", n, self.max_insert_size)
        self.inserts += n

    def sample(self, n: int = 1) -> None:
        """Record ``n`` sampled items.

        Raises:
            ConfigError: ``n`` outside ``1..max_sample_size``.
        """
        self._check_size("sample", n, self.max_sample_size)
        self.samples += n

    @staticmethod
    def _check_size(what: str, n: Any, limit: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
            raise ConfigError(f"{what} size must be an integer in 1..{limit} (max_{what}_size), got {n!r}")

    def __repr__(self) -> str:
        return (f"RateLimiter(samples_per_insert={self.samples_per_insert}, min_size_to_sample="
                f"{self.min_size_to_sample}, window=[{self.min_diff}, {self.max_diff}], "
                f"inserts={self.inserts}, samples={self.samples})")
