"""Sharded replay over torch.distributed: one global buffer from per-rank shards."""

from __future__ import annotations

from shardreplay.distributed.sharded_buffer import SAMPLE_MODES, ShardedReplayBuffer

__all__ = ["SAMPLE_MODES", "ShardedReplayBuffer"]
