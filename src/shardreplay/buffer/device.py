"""Where sampled batches land: checked once at construction, applied per batch (GPU
batches: docs/internals.md, "Byte records")."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardreplay.buffer.batch import Batch
from shardreplay.errors import ConfigError
from shardreplay.spec.keys import with_shard
from shardreplay.spec.layout import DATA, RecordLayout
from shardreplay.spec.torch_dtypes import torch_views


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
    return batch.apply(torch.Tensor.pin_memory)


def pins(device: torch.device) -> bool:
    """Whether batches for ``device`` are drawn into page-locked host memory."""
    return device.type == "cuda" and torch.cuda.is_available()


def records_on(records: torch.Tensor, layout: RecordLayout, weights: torch.Tensor,
               device: torch.device) -> Batch:
    """A batch of window ``records`` (host uint8 ``[B, record bytes]`` of ``layout``) on
    ``device``: the rows in one copy (non-blocking when they are page-locked), every field
    a view of them there; ``weights`` (float32 ``[B]``) come along."""
    on = records.to(device, non_blocking=records.is_pinned())
    parts = torch_views(layout, on)
    data = {f: parts[DATA + f] for f in layout.offsets(DATA)}
    if device.type == "cuda":
        weights = weights.pin_memory()
    return Batch(data=data, mask=parts["mask"], keys=parts["key"],
                 weights=weights.to(device, non_blocking=True), probabilities=parts["probability"])


def gathered_on(shard: Any, draw: Any, layout: RecordLayout, device: torch.device) -> Batch:
    """The windows of ``draw`` (a shard's draw: ``starts``, ``weights``, ``probabilities``)
    gathered straight into page-locked records of ``layout`` and moved to ``device`` in
    one copy (:func:`records_on`)."""
    n = draw.starts.shape[0]
    records = torch.empty((n, layout.record_bytes), dtype=torch.uint8, pin_memory=True)
    write_records(shard, layout, records.numpy(), np.arange(n), draw.starts, draw.probabilities)
    return records_on(records, layout, torch.from_numpy(draw.weights), device)


def write_records(shard: Any, layout: RecordLayout, out: np.ndarray, rows: np.ndarray,
                  starts: np.ndarray, probabilities: np.ndarray, shard_index: int = 0) -> None:
    """Write the windows at flat ``starts`` of ``shard`` into rows ``rows`` of the window
    records ``out`` (uint8 ``[N, record bytes]`` of ``layout``): their data, mask, keys
    (with ``shard_index`` as their shard) and ``probabilities``."""
    if not rows.size:
        return
    mask, keys = shard.gather(starts, into=(out, layout.offsets(DATA), rows))
    views = layout.views(out)
    views["mask"][rows] = mask
    views["key"][rows] = with_shard(keys, shard_index)
    views["probability"][rows] = probabilities
