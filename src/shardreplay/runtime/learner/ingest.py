"""Draining a shard's transport into its buffer, with episode returns and policy lag
(:class:`Ingestor`), and the record of the chunks it stored (:class:`StoredIds`).
Delivery, order, exactly-once and the ingest log: docs/semantics.md, "Chunks across crashes".
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import (
    CheckpointFormatError,
    ConfigError,
    CorruptChunkError,
    IngestRejectedError,
    ShardReplayError,
    TransportError,
)
from shardreplay.kernels.returns import track_returns
from shardreplay.policy.broadcast import split_version
from shardreplay.runtime.learner.sync import SummedRecord
from shardreplay.runtime.learner.wal import IngestLog, LogRecord, LossLog, Suspects
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec.fields import VERSION_FIELD, StepType
from shardreplay.transport.base import ChunkReader
from shardreplay.transport.codec import Chunk, decode

log = logging.getLogger("shardreplay.learner")
_FIRST, _MID, _LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
# A "last written" sequence no chunk follows: the actor's next chunk starts new episodes.
_AFTER_ANOTHER = -(2**62)
DEFAULT_MAX_INTERVALS = 1024

__all__ = ["DEFAULT_MAX_INTERVALS", "IngestStats", "Ingestor", "ReplayCounts", "StoredIds",
           "merge_stored"]


class StoredIds:
    """Which chunks a shard stored: per actor, the sequences as sorted disjoint inclusive
    intervals (``stored 5 6 7 9 10`` -> ``[[5, 7], [9, 10]]``); a chunk is a duplicate only
    when its own ``(actor_id, sequence)`` was stored. Saved form: docs/semantics.md, "Chunks
    across crashes", Delivery.

    Args:
        max_intervals: intervals kept per actor; beyond it the two oldest are joined (a
            WARNING says how many sequences are presumed stored then).

    Raises:
        ConfigError: ``max_intervals`` below 1.
    """

    def __init__(self, max_intervals: int = DEFAULT_MAX_INTERVALS) -> None:
        if max_intervals < 1:
            raise ConfigError(f"max_intervals must be >= 1, got {max_intervals}")
        self.max_intervals = max_intervals
        # Per actor: the intervals' low ends and high ends, both sorted.
        self._lo: dict[int, list[int]] = {}
        self._hi: dict[int, list[int]] = {}

    def __contains__(self, identity: object) -> bool:
        """``(actor_id, sequence) in ids``: was that chunk stored."""
        if not isinstance(identity, tuple) or len(identity) != 2:
            return False
        actor, seq = identity
        lo = self._lo.get(actor)
        if not lo:
            return False
        i = bisect.bisect_right(lo, seq) - 1
        return i >= 0 and seq <= self._hi[actor][i]

    def add(self, actor_id: int, sequence: int) -> bool:
        """Record ``(actor_id, sequence)`` as stored; False when it was already."""
        hi = self._hi.get(actor_id)
        if hi and sequence == hi[-1] + 1:  # the common case: the next chunk in order
            hi[-1] = sequence
            return True
        if (actor_id, sequence) in self:
            return False
        self.add_interval(actor_id, sequence, sequence)
        return True

    def add_interval(self, actor_id: int, first: int, last: int) -> None:
        """Record every sequence in ``first .. last`` (inclusive) as stored."""
        if last < first:
            return
        lo = self._lo.setdefault(actor_id, [])
        hi = self._hi.setdefault(actor_id, [])
        # Intervals overlapping or touching [first, last] are absorbed into it.
        start = bisect.bisect_left(hi, first - 1)
        end = bisect.bisect_right(lo, last + 1)
        if start < end:
            first, last = min(first, lo[start]), max(last, hi[end - 1])
        lo[start:end] = [first]
        hi[start:end] = [last]
        self._bound(actor_id)

    def intervals(self) -> Iterator[tuple[int, int, int]]:
        """``(actor_id, first, last)`` of every interval, by actor then sequence."""
        for actor in sorted(self._lo):
            yield from ((actor, a, b) for a, b in zip(self._lo[actor], self._hi[actor], strict=True))

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"stored": {"<actor_id>": [[lo, hi], ...]}}``."""
        return {"stored": {str(a): [[x, y] for x, y in zip(self._lo[a], self._hi[a], strict=True)]
                           for a in sorted(self._lo) if self._lo[a]}}

    def load_state(self, state: Mapping[str, Any] | None) -> None:
        """Add what a saved part holds (:meth:`state_dict`'s form).

        Raises:
            CheckpointFormatError: the state is not of that shape.
        """
        state = state or {}
        try:
            for actor, pairs in (state.get("stored") or {}).items():
                for first, last in pairs:
                    self.add_interval(int(actor), int(first), int(last))
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointFormatError(f"malformed ingest state in a checkpoint part: {exc}; expected "
                                        '{"stored": {"<actor>": [[lo, hi], ...]}}') from exc

    def _bound(self, actor_id: int) -> None:
        lo, hi = self._lo[actor_id], self._hi[actor_id]
        while len(lo) > self.max_intervals:
            presumed = lo[1] - hi[0] - 1
            log.warning("actor %d: more than %d gaps in its stored chunks; the %d sequences between %d and "
                        "%d are presumed stored from now on (a chunk among them would be dropped as a "
                        "duplicate)", actor_id, self.max_intervals - 1, presumed, hi[0], lo[1])
            hi[0] = hi[1]
            del lo[1], hi[1]


def merge_stored(states: Iterable[Mapping[str, Any] | None],
                 max_intervals: int = DEFAULT_MAX_INTERVALS) -> StoredIds:
    """The union of the stored chunks over the saved parts of one checkpoint.

    Raises:
        CheckpointFormatError: a part's state is malformed.
    """
    merged = StoredIds(max_intervals)
    for state in states:
        merged.load_state(state)
    return merged


@dataclass
class IngestStats:
    """Counters since the last :meth:`Ingestor.take_stats`."""

    steps: int = 0
    chunks: int = 0
    rejected: int = 0
    duplicates: int = 0
    lag_sum: float = 0.0
    lag_count: int = 0
    returns: list[float] = field(default_factory=list)


@dataclass
class ReplayCounts(SummedRecord):
    """What :meth:`Ingestor.replay` did with the logged chunks it read (summed over the
    ranks for the replay's log line).

    Attributes:
        stored: chunks written into the shard (all or some of their streams).
        held: chunks the restored checkpoint (or this replay) holds already: skipped.
        foreign: chunks none of whose streams are this shard's now (another rank's).
        rejected: chunks that could not be written (recorded in the loss log).
        steps: steps written.
        rerouted: of ``stored``, chunks of actors this life no longer runs (a resume with
            fewer actors), written to the streams of their stand-in
            (:meth:`~shardreplay.runtime.stream_layout.StreamLayout.stand_in`).
        torn, damaged: log records ignored, torn at a file's end or damaged before it
            (set by the caller from its :class:`~shardreplay.runtime.learner.wal.LogScan`).
    """

    stored: int = 0
    held: int = 0
    foreign: int = 0
    rejected: int = 0
    steps: int = 0
    rerouted: int = 0
    torn: int = 0
    damaged: int = 0
    what: ClassVar[str] = "log replay"


class Ingestor:
    """Moves chunks from a reader into the local shard (an actor's streams into the rows
    ``settings.streams.rows(actor_id, streams)``), acknowledging them after. A chunk with
    streams of another shard, beyond ``envs_per_actor`` or outside the shard's rows is
    rejected and counted, never half-written; one in ``stored`` is dropped as a duplicate;
    one out of order starts headless episodes (docs/semantics.md, Order).

    Args:
        buffer: the buffer it writes to: this shard's ``ReplayBuffer``, or the rank's
            ``ShardedReplayBuffer`` (it writes into the local shard under the buffer's
            lock: a pipelined buffer's background thread draws from the shard meanwhile).
        stored: the chunks already in ``buffer`` (restored from a checkpoint with
            :func:`merge_stored`); None for none.
        losses: where rejected chunks, entries the medium lost and, at the first
            checkpoint, the suspects still missing are recorded (:class:`LossLog`); None
            only logs and counts them.
        wal: the shard's ingest log: stored chunks (or their headers) are appended to it
            before they are acknowledged; None keeps none.
    """

    def __init__(self, reader: ChunkReader, buffer: ReplayBuffer | ShardedReplayBuffer,
                 settings: TrainSettings, stored: StoredIds | None = None, *, shard: int = 0,
                 losses: LossLog | None = None, wal: IngestLog | None = None) -> None:
        self.reader = reader
        self._sink = buffer  # writes go through it (a sharded buffer takes its lock)
        self.buffer = buffer.local if isinstance(buffer, ShardedReplayBuffer) else buffer
        self.settings = settings
        self._streams = settings.streams  # the routing, built once (used per chunk)
        self.shard = shard
        self.stored = stored if stored is not None else StoredIds()
        self.losses = losses
        self.suspects = Suspects()
        self.wal = wal
        self._last_written: dict[int, int] = {}  # per actor: the sequence this life wrote last
        self._unacked: list[Chunk] = []
        self.total_rejected = 0  # over the ingestor's life (``stats`` are per window)
        self.total_duplicates = 0
        self._warned: set[tuple[int, str]] = set()
        self._running = np.zeros(self.buffer.num_streams, np.float64)
        self.stats = IngestStats()
        # The last finished episode of each stream: a recent mean over all streams that
        # near-random streams (short episodes, many of them) can not dominate.
        self.last_return = np.full(self.buffer.num_streams, np.nan)
        self._finished = np.empty(0, np.float64)  # scratch: returns finished in one chunk

    def drain(self, max_chunks: int, timeout_s: float, policy_version: int, *, ack: bool = True) -> int:
        """Receive up to ``max_chunks`` chunks (waiting up to ``timeout_s`` for the first) and
        write them, then log them (if there is a log), then acknowledge them; returns steps
        written. ``policy_version``: the learner's current (packed) version, for the policy
        lag. ``ack`` False holds the acknowledgements until :meth:`ack_stored` (call it once
        a checkpoint holds them).

        Raises:
            TransportError: the medium failed for good (see ``ChunkReader.receive``).
            OSError: the log could not be written (nothing is acknowledged then; the
                chunks are in the buffer, and the medium delivers them again to the next
                life).
        """
        # Borrowed: written into the buffer below, before the next receive (the local
        # ring then decodes in place); held chunks are only acknowledged later.
        chunks = self.reader.receive(max_chunks, timeout_s=timeout_s, borrow=True)
        self._record_dropped()
        written = 0
        keep = self.wal is not None and self.wal.keep_chunks
        logged: list[tuple[memoryview | None, int, int, int, int]] = []
        for chunk in chunks:
            prev = self._last_written.get(chunk.actor_id, -1)
            steps = self._write(chunk, policy_version)
            written += steps
            if steps:
                logged.append((self._wire(chunk) if keep else None, chunk.actor_id, chunk.sequence, prev,
                               steps))
        if logged and self.wal is not None:
            self.wal.append(logged)
        if chunks and ack:
            self.reader.ack(chunks)
        elif chunks:
            self._unacked.extend(chunks)
        return written

    def replay(self, records: Iterable[LogRecord], policy_version: int, *, write: bool = True,
               checkpoint: str = "none") -> ReplayCounts:
        """Write the logged chunks that ``stored`` lacks, in the order logged, each after
        its logged predecessor (episode boundaries come out as first written), and only
        the streams this shard owns now; call it before the first :meth:`drain`. Nothing
        is acknowledged: the log holds them until a checkpoint of this life is complete.

        A record this shard cannot replay (header-only, or any with ``write`` False: a
        resume back to checkpoint ``checkpoint`` on purpose) is a *suspect*
        (:attr:`suspects`) of the shard that wrote it (rank 0 also takes shards that no
        longer exist): lost unless the medium delivers it again before :meth:`report_lost`.
        """
        counts = ReplayCounts()
        self.suspects.checkpoint = checkpoint
        # The actor whose replayed chunk each row got last (-1: none yet): where that is
        # not the actor now writing (an actor this life no longer runs shares its stand-in's
        # rows), the new chunk starts new episodes instead of continuing another's steps.
        writers = np.full(self.buffer.num_streams, -1, np.int64)
        world = self.settings.learners.count
        for rec in records:
            if (rec.actor_id, rec.sequence) in self.stored:
                counts.held += 1
                continue
            if rec.data is None or not write:
                if rec.shard == self.shard or (self.shard == 0 and rec.shard >= world):
                    self.suspects.chunks[(rec.actor_id, rec.sequence)] = rec.steps
                continue
            try:
                # Checksummed when logged and when read: no size guard needed here. The reader's
                # spec, as a live chunk's: the shard's adds the policy version the ingest writes.
                chunk = decode(rec.data, self.reader.spec, max_bytes=1 << 40)
            except CorruptChunkError as exc:  # checksummed twice over: a different spec
                counts.rejected += 1
                self._lost_in_replay(rec, f"rejected in log replay: {exc}")
                continue
            route = self._streams.stand_in(rec.actor_id)
            if route is None:
                counts.rejected += 1
                self._lost_in_replay(rec, "rejected in log replay: this life runs no actor to take it")
                continue
            self._replay_chunk(rec, chunk, route, writers, counts, policy_version)
        self._after_replay(writers)
        return counts

    def _replay_chunk(self, rec: LogRecord, chunk: Chunk, route: int, writers: np.ndarray,
                      counts: ReplayCounts, policy_version: int) -> None:
        """Write this shard's streams of a logged chunk into the rows of actor ``route``
        (its own, or its stand-in's), after its logged predecessor; count it."""
        owners = self._owners(chunk, route)
        mine = None if owners is None else owners == self.shard
        if mine is not None and not mine.any():
            counts.foreign += 1
            return
        if mine is not None and not mine.all():
            chunk = _streams_of(chunk, mine)
        if rec.prev >= 0:
            self._last_written[rec.actor_id] = rec.prev
        else:
            self._last_written.pop(rec.actor_id, None)
        rows = None if owners is None else self._streams.rows(route, chunk.stream_ids)
        if rows is not None and int(rows.max()) >= writers.shape[0]:
            rows = None  # _write rejects it
        if rows is not None and _others(writers[rows], rec.actor_id):
            self._last_written[rec.actor_id] = _AFTER_ANOTHER
        steps = self._write(chunk, policy_version, route=route)
        if not steps:
            counts.rejected += 1
            return
        counts.stored += 1
        counts.steps += steps
        counts.rerouted += route != rec.actor_id
        if rows is not None:
            writers[rows] = rec.actor_id

    def _after_replay(self, writers: np.ndarray) -> None:
        """The next chunk of an actor whose rows last got another actor's replayed chunk
        starts new episodes there (it does not continue that actor's steps)."""
        for actor in range(self._streams.num_actors):
            envs = np.flatnonzero(self._streams.shards(actor) == self.shard)
            if envs.size and _others(writers[self._streams.rows(actor, envs)], actor):
                self._last_written[actor] = _AFTER_ANOTHER

    def _lost_in_replay(self, rec: LogRecord, reason: str) -> None:
        log.warning("rank %d: logged chunk %s not replayed: %s", self.shard, (rec.actor_id, rec.sequence),
                    reason)
        if self.losses is not None:
            self.losses.record(rec.actor_id, rec.sequence, rec.sequence, 1, rec.steps, reason)

    @staticmethod
    def _wire(chunk: Chunk) -> memoryview:
        if chunk.wire is None:
            raise TransportError(f"chunk {chunk.identity} carries no received bytes to log: its "
                                   "transport reader must decode with transport.codec.decode")
        return chunk.wire

    def ack_stored(self) -> int:
        """Acknowledge the chunks ``drain(ack=False)`` wrote since the last call; returns how many."""
        chunks, self._unacked = self._unacked, []
        if chunks:
            self.reader.ack(chunks)
        return len(chunks)

    def report_lost(self) -> tuple[int, int]:
        """Record the suspects the medium did not deliver again as lost (call it when a
        checkpoint of this life is saved: they are in no checkpoint and no replay).
        Returns ``(chunks, steps)``; (0, 0) without a loss log."""
        if self.losses is None or not self.suspects.chunks:
            return 0, 0
        return self.losses.report_lost(self.suspects)

    def checkpointed(self, checkpoint_id: int, latest_complete: int | None) -> None:
        """This shard saved its part of ``checkpoint_id``: seal the log segment (it then
        covers it) and free what the complete checkpoint ``latest_complete`` holds.

        Raises:
            OSError: a new log segment cannot be created.
        """
        if self.wal is not None:
            self.wal.seal(checkpoint_id)
            self.wal.trim(latest_complete)

    def log_full(self) -> bool:
        """Whether the log's open segment keeps a shard's capacity of steps in chunks
        (older ones are overwritten in the ring by then): time for a checkpoint, which
        trims it. A header-only log never fills."""
        wal = self.wal
        return wal is not None and wal.keep_chunks and wal.segment_steps >= self.buffer.capacity

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state to save with a checkpoint: ``{"stored": {actor: [[lo, hi], ...]}}``."""
        return self.stored.state_dict()

    def close(self) -> None:
        """Close the reader (sends acknowledgements it still queues) and the log."""
        try:
            self.reader.close()
        finally:
            if self.wal is not None:
                self.wal.close()

    def _write(self, chunk: Chunk, policy_version: int, route: int | None = None) -> int:
        """Write ``chunk`` into the shard (the streams of actor ``route``, default its
        own); returns its steps, 0 when it is a duplicate or rejected (counted, logged)."""
        # A logged chunk (replayed: ``route`` given) that is rejected now is lost, not refused on arrival.
        what = "rejected" if route is None else "rejected in log replay"
        if chunk.identity in self.stored:
            self.stats.duplicates += 1
            self.total_duplicates += 1
            log.log(self._level(chunk.actor_id, "duplicate"),
                    "actor %d chunk %d dropped: this shard stored it already (delivered again after a "
                    "restart)", chunk.actor_id, chunk.sequence)
            return 0
        n = chunk.num_streams * chunk.num_steps
        try:
            route = chunk.actor_id if route is None else route
            self._check_owner(chunk, route)
            rows = self._streams.rows(route, chunk.stream_ids)
            if rows.max() >= self.buffer.num_streams:
                raise IngestRejectedError(f"actor {chunk.actor_id} streams map to rows {rows.tolist()}, "
                                          f"beyond this shard's {self.buffer.num_streams}")
            steps = self._steps_in_order(chunk)
            if VERSION_FIELD in self.buffer.spec:  # a training run's shard keeps each step's version
                steps = {**steps, VERSION_FIELD: np.full(chunk.steps["step_type"].shape,
                                                         chunk.policy_version)}
            try:
                self._sink.extend(steps, stream_ids=rows, priorities=chunk.priorities)
            except ShardReplayError as exc:  # steps the buffer refuses (another spec's values)
                raise IngestRejectedError(f"{type(exc).__name__}: {exc}") from exc
        except IngestRejectedError as exc:
            self.stats.rejected += 1
            self.total_rejected += 1
            log.log(self._level(chunk.actor_id, "rejected"), "chunk %s rejected: %s", chunk.identity, exc)
            if self.losses is not None:
                self.losses.record(chunk.actor_id, chunk.sequence, chunk.sequence, 1, n, f"{what}: {exc}")
            return 0
        self.stored.add(chunk.actor_id, chunk.sequence)
        self._last_written[chunk.actor_id] = chunk.sequence
        self.suspects.chunks.pop(chunk.identity, None)  # delivered again: not lost
        self._track_returns(rows, steps["reward"], steps["step_type"])
        self.stats.steps += n
        self.stats.chunks += 1
        # Updates between the chunk's policy and the learner's, not clamped: negative when
        # an actor acted with a policy of an earlier learner life that got further than
        # the checkpoint this life resumed from (docs/semantics.md, policy versions).
        self.stats.lag_sum += split_version(policy_version)[1] - split_version(chunk.policy_version)[1]
        self.stats.lag_count += 1
        return n

    def _steps_in_order(self, chunk: Chunk) -> Mapping[str, np.ndarray]:
        """The chunk's steps; when it does not follow the last chunk written of its actor,
        with its leading MID steps made FIRST (a copy: borrowed arrays stay untouched)."""
        last = self._last_written.get(chunk.actor_id)
        step_type = chunk.steps["step_type"]
        if last is None or chunk.sequence == last + 1 or not (step_type[:, 0] == _MID).any():
            return chunk.steps
        step_type = step_type.copy()
        step_type[step_type[:, 0] == _MID, 0] = _FIRST
        after = "another actor's replayed chunk in its rows" if last == _AFTER_ANOTHER \
            else f"its chunk {last}"
        log.log(self._level(chunk.actor_id, "order"), "actor %d chunk %d follows %s here: its "
                "streams start new (headless) episodes", chunk.actor_id, chunk.sequence, after)
        return {**chunk.steps, "step_type": step_type}

    def _record_dropped(self) -> None:
        """Rejections and losses the transport reported since the last receive."""
        dropped = self.reader.stats.dropped
        while dropped:
            actor, seq, count, reason = dropped.popleft()
            if self.losses is not None:
                self.losses.record(actor, seq, seq, count, -1, reason)

    def owns_actor(self, actor_id: int) -> bool:
        """Whether this shard holds any of ``actor_id``'s streams in this life's routing
        (an actor this life no longer runs: those of its stand-in, which take its logged chunks)."""
        route = self._streams.stand_in(actor_id)
        return route is not None and bool((self._streams.shards(route) == self.shard).any())

    def _owners(self, chunk: Chunk, route: int) -> np.ndarray | None:
        """The shard of each of ``chunk``'s streams as actor ``route``'s (None: a stream
        outside ``envs_per_actor``)."""
        ids = chunk.stream_ids
        if int(ids.min()) < 0 or int(ids.max()) >= self.settings.actors.envs_per_actor:
            return None
        return self._streams.shards(route)[ids]

    def _check_owner(self, chunk: Chunk, route: int) -> None:
        s = self.settings
        owners = self._owners(chunk, route)
        if owners is None:
            raise IngestRejectedError(f"actor {chunk.actor_id} sent streams {chunk.stream_ids.tolist()}; the "
                                      f"learners take {s.actors.envs_per_actor} per actor (--envs-per-actor)")
        if (owners != self.shard).any():
            shards = s.learners.count
            raise IngestRejectedError(f"actor {chunk.actor_id} streams {chunk.stream_ids.tolist()} belong to "
                                      f"shards {owners.tolist()} of {shards}, not to shard {self.shard}: "
                                      f"start it with --num-shards {shards}")

    def _level(self, actor_id: int, what: str) -> int:
        """WARNING the first time per actor and kind, then DEBUG (a misconfigured actor
        sends thousands; re-deliveries after a crash come in runs)."""
        key = (actor_id, what)
        if key in self._warned:
            return logging.DEBUG
        self._warned.add(key)
        return logging.WARNING

    def _track_returns(self, rows: np.ndarray, reward: np.ndarray, step_type: np.ndarray) -> None:
        finished = self._finished
        if finished.shape[0] < step_type.size:
            finished = self._finished = np.empty(step_type.size, np.float64)
        n = track_returns(rows.astype(np.int64, copy=False), reward, step_type, self._running,
                           self.last_return, finished)
        self.stats.returns.extend(finished[:n].tolist())

    def take_stats(self) -> IngestStats:
        """The counters since the last call (and reset them)."""
        stats, self.stats = self.stats, IngestStats()
        return stats


def _others(writers: np.ndarray, actor_id: int) -> bool:
    """Whether any of these rows last got a replayed chunk of an actor other than ``actor_id``."""
    return bool(((writers >= 0) & (writers != actor_id)).any())


def _streams_of(chunk: Chunk, keep: np.ndarray) -> Chunk:
    """The chunk with only the streams where ``keep`` is True (a copy of the identity)."""
    return Chunk(chunk.actor_id, chunk.sequence, chunk.policy_version, chunk.stream_ids[keep],
                 {k: v[keep] for k, v in chunk.steps.items()},
                 None if chunk.priorities is None else chunk.priorities[keep], chunk.wire)
