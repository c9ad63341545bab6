"""The one numpy -> torch dtype map, and torch views of packed records."""

from __future__ import annotations

import numpy as np
import torch

from shardreplay.errors import ConfigError
from shardreplay.spec.layout import RecordLayout

__all__ = ["TORCH_DTYPES", "torch_dtype", "torch_views"]

# Every dtype a Field may have (bool, int, uint, float), and the ones shardreplay adds.
TORCH_DTYPES: dict[np.dtype, torch.dtype] = {np.dtype(d): t for d, t in (
    (np.bool_, torch.bool), (np.uint8, torch.uint8), (np.int8, torch.int8),
    (np.int16, torch.int16), (np.int32, torch.int32), (np.int64, torch.int64),
    (np.uint16, torch.uint16), (np.uint32, torch.uint32), (np.uint64, torch.uint64),
    (np.float16, torch.float16), (np.float32, torch.float32), (np.float64, torch.float64))}


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype.

    Raises:
        ConfigError: a dtype torch has no equivalent of (complex, strings, or a byte
            order other than the machine's: torch reads native values only).
    """
    found = TORCH_DTYPES.get(dtype)
    if found is None:
        raise ConfigError(f"dtype {np.dtype(dtype)} has no torch equivalent; use bool, int, uint or "
                          "float in the machine's byte order")
    return found


def torch_views(layout: RecordLayout, records: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors ``{part name: [n, *shape]}`` of contiguous uint8 records ``[n, record_bytes]``
    (any device): strided views sharing the records' memory, no copies."""
    n = records.shape[0]
    return {p.name: records[:, p.offset:p.end].view(torch_dtype(p.dtype)).view(n, *p.shape)
            for p in layout.parts}
