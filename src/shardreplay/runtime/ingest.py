"""Draining a shard's transport into its buffer, with episode returns and policy lag."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.errors import ShardReplayError
from shardreplay.runtime.settings import TrainSettings
from shardreplay.spec import StepType
from shardreplay.transport.base import ChunkReader
from shardreplay.transport.codec import Chunk

log = logging.getLogger("shardreplay.learner")


@dataclass
class IngestStats:
    """Counters since the last :meth:`Ingestor.take_stats`."""

    steps: int = 0
    chunks: int = 0
    rejected: int = 0
    lag_sum: float = 0.0
    lag_count: int = 0
    returns: list[float] = field(default_factory=list)


class Ingestor:
    """Moves chunks from a reader into the local shard, acknowledging them after.

    Rows: an actor's stream ``s`` goes to row ``settings.row_of(actor_id, s)``; chunks
    whose rows fall outside the shard are rejected and counted (never half-written).
    """

    def __init__(self, reader: ChunkReader, buffer: ReplayBuffer, settings: TrainSettings) -> None:
        self.reader = reader
        self.buffer = buffer
        self.settings = settings
        self._running = np.zeros(buffer.num_streams, np.float64)
        self.stats = IngestStats()
        # The last finished episode of each stream: a recent mean over all streams that
        # near-random streams (short episodes, many of them) can not dominate.
        self.last_return = np.full(buffer.num_streams, np.nan)

    def drain(self, max_chunks: int, timeout_s: float, policy_version: int) -> int:
        """Receive up to ``max_chunks`` chunks and write them; returns steps written."""
        chunks = self.reader.receive(max_chunks, timeout_s=timeout_s)
        written = 0
        for chunk in chunks:
            written += self._write(chunk, policy_version)
        if chunks:
            self.reader.ack(chunks)
        return written

    def _write(self, chunk: Chunk, policy_version: int) -> int:
        rows = np.array([self.settings.row_of(chunk.actor_id, int(s)) for s in chunk.stream_ids])
        try:
            if rows.max() >= self.buffer.num_streams:
                raise ShardReplayError(f"actor {chunk.actor_id} streams map to rows {rows.tolist()}, "
                                       f"beyond this shard's {self.buffer.num_streams}")
            self.buffer.extend(chunk.steps, stream_ids=rows, priorities=chunk.priorities)
        except ShardReplayError as exc:
            self.stats.rejected += 1
            log.warning("chunk %s rejected: %s", chunk.identity, exc)
            return 0
        self._track_returns(rows, chunk.steps["reward"], chunk.steps["step_type"])
        steps = chunk.num_streams * chunk.num_steps
        self.stats.steps += steps
        self.stats.chunks += 1
        self.stats.lag_sum += max(policy_version - chunk.policy_version, 0)
        self.stats.lag_count += 1
        return steps

    def _track_returns(self, rows: np.ndarray, reward: np.ndarray, step_type: np.ndarray) -> None:
        for t in range(step_type.shape[1]):
            first = step_type[:, t] == StepType.FIRST
            self._running[rows[first]] = 0.0
            last = step_type[:, t] == StepType.LAST
            done = rows[last]
            self.stats.returns.extend(float(v) for v in self._running[done])
            self.last_return[done] = self._running[done]
            self._running[rows[~last]] += reward[~last, t]

    def take_stats(self) -> IngestStats:
        """The counters since the last call (and reset them)."""
        stats, self.stats = self.stats, IngestStats()
        return stats
