"""Draining a shard's transport into its buffer, with episode returns and policy lag.

Exactly once, across learner crashes. The durable transports deliver a chunk until it
is acknowledged (at-least-once), so a chunk is stored twice when a learner dies after
writing it and before its acknowledgement reached the medium, and the next life
restores a buffer (from a checkpoint) that already holds it. The :class:`Ingestor`
therefore remembers, per actor, the highest sequence it stored (``high_water``) and
drops a chunk at or below it as a duplicate. Actors number their chunks in strictly
increasing order and a shard's transport delivers each actor's chunks in that order,
so "at or below the mark" means "already stored". The marks are saved with each
checkpoint (:meth:`Ingestor.state_dict`) and restored with it (:func:`merge_high_water`
over all saved parts, so it also holds after a resume on another number of shards).

With ``drain(..., ack=False)`` and :meth:`Ingestor.ack_stored` after each checkpoint
(save, then acknowledge), every valid chunk that reached the medium is stored exactly
once in the buffer that survives any number of crashes: a chunk acknowledged is in a complete
checkpoint; one not acknowledged is delivered again and stored, or dropped because
the restored marks show it is in the checkpoint already. The learner of
``shardreplay train`` acknowledges right after writing instead (holding
acknowledgements until the next checkpoint would stall every actor on back-pressure):
after a crash it never stores a chunk twice, and loses only the chunks acknowledged
since its last checkpoint, like every other state of that interval.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.errors import ShardReplayError
from shardreplay.runtime.routing import shard_for_actor
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import StepType
from shardreplay.transport.base import ChunkReader
from shardreplay.transport.codec import Chunk

log = logging.getLogger("shardreplay.learner")
_FIRST, _LAST = int(StepType.FIRST), int(StepType.LAST)


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


class Ingestor:
    """Moves chunks from a reader into the local shard, acknowledging them after.

    Rows: an actor's stream ``s`` goes to row ``settings.row_of(actor_id, s)``. Chunks
    of an actor routed to another shard, with more streams than ``envs_per_actor``, or
    whose rows fall outside the shard are rejected and counted, never half-written (they
    would land in another actor's rows and interleave its episodes).
    Chunks at or below their actor's ``high_water`` sequence are dropped as duplicates
    (see the module docstring).

    Args:
        reader: this shard's transport reader.
        buffer: this shard's buffer.
        settings: the run's settings (rows of streams).
        shard: this shard's index (its rank).
        high_water: per actor, the highest sequence already in ``buffer`` (restored
            from a checkpoint with :func:`merge_high_water`).
    """

    def __init__(self, reader: ChunkReader, buffer: ReplayBuffer, settings: TrainSettings,
                 high_water: Mapping[int, int] | None = None, *, shard: int = 0) -> None:
        self.reader = reader
        self.buffer = buffer
        self.settings = settings
        self.shard = shard
        self.high_water: dict[int, int] = {int(a): int(q) for a, q in (high_water or {}).items()}
        self._unacked: list[Chunk] = []
        self.total_rejected = 0  # over the ingestor's life (``stats`` are per window)
        self.total_duplicates = 0
        self._warned: set[tuple[int, str]] = set()
        self._running = np.zeros(buffer.num_streams, np.float64)
        self.stats = IngestStats()
        # The last finished episode of each stream: a recent mean over all streams that
        # near-random streams (short episodes, many of them) can not dominate.
        self.last_return = np.full(buffer.num_streams, np.nan)
        self._finished = np.empty(0, np.float64)  # scratch: returns finished in one chunk

    def drain(self, max_chunks: int, timeout_s: float, policy_version: int, *, ack: bool = True) -> int:
        """Receive up to ``max_chunks`` chunks and write them; returns steps written.

        Args:
            max_chunks: chunks to take at most.
            timeout_s: how long to wait for the first one.
            policy_version: the learner's current version (for the policy lag).
            ack: acknowledge them now; False holds the acknowledgements until
                :meth:`ack_stored` (call it once a checkpoint holds them).

        Raises:
            TransportError: the medium failed for good (see ``ChunkReader.receive``).
        """
        # Borrowed: written into the buffer below, before the next receive (the local
        # ring then decodes in place); held chunks are only acknowledged later.
        chunks = self.reader.receive(max_chunks, timeout_s=timeout_s, borrow=True)
        written = 0
        for chunk in chunks:
            written += self._write(chunk, policy_version)
        if chunks and ack:
            self.reader.ack(chunks)
        elif chunks:
            self._unacked.extend(chunks)
        return written

    def ack_stored(self) -> int:
        """Acknowledge the chunks ``drain(ack=False)`` wrote since the last call; returns how many."""
        chunks, self._unacked = self._unacked, []
        if chunks:
            self.reader.ack(chunks)
        return len(chunks)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state to save with a checkpoint: ``{"high_water": {actor: sequence}}``."""
        return {"high_water": {str(a): q for a, q in sorted(self.high_water.items())}}

    def close(self) -> None:
        """Close the reader (sends acknowledgements it still queues)."""
        self.reader.close()

    def _write(self, chunk: Chunk, policy_version: int) -> int:
        if chunk.sequence <= self.high_water.get(chunk.actor_id, -1):
            self.stats.duplicates += 1
            self.total_duplicates += 1
            # Warned once: an actor that restarted with a clock behind its last life's
            # would lose chunks here for a while, and must not do so quietly.
            log.log(self._level(chunk.actor_id, "duplicate"),
                    "actor %d chunk %d dropped: this shard stored its chunks up to %d already "
                    "(re-delivered after a restart; if the actor itself restarted with a clock behind "
                    "its previous life's, its chunks are dropped until it passes that sequence)",
                    chunk.actor_id, chunk.sequence, self.high_water[chunk.actor_id])
            return 0
        rows = np.array([self.settings.row_of(chunk.actor_id, int(s)) for s in chunk.stream_ids])
        try:
            self._check_owner(chunk)
            if rows.max() >= self.buffer.num_streams:
                raise ShardReplayError(f"actor {chunk.actor_id} streams map to rows {rows.tolist()}, "
                                       f"beyond this shard's {self.buffer.num_streams}")
            self.buffer.extend(chunk.steps, stream_ids=rows, priorities=chunk.priorities)
        except ShardReplayError as exc:
            self.stats.rejected += 1
            self.total_rejected += 1
            log.log(self._level(chunk.actor_id, "rejected"), "chunk %s rejected: %s", chunk.identity, exc)
            return 0
        self.high_water[chunk.actor_id] = chunk.sequence
        self._track_returns(rows, chunk.steps["reward"], chunk.steps["step_type"])
        steps = chunk.num_streams * chunk.num_steps
        self.stats.steps += steps
        self.stats.chunks += 1
        self.stats.lag_sum += max(policy_version - chunk.policy_version, 0)
        self.stats.lag_count += 1
        return steps

    def _check_owner(self, chunk: Chunk) -> None:
        s = self.settings
        owner = shard_for_actor(chunk.actor_id, s.learners)
        if owner != self.shard:
            raise ShardReplayError(f"actor {chunk.actor_id} belongs to shard {owner} of {s.learners}, not to "
                                   f"shard {self.shard}: start it with --num-shards {s.learners}")
        if int(chunk.stream_ids.max()) >= s.envs_per_actor:
            raise ShardReplayError(f"actor {chunk.actor_id} sent streams {chunk.stream_ids.tolist()}; the "
                                   f"learners take {s.envs_per_actor} per actor (--envs-per-actor)")

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
        n = _track_returns(rows.astype(np.int64, copy=False), reward, step_type, self._running,
                           self.last_return, finished)
        self.stats.returns.extend(finished[:n].tolist())

    def take_stats(self) -> IngestStats:
        """The counters since the last call (and reset them)."""
        stats, self.stats = self.stats, IngestStats()
        return stats


@numba.njit(cache=True, nogil=True)
def _track_returns(rows, reward, step_type, running, last_return, finished):  # pragma: no cover - compiled
    """Running returns of a chunk's streams, step by step in time order: a FIRST resets
    its row's sum, a LAST records it (into ``finished``, in order, and ``last_return``),
    every other step adds its reward. Returns how many episodes finished. (The numpy
    version, a few array operations per time step, cost ~350 us a chunk of 32 steps:
    20 times the buffer write.)"""
    n = 0
    for t in range(step_type.shape[1]):
        for i in range(step_type.shape[0]):
            r = rows[i]
            kind = step_type[i, t]
            if kind == _FIRST:
                running[r] = 0.0
            if kind == _LAST:
                finished[n] = running[r]
                n += 1
                last_return[r] = running[r]
            else:
                running[r] += reward[i, t]
    return n


def merge_high_water(states: Iterable[Mapping[str, Any] | None]) -> dict[int, int]:
    """Per actor, the highest sequence over the saved states of all shards.

    An actor's chunks go to one shard at a time, so the maximum over the parts of a
    checkpoint is what that checkpoint holds of it, whichever shard gets it next.
    """
    merged: dict[int, int] = {}
    for state in states:
        for actor, seq in ((state or {}).get("high_water") or {}).items():
            merged[int(actor)] = max(merged.get(int(actor), -1), int(seq))
    return merged
