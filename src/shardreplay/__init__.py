"""shardreplay: one exact, prioritized replay buffer across processes, GPUs and machines.

The public names load on first use (PEP 562): ``import shardreplay`` stays cheap, so the
``shardreplay`` command can take over Ctrl-C and SIGTERM before torch and numba are
imported (seconds on a loaded machine; a signal then would end in a traceback).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardreplay._lazy import lazy_exports

if TYPE_CHECKING:
    from shardreplay.buffer.batch import Batch, BufferInfo
    from shardreplay.buffer.nstep import Transitions, nstep_returns, nstep_transitions
    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.buffer.sequences import SequenceBatch, sample_sequences, sequence_priorities
    from shardreplay.distributed import ShardedReplayBuffer
    from shardreplay.errors import (
        CheckpointError,
        ConfigError,
        EmptyBufferError,
        InvalidPriorityError,
        ShardReplayError,
        SpecMismatchError,
    )
    from shardreplay.gym.spaces import spec_from_env
    from shardreplay.gym.steps import GymStepConverter  # numpy only: gymnasium is never imported
    from shardreplay.gym.writer import GymStepWriter
    from shardreplay.samplers.schedules import LinearSchedule
    from shardreplay.spec import Field, Spec, StepType

__version__ = "0.1.0"

# Public name -> the module that defines it.
_HOMES = {name: module for module, names in {
    "shardreplay.buffer.batch": ("Batch", "BufferInfo"),
    "shardreplay.buffer.nstep": ("Transitions", "nstep_returns", "nstep_transitions"),
    "shardreplay.buffer.replay_buffer": ("ReplayBuffer",),
    "shardreplay.buffer.sequences": ("SequenceBatch", "sample_sequences", "sequence_priorities"),
    "shardreplay.distributed": ("ShardedReplayBuffer",),
    "shardreplay.errors": ("CheckpointError", "ConfigError", "EmptyBufferError", "InvalidPriorityError",
                           "ShardReplayError", "SpecMismatchError"),
    "shardreplay.gym.steps": ("GymStepConverter",),
    "shardreplay.gym.spaces": ("spec_from_env",),
    "shardreplay.gym.writer": ("GymStepWriter",),
    "shardreplay.samplers.schedules": ("LinearSchedule",),
    "shardreplay.spec": ("Field", "Spec", "StepType"),
}.items() for name in names}


__getattr__, __dir__ = lazy_exports("shardreplay", globals(), _HOMES)


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
    "ReplayBuffer",
    "SequenceBatch",
    "ShardReplayError",
    "ShardedReplayBuffer",
    "Spec",
    "SpecMismatchError",
    "StepType",
    "Transitions",
    "__version__",
    "nstep_returns",
    "nstep_transitions",
    "sample_sequences",
    "sequence_priorities",
    "spec_from_env",
]
