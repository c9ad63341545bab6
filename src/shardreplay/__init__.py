"""shardreplay: one exact, prioritized replay buffer across processes, GPUs and machines."""

from __future__ import annotations

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import (
    CheckpointError,
    ConfigError,
    EmptyBufferError,
    InvalidPriorityError,
    ShardReplayError,
    SpecMismatchError,
)
from shardreplay.samplers.schedules import LinearSchedule
from shardreplay.spec import Field, Spec, StepType

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "CheckpointError",
    "ConfigError",
    "EmptyBufferError",
    "Field",
    "InvalidPriorityError",
    "LinearSchedule",
    "ReplayBuffer",
    "ShardReplayError",
    "ShardedReplayBuffer",
    "Spec",
    "SpecMismatchError",
    "StepType",
    "__version__",
]
