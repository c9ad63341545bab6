"""Collects per-step writes of an actor's streams into chunks of ``T`` steps."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardreplay.spec.spec import flatten
from shardreplay.transport.codec import Chunk


class Chunker:
    """Buffers one step per stream at a time and emits a :class:`Chunk` every ``T`` steps.

    Args:
        actor_id: the actor's id (goes into every chunk).
        stream_ids: the actor's stream numbers, ``[S]``.
        chunk_steps: ``T``.
        first_sequence: sequence number of the first chunk; it must exceed any number
            this actor id used before (a restarted actor starts from a clock reading).
        select: the steps added hold every env of the actor: keep only rows
            ``stream_ids`` of them (an actor whose streams feed several shards has one
            chunker per shard). False: the steps hold exactly these streams.
    """

    def __init__(self, actor_id: int, stream_ids: np.ndarray, chunk_steps: int,
                 first_sequence: int = 0, *, select: bool = False) -> None:
        self.actor_id = actor_id
        self.stream_ids = np.asarray(stream_ids, np.int64)
        self._select = select
        self.chunk_steps = chunk_steps
        self.sequence = first_sequence
        self._steps: list[dict[str, np.ndarray]] = []
        self._min_version: int | None = None

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: dict[str, Any], policy_version: int) -> Chunk | None:
        """Add one step of every stream; returns a full chunk when ``T`` steps are in."""
        self._steps.append({k: np.asarray(v)[self.stream_ids] if self._select else np.asarray(v)
                            for k, v in flatten(step).items()})
        self._min_version = policy_version if self._min_version is None else \
            min(self._min_version, policy_version)
        return self.flush() if len(self._steps) >= self.chunk_steps else None

    def flush(self) -> Chunk | None:
        """The steps gathered so far as a chunk (None when empty)."""
        if not self._steps:
            return None
        names = self._steps[0].keys()
        steps = {k: np.stack([s[k] for s in self._steps], axis=1) for k in names}
        steps["step_type"] = steps["step_type"].astype(np.uint8)
        if "discount" in steps:
            steps["discount"] = steps["discount"].astype(np.float32)
        chunk = Chunk(actor_id=self.actor_id, sequence=self.sequence,
                      policy_version=int(self._min_version or 0), stream_ids=self.stream_ids,
                      steps=steps, priorities=None)
        self.sequence += 1
        self._steps, self._min_version = [], None
        return chunk
