"""The chunk wire format's constants and layouts: where every array of a chunk of one
spec and size sits, computed once per (spec, S, T, priorities) and cached
(:mod:`shardreplay.transport.codec` encodes and decodes with them).
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from shardreplay.errors import CorruptChunkError
from shardreplay.spec import Spec
from shardreplay.spec.layout import ALIGN, RecordLayout, step_parts
from shardreplay.spec.validation import packed_steps

__all__ = ["FORMAT_VERSION", "MAGIC"]

MAGIC = b"SRCK"
FORMAT_VERSION = 3  # 1: CRC-32, 2: XXH64 checksums (rejected: see the module doc)
_OLDER = {1: "CRC-32", 2: "XXH64"}
_PREFIX = struct.Struct("<4sB3xIQ4xQQQQ")
_PREFIX_READ = struct.Struct("<4sB3sIQ4sQQQQ")  # the same, zero bytes returned for checking
_HEADER_KEYS = frozenset(("fp", "S", "T", "arrays"))
_DIGEST, _DIGEST_AT, _HASHED_FROM = struct.Struct("<Q"), 24, 32  # the checksum covers the ids too
_MAX_HEADER_BYTES = 1 << 20
_MAX_DIM = 1 << 24  # S or T beyond this is a corrupt header, not a real chunk
_MAX_ID = (1 << 63) - 1
_STEP_PREFIX = "steps/"
_IDS_DTYPE, _PRIO_DTYPE = np.dtype("<i8"), np.dtype("<f4")


def _wire_dtype(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<")  # the wire is little-endian; one-byte types stay "|"


def _align8(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _SpecInfo:
    """What the codec needs of a spec, computed once per Spec object (hashing is slow)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec  # held so that id(spec) is not reused while cached
        self.fingerprint = spec.fingerprint
        # Each step array's name, wire dtype and shape of one step (a chunk adds [S, T]).
        self.fields = [(name, _wire_dtype(dtype), shape) for name, dtype, shape in
                       step_parts(spec.fields, (), _STEP_PREFIX)]
        self.layouts: dict[tuple[int, int, bool], _Layout] = {}  # live and die with this entry
        self.headers: dict[bytes, _Layout] = {}  # header bytes already checked -> their layout


_SPEC_INFO: dict[int, _SpecInfo] = {}


def _info(spec: Spec) -> _SpecInfo:
    info = _SPEC_INFO.get(id(spec))
    if info is None or info.spec is not spec:
        if len(_SPEC_INFO) > 64:
            _SPEC_INFO.clear()
        info = _SPEC_INFO[id(spec)] = _SpecInfo(spec)
    return info


class _Layout:
    """Where every array of a chunk of one spec and size sits, computed once and cached."""

    def __init__(self, info: _SpecInfo, s: int, t: int, has_priorities: bool) -> None:
        arrays: list[tuple[str, np.dtype, tuple[int, ...]]] = [("stream_ids", _IDS_DTYPE, (s,))]
        arrays += [(name, dtype, (s, t, *shape)) for name, dtype, shape in info.fields]
        if has_priorities:
            arrays.append(("priorities", _PRIO_DTYPE, (s, t)))
        # Whole chunks are 8-byte multiples: chunks packed back to back (the local ring)
        # keep every array aligned.
        self.record = RecordLayout.pack(arrays)
        parts = self.record.parts
        self.entries: list[list[Any]] = [  # exactly what the header's "arrays" must hold
            [p.name, p.dtype.str, list(p.shape), p.offset, p.nbytes] for p in parts]
        self.views = [(p.name, p.dtype, p.count, p.offset, p.shape) for p in parts]
        self.nbytes = self.record.record_bytes
        # The steps' value checks, one compiled pass on decode (None: a field type without
        # a compiled check, e.g. finite float16).
        self.packed = packed_steps(info.spec, self.record, _STEP_PREFIX, (s, t))
        self.s, self.t = s, t
        self.ids_at = self.views[0][3]
        self.prio_at = self.views[-1][3] if has_priorities else -1
        self.good_ids: set[bytes] = set()  # stream ids (as bytes) that passed their checks
        self.header = msgpack.packb({"fp": info.fingerprint, "S": s, "T": t, "arrays": self.entries})
        self.payload_at = _align8(_PREFIX.size + len(self.header))
        # Padding byte ranges of a whole chunk: after the header, between arrays, at the end.
        at = self.payload_at
        ends = [_PREFIX.size + len(self.header)]
        ends += [at + off + c * d.itemsize for _n, d, c, off, _s in self.views]
        starts = [at] + [at + off for _n, _d, _c, off, _s in self.views[1:]] + [at + self.nbytes]
        self.gaps = [(a, b) for a, b in zip(ends, starts, strict=True) if b > a]
        # For the encoder: the header with its zero padding as one block, the other gaps,
        # and each array's key in a chunk (a bare step name, "stream_ids", "priorities").
        block = np.zeros(self.payload_at - _PREFIX.size, np.uint8)
        block[:len(self.header)] = np.frombuffer(self.header, np.uint8)
        self.head_block = block
        self.tail_gaps = [(a, b) for a, b in self.gaps if a >= self.payload_at]
        self.copies = [(name.removeprefix(_STEP_PREFIX), dtype, at + off, shape)
                       for name, dtype, _c, off, shape in self.views]
        # Every step field with the spec's own dtype and full shape: steps that match
        # these exactly need no cast, only their values checked (in the packed bytes).
        self.exact = tuple(step_parts(info.spec.fields, (s, t)))


def _layout(spec: Spec, s: int, t: int, has_priorities: bool) -> _Layout:
    info = _info(spec)
    key = (s, t, has_priorities)
    layout = info.layouts.get(key)
    if layout is None:
        if len(info.layouts) > 256:
            info.layouts.clear()
        layout = info.layouts[key] = _Layout(info, s, t, has_priorities)
    return layout


def _unpack_header(raw: bytes) -> dict[str, Any]:
    """A chunk's msgpack header, bounded; CorruptChunkError (``header``) on garbage or a non-map."""
    try:
        head = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=1 << 16,
                               max_bin_len=0, max_array_len=1 << 16, max_map_len=64, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CorruptChunkError(f"unreadable chunk header: {exc}", reason="header") from exc
    if not isinstance(head, dict):
        raise CorruptChunkError("chunk header is not a map", reason="header")
    return head
