"""BufferInfo: a buffer's sizes and counters as one record (``ReplayBuffer.info()``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BufferInfo:
    """Sizes and counters of one buffer, or of this rank's shard of a sharded buffer.

    Attributes:
        sampler: ``"uniform"``, ``"prioritized"`` or ``"fifo"``.
        num_steps: steps stored now.
        samplable: windows that can be drawn now (``len(buffer)``).
        capacity: steps the buffer can hold.
        stale_updates: priority updates ignored because their window was overwritten
            after it was sampled (no error: see docs/semantics.md).
        updates_applied: priority updates applied, from any caller (in a sharded buffer:
            from any rank).
        invalid_keys: priority updates routed here by other ranks whose key fits no
            window of this shard (skipped; always 0 for a single buffer).
        max_priority: the priority a window written without one gets (1.0 without
            prioritized sampling).
        key_tag: the tag every key of this buffer carries (see docs/semantics.md).
    """

    sampler: str
    num_steps: int
    samplable: int
    capacity: int
    stale_updates: int
    updates_applied: int
    invalid_keys: int
    max_priority: float
    key_tag: int
