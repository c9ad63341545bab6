"""shardreplay: one exact, prioritized replay buffer across processes, GPUs and machines."""

from __future__ import annotations

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.gym_writer import GymStepWriter, spec_from_env
from shardreplay.buffer.info import BufferInfo
from shardreplay.buffer.nstep import NStepTransition, nstep_returns, nstep_transitions
from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.transitions import Transitions, transitions_from_batch
from shardreplay.distributed import ShardedReplayBuffer
from shardreplay.errors import (
    CheckpointError,
    ConfigError,
    EmptyBufferError,
    InvalidPriorityError,
    ShardReplayError,
    SpecMismatchError,
)
from shardreplay.runtime.gym_steps import GymStepConverter  # numpy only: gymnasium is never imported
from shardreplay.samplers.schedules import LinearSchedule
from shardreplay.spec import Field, Spec, StepType

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BufferInfo",
    "CheckpointError",
    "ConfigError",
    "EmptyBufferError",
    "Field",
    "GymStepConverter",
    "GymStepWriter",
    "InvalidPriorityError",
    "LinearSchedule",
    "NStepTransition",
    "ReplayBuffer",
    "ShardReplayError",
    "ShardedReplayBuffer",
    "Spec",
    "SpecMismatchError",
    "StepType",
    "Transitions",
    "__version__",
    "nstep_returns",
    "nstep_transitions",
    "spec_from_env",
    "transitions_from_batch",
]
