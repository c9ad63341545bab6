"""Exceptions raised by shardreplay.

Every error the library raises on purpose derives from :class:`ShardReplayError`, and
also from the built-in type a caller would reach for (``ValueError`` for bad input,
``RuntimeError`` for a failed operation), so both ``except`` styles work. The tree, with
what each error means, is drawn in docs/semantics.md, "Errors".

Errors of third-party libraries (redis, the OS, torch.distributed) are translated into
these once, at the module that talks to them.
"""

from __future__ import annotations

__all__ = [
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointFormatError",
    "CollectiveTimeout",
    "ConfigError",
    "CorruptChunkError",
    "EmptyBufferError",
    "IncompleteCheckpointError",
    "IngestRejectedError",
    "InvalidKeyError",
    "InvalidPriorityError",
    "PeerLost",
    "SamplerFailed",
    "ShardReplayError",
    "SpecMismatchError",
    "StorageError",
    "TransportError",
    "TransportTimeout",
]


class ShardReplayError(Exception):
    """Root of every error shardreplay raises on purpose."""


class ConfigError(ShardReplayError, ValueError):
    """A setting is out of range or settings contradict each other."""


class SpecMismatchError(ShardReplayError, ValueError):
    """Written data does not match the buffer's Spec (field, shape, dtype, values)."""


class InvalidPriorityError(ShardReplayError, ValueError):
    """A priority is negative, NaN or infinite, or the counts do not match the keys."""


class InvalidKeyError(ShardReplayError, ValueError):
    """A key does not name a slot of this buffer (wrong shard, row or position)."""


class EmptyBufferError(ShardReplayError, RuntimeError):
    """Sampling was asked for while no valid window start exists."""


class CollectiveTimeout(ShardReplayError, RuntimeError):
    """A collective operation did not complete in time: a peer rank is missing."""


class PeerLost(CollectiveTimeout):
    """The connection to a peer rank broke (reset or closed: it most likely died); raised
    at once, not after the timeout, and handled wherever a missing peer is."""


class SamplerFailed(ShardReplayError, RuntimeError):
    """The background thread of a pipelined sharded buffer failed (its error is the
    ``__cause__``); the buffer cannot sample any more: close it and stop the run."""


class StorageError(ShardReplayError, RuntimeError):
    """The file system refused a write or a directory (no space left, read-only, no
    permission): the message is one line naming the path and the OS error, also kept as
    ``path`` and ``errno`` (``errno.ENOSPC``, ...)."""

    def __init__(self, message: str, *, path: str = "", errno: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class IngestRejectedError(ShardReplayError, ValueError):
    """A learner shard cannot take a chunk an actor sent: streams routed to another shard
    (the actor's ``--num-shards``), more streams than ``--envs-per-actor``, rows outside
    the shard, or steps its buffer refuses. The learner removes it from the medium
    unstored and records it in ``lost_chunks.jsonl``; restart the actor with the
    learners' settings (leave them out: it takes the published ones)."""


class CheckpointError(ShardReplayError, RuntimeError):
    """A checkpoint could not be written or read."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint lacks a part or its manifest."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint file is corrupt, truncated, or of another spec or format version."""


class CheckpointDamagedError(CheckpointFormatError):
    """A checkpoint file's bytes differ from the hash its manifest records (a flipped bit,
    a replaced file): found by whoever reads them, the message names the file (and block)."""


class TransportError(ShardReplayError, RuntimeError):
    """A transport failed to send or receive."""


class CorruptChunkError(TransportError):
    """A chunk failed its checksum, header or spec validation; ``reason`` is a short stable
    category (``"checksum"``, ``"truncated"``, ``"spec"``, ...) that transports count
    rejections by, so nobody has to parse messages."""

    def __init__(self, message: str, *, reason: str = "corrupt") -> None:
        super().__init__(message)
        self.reason = reason


class TransportTimeout(TransportError):
    """The transport did not answer in time."""
