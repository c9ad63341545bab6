"""Window records as fixed-size byte rows, for exchanging sampled items between ranks.

One record holds one window: every user field ``[L, *shape]``, ``step_type``,
``discount``, ``episode_id``, the mask, the key and the owner's local probability.
All ranks derive the same layout from the spec and the window, so only counts travel
before the data, and a batch needs one data exchange. Every part starts at a multiple of
8 bytes and a record is a multiple of 8 bytes long, so the receiver reads each part as a
strided view of the received bytes instead of copying it out.
"""

from __future__ import annotations

import numpy as np
import torch

from shardreplay.spec import Spec
from shardreplay.spec.spec import DISCOUNT_DTYPE, STEP_TYPE_DTYPE

_TORCH_DTYPES = {np.dtype(d): t for d, t in (
    (np.bool_, torch.bool), (np.uint8, torch.uint8), (np.int8, torch.int8),
    (np.int16, torch.int16), (np.int32, torch.int32), (np.int64, torch.int64),
    (np.uint16, torch.uint16), (np.uint32, torch.uint32), (np.uint64, torch.uint64),
    (np.float16, torch.float16), (np.float32, torch.float32), (np.float64, torch.float64))}


_ALIGN = 8  # the largest itemsize: every part's view is aligned


class RecordLayout:
    """Byte offsets of each part of a window record.

    Args:
        spec: the buffer's spec.
        window: the window length ``L``.
    """

    def __init__(self, spec: Spec, window: int) -> None:
        parts: list[tuple[str, np.dtype, tuple[int, ...]]] = [
            (f"data.{name}", f.dtype, (window, *f.shape)) for name, f in spec.fields.items()]
        parts += [("data.step_type", STEP_TYPE_DTYPE, (window,)),
                  ("data.discount", DISCOUNT_DTYPE, (window,)),
                  ("data.episode_id", np.dtype(np.int64), (window,)),
                  ("mask", np.dtype(np.bool_), (window,)),
                  ("key", np.dtype(np.int64), ()),
                  ("probability", np.dtype(np.float64), ())]
        self.parts = []
        offset = 0
        for name, dtype, shape in parts:
            nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            self.parts.append((name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.record_bytes = max(offset, _ALIGN)
        # Byte offset in a record of each window array the storage fills (``data.`` parts,
        # by storage name: the user's fields, ``step_type``, ``discount``, ``episode_id``).
        self.data_offsets = {name[len("data."):]: offset for name, _d, _s, offset, _n in self.parts
                             if name.startswith("data.")}

    def views(self, records: np.ndarray) -> dict[str, np.ndarray]:
        """Numpy views ``{part name: [n, *shape]}`` of records ``[n, record_bytes]`` (uint8,
        C-contiguous), for writing parts in place."""
        n = records.shape[0]
        return {name: records[:, offset:offset + nbytes].view(dtype).reshape((n, *shape), copy=False)
                for name, dtype, shape, offset, nbytes in self.parts}

    def unpack(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors ``{part name: [n, *shape]}`` from contiguous records ``[n, record_bytes]``
        (any device): strided views sharing the records' memory, no copies."""
        n = records.shape[0]
        out = {}
        for name, dtype, shape, offset, nbytes in self.parts:
            raw = records[:, offset:offset + nbytes]
            out[name] = raw.view(_TORCH_DTYPES[dtype]).view(n, *shape)
        return out
