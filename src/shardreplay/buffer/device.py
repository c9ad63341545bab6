"""Where sampled batches land: checked once at construction, applied per batch.

Batches are gathered on the host (numpy). For a CUDA target they are pinned first, so
the copy to the GPU runs asynchronously (``non_blocking=True``) on the current stream;
kernels queued after it on that stream see the data, as with any CUDA tensor.
Pinning needs a CUDA runtime, so it is only done when ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import torch

from shardreplay.buffer.batch import Batch
from shardreplay.errors import ConfigError


def check_device(device: torch.device | str | None) -> torch.device:
    """The device batches are returned on (``None``: CPU).

    Raises:
        ConfigError: not a device name torch knows, the ``meta`` device (it holds no
            data), or a CUDA device while CUDA is not available.
    """
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from exc
    if dev.type == "meta":
        raise ConfigError("device='meta' holds no data; use 'cpu' or a CUDA device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    return dev


def pinned(batch: Batch) -> Batch:
    """The batch in pinned (page-locked) host memory, for non-blocking copies to a GPU."""
    return Batch(data={k: v.pin_memory() for k, v in batch.data.items()},
                 mask=batch.mask.pin_memory(), keys=batch.keys.pin_memory(),
                 weights=batch.weights.pin_memory(), probabilities=batch.probabilities.pin_memory())


def batch_on(batch: Batch, device: torch.device) -> Batch:
    """``batch`` (host tensors) moved to ``device``: unchanged for CPU; pinned and copied
    with ``non_blocking=True`` for CUDA."""
    if device.type == "cpu":
        return batch
    if device.type == "cuda" and torch.cuda.is_available():
        return pinned(batch).to(device, non_blocking=True)
    return batch.to(device)
