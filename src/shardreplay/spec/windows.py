"""Window records as fixed-size byte rows: how sampled windows cross between ranks and
onto a GPU (one copy of the rows instead of one per field). Every rank derives the same
:class:`~shardreplay.spec.layout.RecordLayout` from the spec and the window, so only
counts travel before the data, and the receiver reads each part as a strided view
(:func:`~shardreplay.spec.torch_dtypes.torch_views`) instead of copying it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import numpy as np

from shardreplay.spec.layout import RecordLayout, step_parts
from shardreplay.spec.spec import Spec

__all__ = ["DATA", "data_parts", "window_layout"]

DATA = "data."  # prefix of the parts the storage fills: user fields, step_type, discount, episode_id


def window_layout(spec: Spec, window: int) -> RecordLayout:
    """The record of one sampled window of ``spec`` and length ``window``: parts
    ``data.<field>`` ``[L, *shape]`` (user fields, ``step_type``, ``discount``,
    ``episode_id``; ``[1, *shape]`` for an ``at_starts`` field), ``mask`` ``[L]``,
    ``key`` and ``probability``.

    ``layout.offsets(DATA)`` is what ``gather_into`` takes; ``layout.views(records)``
    and ``torch_views(layout, records)`` read the parts back.
    """
    per_window = {name: f for name, f in spec.fields.items() if not f.at_starts}
    parts = step_parts(per_window, (window,), DATA)
    # An at_starts field is sampled at the window's first step only: [1, *shape].
    parts += [(DATA + name, f.dtype, (1, *f.shape)) for name, f in spec.fields.items() if f.at_starts]
    parts += [(DATA + "episode_id", np.dtype(np.int64), (window,)),
              ("mask", np.dtype(np.bool_), (window,)),
              ("key", np.dtype(np.int64), ()),
              ("probability", np.dtype(np.float64), ())]
    return RecordLayout.pack(parts)


_V = TypeVar("_V")


def data_parts(parts: Mapping[str, _V]) -> dict[str, _V]:
    """The ``data.<field>`` parts of a window record's views, by field name."""
    return {name[len(DATA):]: v for name, v in parts.items() if name.startswith(DATA)}
