"""shardreplay: one exact, prioritized replay buffer across processes, GPUs and machines."""

from __future__ import annotations

from shardreplay.errors import (
    CheckpointError,
    ConfigError,
    EmptyBufferError,
    InvalidPriorityError,
    ShardReplayError,
    SpecMismatchError,
)
from shardreplay.spec import Field, Spec, StepType

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EmptyBufferError",
    "Field",
    "InvalidPriorityError",
    "ShardReplayError",
    "Spec",
    "SpecMismatchError",
    "StepType",
    "__version__",
]
