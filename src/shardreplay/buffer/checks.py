"""Validation of stream ids, keys and priorities given to the buffer."""

from __future__ import annotations

from typing import Any

import numpy as np

from shardreplay.errors import InvalidKeyError, InvalidPriorityError, SpecMismatchError
from shardreplay.spec.coerce import to_numpy as _numpy


def as_index_array(value: Any, name: str) -> np.ndarray:
    """A 1-D int64 array from integers (numpy, torch or a list).

    Raises:
        InvalidKeyError: not a 1-D array of integers.
    """
    arr = _numpy(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidKeyError(f"{name} must be a 1-D array of integers, got {arr.dtype}{list(arr.shape)}")
    return arr.astype(np.int64, copy=False)


def check_stream_ids(value: Any, num_streams: int) -> np.ndarray:
    """Stream ids as int64, each in ``[0, num_streams)`` and unique.

    Raises:
        SpecMismatchError: not 1-D integers, out of range, or repeated.
    """
    arr = _numpy(value)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise SpecMismatchError(f"stream_ids must be a non-empty 1-D array of integers, "
                                f"got {arr.dtype}{list(arr.shape)}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0 or arr.max() >= num_streams:
        raise SpecMismatchError(f"stream_ids must lie in [0, {num_streams}), got min {arr.min()} "
                                f"max {arr.max()}")
    if np.unique(arr).size != arr.size:
        raise SpecMismatchError("stream_ids must be unique within one write")
    return arr


def as_priority_array(value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Priorities as float32 of ``shape`` (values are checked by the caller). A trailing
    unit axis is dropped: ``[B, 1]``, as TorchRL's losses write ``td_error``, is ``[B]``.

    Raises:
        InvalidPriorityError: wrong shape or not numbers.
    """
    arr = _numpy(value)
    if arr.shape == (*shape, 1):
        arr = arr.reshape(shape)
    if arr.shape != shape:
        raise InvalidPriorityError(f"priorities must have shape {shape}, got {arr.shape}")
    if arr.size and arr.dtype.kind not in "biuf":
        raise InvalidPriorityError(f"priorities must be numbers, got {arr.dtype}")
    return arr.astype(np.float32, copy=False)


def check_priorities(value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Priorities as float32 of ``shape``, finite and >= 0.

    Raises:
        InvalidPriorityError: wrong shape, not numbers, negative, NaN or inf.
    """
    arr = as_priority_array(value, shape)
    if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0):
        raise InvalidPriorityError("priorities must be finite and >= 0 (got NaN, inf or a negative "
                                   "value); nothing was changed")
    return arr


def foreign_key(keys: np.ndarray, bad: int, owner: str) -> str:
    """The message for ``keys[bad]``, which is not a key of this ``owner`` (buffer or
    sharded buffer): what keys are, and what is not one."""
    return (f"keys must come from this {owner}'s sample() (batch.keys): keys[{bad}] = "
            f"{int(keys[bad])} is not one of its keys (positions, torch.arange(B) and keys of "
            "another buffer are not keys); nothing was applied")


def not_prioritized(sampler: str) -> str:
    """The message for ``update_priorities`` on a buffer whose sampler ignores priorities."""
    return (f"update_priorities needs a prioritized buffer, but this buffer's sampler is "
            f"{sampler!r} (priorities would change nothing); construct it (every shard's, when "
            "sharded) with ReplayBuffer(..., sampler=\"prioritized\"), or skip the call")
