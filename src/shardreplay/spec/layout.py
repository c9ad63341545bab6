"""Where named arrays sit in one fixed-size byte record: the one layout builder of the
chunk wire format, the sampling exchange and packed validation (docs/internals.md, "Byte
records")."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shardreplay.spec.fields import Field

__all__ = ["ALIGN", "DATA", "DISCOUNT_DTYPE", "STEP_TYPE_DTYPE", "Part", "RecordLayout", "aligned",
           "step_parts", "window_layout"]

ALIGN = 8  # the largest itemsize: every array's view is aligned
STEP_TYPE_DTYPE = np.dtype(np.uint8)
DISCOUNT_DTYPE = np.dtype(np.float32)


@dataclass(frozen=True)
class Part:
    """One array of a record: ``count`` values of ``dtype`` (``nbytes`` bytes, padding
    not counted) shaped ``shape``, from byte ``offset``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    count: int
    nbytes: int

    @property
    def end(self) -> int:
        """Byte offset just past the values."""
        return self.offset + self.nbytes


@dataclass(frozen=True)
class RecordLayout:
    """Named arrays at fixed byte offsets in a record of ``record_bytes`` bytes.

    Build one with :meth:`pack`. Attributes:
        parts: every array, in record order.
        record_bytes: the record's length, a multiple of :data:`ALIGN`.
    """

    parts: tuple[Part, ...]
    record_bytes: int

    @classmethod
    def pack(cls, arrays: Iterable[tuple[str, np.dtype, tuple[int, ...]]]) -> RecordLayout:
        """Place ``(name, dtype, shape)`` arrays in order, each at the next multiple of
        :data:`ALIGN`; the record ends at the next multiple after the last one.

        Raises:
            ValueError: a name appears twice.
        """
        parts, offset = [], 0
        for name, dtype, shape in arrays:
            dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
            count = math.prod(shape)
            part = Part(name, dtype, shape, aligned(offset), count, count * dtype.itemsize)
            parts.append(part)
            offset = part.end
        if len({p.name for p in parts}) != len(parts):
            raise ValueError(f"record parts need distinct names, got {[p.name for p in parts]}")
        return cls(tuple(parts), aligned(offset))

    def offsets(self, prefix: str = "") -> dict[str, int]:
        """``{name without prefix: byte offset}`` of the parts whose name starts with ``prefix``."""
        return {p.name[len(prefix):]: p.offset for p in self.parts if p.name.startswith(prefix)}

    @functools.cached_property
    def dtype(self) -> np.dtype:
        """A record as a numpy structured dtype: each part a field at its offset."""
        return np.dtype({"names": [p.name for p in self.parts], "offsets": [p.offset for p in self.parts],
                         "formats": [(p.dtype, p.shape) for p in self.parts], "itemsize": self.record_bytes})

    def views(self, records: np.ndarray) -> dict[str, np.ndarray]:
        """Views ``{name: [n, *shape]}`` of C-contiguous uint8 records ``[n, record_bytes]``
        (strided, sharing the records' memory: writes land in the records)."""
        rows = records.view(self.dtype)[:, 0]  # one field lookup per part, no slicing
        return {p.name: rows[p.name] for p in self.parts}

    def arrays(self, payload: np.ndarray, prefix: str = "") -> dict[str, np.ndarray]:
        """Views ``{name without prefix: [*shape]}`` of one record at the start of a 1-D
        uint8 ``payload``, for the parts whose name starts with ``prefix`` (no copy; as
        writable as ``payload``)."""
        data = payload.data
        return {p.name[len(prefix):]: np.ndarray(p.shape, p.dtype, data, p.offset)
                for p in self.parts if p.name.startswith(prefix)}


def step_parts(fields: Mapping[str, Field], lead_shape: tuple[int, ...],
               prefix: str = "") -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The arrays of steps of ``lead_shape``: every user field (spec order), then
    ``step_type`` and ``discount``, named ``prefix + name``, ready for :meth:`RecordLayout.pack`."""
    lead = tuple(lead_shape)
    arrays = [(prefix + name, f.dtype, (*lead, *f.shape)) for name, f in fields.items()]
    arrays += [(prefix + "step_type", STEP_TYPE_DTYPE, lead), (prefix + "discount", DISCOUNT_DTYPE, lead)]
    return arrays


DATA = "data."  # prefix of the parts the storage fills: user fields, step_type, discount, episode_id


class HasFields(Protocol):
    """What :func:`window_layout` reads of a :class:`~shardreplay.spec.Spec`."""

    @property
    def fields(self) -> Mapping[str, Field]: ...


def window_layout(spec: HasFields, window: int) -> RecordLayout:
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


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN
