"""Chunks of steps and their wire format (no pickle).

A **chunk** is what an actor ships: ``T`` consecutive steps of each of its ``S`` streams,
the policy version that made them and, optionally, Ape-X style initial priorities.

Wire layout (all integers little-endian)::

    offset 0   magic  b"SRCK"                                  4 bytes
           4   format version (uint8) + 3 zero bytes           4 bytes
           8   header_len (uint32): bytes of msgpack header    4 bytes
          12   total_len (uint64): bytes of the whole chunk    8 bytes
          20   4 zero bytes                                    4 bytes
          24   XXH3-64 (seed 0) of every byte after offset 32  8 bytes
          32   actor id, sequence, policy version (uint64)    24 bytes
          56   msgpack header, zero padding to a multiple of 8
           P   payload: the raw arrays, each 8-byte aligned, in header order,
               zero padding to a multiple of 8

The header is a map of exactly ``fp`` (spec fingerprint), ``S``, ``T`` and ``arrays``: a
list of ``[name, dtype, shape, offset, nbytes]`` with offsets relative to ``P``. It is
the same for every chunk of one spec and size, so a reader checks each distinct header
once and recognises it by its bytes afterwards (the ids, which change every chunk, sit
in the prefix). Arrays are ``stream_ids`` (int64 ``[S]``), one
per step field (``steps/<name>``, shaped ``[S, T, *field.shape]``) and, when present,
``priorities`` (float32 ``[S, T]``).

The checksum covers header, padding and payload, and every prefix field is checked on
its own, so a damaged byte is detected (XXH3-64 misses a random corruption with
probability 2^-64). Format 1 used zlib's CRC-32 and format 2 XXH64, 20 and 7 times
slower than XXH3 on a 70 KB chunk (:mod:`shardreplay._hashing`); their chunks are
rejected with a reason that says so. Sizes in the header are checked against the spec
and the bytes actually present before anything is allocated, and decoded arrays are
zero-copy, read-only views of the input, validated once, every value in one compiled
pass (:meth:`Spec.validated_packed`: a buffer's ``extend`` does not check them again).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from shardreplay._hashing import xxh3_64
from shardreplay.errors import CorruptChunkError, SpecMismatchError
from shardreplay.spec import Spec

__all__ = ["FORMAT_VERSION", "MAGIC", "Chunk", "Encoding", "decode", "encode", "peek_identity"]

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
_RESERVED_DTYPES = {"step_type": np.dtype(np.uint8), "discount": np.dtype(np.float32)}


@dataclass(frozen=True, eq=False)
class Chunk:
    """``T`` steps of each of an actor's ``S`` streams.

    Attributes:
        actor_id: the sending actor, >= 0.
        sequence: per actor, strictly increasing over the actor's whole life, also across
            restarts under the same id (continue from a saved value or start from a clock
            reading); readers drop a repeated ``(actor_id, sequence)`` as a duplicate.
        policy_version: version of the policy that acted, >= 0.
        stream_ids: int64 ``[S]``, the actor's own stream numbers, distinct, >= 0.
        steps: every user field of the Spec (dotted names) plus ``"step_type"`` (uint8)
            and ``"discount"`` (float32), each shaped ``[S, T, *field_shape]``.
        priorities: optional float32 ``[S, T]`` initial priorities, finite and >= 0.
    """

    actor_id: int
    sequence: int
    policy_version: int
    stream_ids: np.ndarray
    steps: Mapping[str, np.ndarray]
    priorities: np.ndarray | None = None

    @property
    def num_streams(self) -> int:
        """``S``: streams in this chunk."""
        return int(self.stream_ids.shape[0])

    @property
    def num_steps(self) -> int:
        """``T``: steps per stream in this chunk."""
        return int(self.steps["step_type"].shape[1])

    @property
    def identity(self) -> tuple[int, int]:
        """``(actor_id, sequence)``: what duplicates are recognised by."""
        return (self.actor_id, self.sequence)


def _wire_dtype(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<")  # the wire is little-endian; one-byte types stay "|"


def _align8(n: int) -> int:
    return (n + 7) & ~7


class _SpecInfo:
    """What the codec needs of a spec, computed once per Spec object (hashing is slow)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec  # held so that id(spec) is not reused while cached
        self.fingerprint = spec.fingerprint
        self.fields = [(_STEP_PREFIX + n, _wire_dtype(spec[n].dtype), spec[n].shape) for n in spec.names]
        self.fields += [(_STEP_PREFIX + n, _wire_dtype(d), ()) for n, d in _RESERVED_DTYPES.items()]
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
        arrays = [("stream_ids", np.dtype("<i8"), (s,))]
        arrays += [(name, dtype, (s, t, *shape)) for name, dtype, shape in info.fields]
        if has_priorities:
            arrays.append(("priorities", np.dtype("<f4"), (s, t)))
        self.entries: list[list[Any]] = []  # exactly what the header's "arrays" must hold
        self.views: list[tuple[str, np.dtype, int, int, tuple[int, ...]]] = []
        offset = 0
        for name, dtype, shape in arrays:
            offset = _align8(offset)
            count = math.prod(shape)
            self.entries.append([name, dtype.str, list(shape), offset, count * dtype.itemsize])
            self.views.append((name, dtype, count, offset, shape))
            offset += count * dtype.itemsize
        self.nbytes = _align8(offset)  # whole chunks are 8-byte multiples: records packed
        # back to back (the local ring) keep every array aligned
        # The steps as the spec lays them out in the payload, checked in one compiled
        # pass on decode (None: a field type without a compiled check, e.g. finite float16).
        self.packed = info.spec.packed_layout(
            (s, t), {name[len(_STEP_PREFIX):]: off for name, _d, _c, off, _s in self.views
                     if name.startswith(_STEP_PREFIX)})
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


def _layout(spec: Spec, s: int, t: int, has_priorities: bool) -> _Layout:
    info = _info(spec)
    key = (s, t, has_priorities)
    layout = info.layouts.get(key)
    if layout is None:
        if len(info.layouts) > 256:
            info.layouts.clear()
        layout = info.layouts[key] = _Layout(info, s, t, has_priorities)
    return layout


def encode(chunk: Chunk, spec: Spec) -> bytes:
    """Serialise a chunk for the wire or a file.

    The steps are validated with ``spec.validate`` first, so a bad actor fails where the
    bug is, not at the learner.

    Raises:
        SpecMismatchError: the steps, stream ids or priorities do not fit ``spec``, or an
            id is negative or too large.
    """
    enc = Encoding(chunk, spec)
    out = bytearray(enc.nbytes)
    enc.write_into(out)
    return bytes(out)  # redis-py and hashing callers want bytes; a 70 KB copy is ~2 us


class Encoding:
    """A chunk checked and ready to be written where the caller wants it (:func:`encode`
    writes it to new bytes; the local transport writes it straight into its ring).

    Raises:
        SpecMismatchError: as :func:`encode`.
    """

    __slots__ = ("_arrays", "_chunk", "_layout", "nbytes")

    def __init__(self, chunk: Chunk, spec: Spec) -> None:
        _check_ids(chunk.actor_id, chunk.sequence, chunk.policy_version, exc=SpecMismatchError)
        ids = np.asarray(chunk.stream_ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise SpecMismatchError(f"stream_ids must be a 1-d integer array, "
                                    f"got {ids.dtype}{list(ids.shape)}")
        s = int(ids.shape[0])
        st = np.asarray(chunk.steps.get("step_type", np.empty((0, 0))))
        if st.ndim != 2 or st.shape[0] != s:
            raise SpecMismatchError(f"steps['step_type'] must be shaped [S={s}, T], got {list(st.shape)}")
        t = int(st.shape[1])
        if not (1 <= s <= _MAX_DIM and 1 <= t <= _MAX_DIM):
            raise SpecMismatchError(f"a chunk needs 1 to {_MAX_DIM} streams and steps, got S={s}, T={t}")
        steps = spec.validate(chunk.steps, (s, t))
        arrays: dict[str, np.ndarray] = {"stream_ids": ids}
        arrays.update({_STEP_PREFIX + k: v for k, v in steps.items()})
        if chunk.priorities is not None:
            prio = np.asarray(chunk.priorities)
            if prio.dtype.kind not in "fiu":
                raise SpecMismatchError(f"priorities must be numbers, got {prio.dtype}")
            with np.errstate(over="ignore"):  # an overflow becomes inf, rejected just below
                arrays["priorities"] = prio.astype(np.float32, copy=False)
        _check_ids_and_priorities(ids, arrays.get("priorities"), s, t, exc=SpecMismatchError)
        self._chunk, self._arrays = chunk, arrays
        self._layout = _layout(spec, s, t, chunk.priorities is not None)
        self.nbytes = self._layout.payload_at + self._layout.nbytes

    def write_into(self, out: bytearray | memoryview | np.ndarray) -> None:
        """Write the encoded chunk to the first :attr:`nbytes` bytes of a writable buffer
        (any previous content: every padding byte is written too)."""
        layout, chunk = self._layout, self._chunk
        raw = np.frombuffer(out, np.uint8, self.nbytes)
        header, payload_at = layout.header, layout.payload_at
        raw[_PREFIX.size:_PREFIX.size + len(header)] = np.frombuffer(header, np.uint8)
        for start, stop in layout.gaps:  # zero padding, whatever was there before
            raw[start:stop] = 0
        for name, dtype, _count, offset, shape in layout.views:  # one copy of each array
            np.ndarray(shape, dtype, raw, payload_at + offset)[...] = self._arrays[name]
        _PREFIX.pack_into(raw, 0, MAGIC, FORMAT_VERSION, len(header), self.nbytes, 0, int(chunk.actor_id),
                          int(chunk.sequence), int(chunk.policy_version))
        _DIGEST.pack_into(raw, _DIGEST_AT, xxh3_64(raw[_HASHED_FROM:]))


def _check_ids(actor_id: Any, sequence: Any, version: Any, *, exc: type[Exception]) -> None:
    for label, v in (("actor_id", actor_id), ("sequence", sequence), ("policy_version", version)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 0 <= int(v) <= _MAX_ID:
            raise _make(exc, f"{label} must be an integer in [0, 2**63), got {v!r}", "header")


def _check_ids_and_priorities(ids: np.ndarray, prio: np.ndarray | None, s: int, t: int, *,
                              exc: type[Exception]) -> None:
    listed = ids.tolist()
    if s and (min(listed) < 0 or max(listed) > _MAX_ID or len(set(listed)) != s):
        raise _make(exc, "stream_ids must be distinct and in [0, 2**63)", "values")
    if prio is None:
        return
    if prio.shape != (s, t) or prio.dtype.kind != "f":
        raise _make(exc, f"priorities must be float [{s}, {t}], got {prio.dtype}{list(prio.shape)}", "values")
    if prio.size and not (np.isfinite(prio).all() and prio.min() >= 0):
        raise _make(exc, "priorities must be finite and >= 0", "values")


def _make(exc: type[Exception], message: str, reason: str) -> Exception:
    if issubclass(exc, CorruptChunkError):
        return exc(message, reason=reason)
    return exc(message)


def peek_identity(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """``(actor_id, sequence)`` from a chunk's header without checking anything else.

    Cheap (reads the header only); for logging and duplicate screening before a full
    :func:`decode`. Returns None when the header cannot be read.
    """
    try:
        magic, version, *_, actor, sequence, _pv = _PREFIX.unpack_from(memoryview(data).cast("B"))
        if magic != MAGIC or version != FORMAT_VERSION:
            return None
        return (actor, sequence)
    except Exception:  # any malformed input means "unknown", never an exception here
        return None


def decode(data: bytes | bytearray | memoryview, spec: Spec, *, max_bytes: int) -> Chunk:
    """Parse and fully validate a chunk against the learner's spec.

    Args:
        data: the encoded chunk. Decoded arrays are read-only views into it.
        spec: the learner's spec; the chunk's fingerprint, dtypes and shapes must match.
        max_bytes: chunks longer than this are rejected before anything else.

    Raises:
        CorruptChunkError: with ``reason`` one of ``too_large``, ``truncated``,
            ``format``, ``checksum``, ``header``, ``spec``, ``values``.
    """
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    if not mv.readonly:
        mv = mv.toreadonly()  # every view below is read-only, whoever owns the memory
    n = len(mv)
    if n > max_bytes:
        raise CorruptChunkError(f"chunk of {n} bytes exceeds max_bytes={max_bytes}", reason="too_large")
    if n < _PREFIX.size:
        raise CorruptChunkError(f"chunk of {n} bytes is shorter than its {_PREFIX.size}-byte prefix",
                                reason="truncated")
    magic, version, zero3, hlen, total, zero4, digest, actor, sequence, policy = _PREFIX_READ.unpack_from(mv)
    if magic != MAGIC or version != FORMAT_VERSION or zero3 != b"\0\0\0" or zero4 != b"\0\0\0\0":
        raise _format_error(magic, version)
    if total != n:
        raise CorruptChunkError(f"chunk says it has {total} bytes but {n} arrived "
                                "(truncated or padded in transit)", reason="truncated")
    if xxh3_64(mv[_HASHED_FROM:]) != digest:
        raise CorruptChunkError("checksum mismatch: the chunk was damaged in transit or on disk",
                                reason="checksum")
    payload_at = (_PREFIX.size + hlen + 7) & ~7
    if hlen > _MAX_HEADER_BYTES or payload_at > n:
        raise CorruptChunkError(f"header length {hlen} is impossible", reason="header")
    if actor > _MAX_ID or sequence > _MAX_ID or policy > _MAX_ID:  # unsigned: never negative
        _check_ids(actor, sequence, policy, exc=CorruptChunkError)  # raises, naming the id
    info = _info(spec)
    raw = bytes(mv[_PREFIX.size:_PREFIX.size + hlen])
    layout = info.headers.get(raw)
    if layout is None:  # a header not seen yet: check it in full, once
        layout = _checked_layout(_unpack_header(raw), spec)
        if len(info.headers) > 256:
            info.headers.clear()
        info.headers[raw] = layout
    if layout.nbytes != n - payload_at:
        raise CorruptChunkError(f"the arrays need {layout.nbytes} bytes, the chunk has {n - payload_at}",
                                reason="header")
    payload = np.frombuffer(mv, np.uint8, offset=payload_at)  # read-only: mv is
    ids_at = payload_at + layout.ids_at
    ids = np.ndarray((layout.s,), _IDS_DTYPE, mv, ids_at)
    # Actors send the same stream ids chunk after chunk: ids checked once are recognised
    # by their bytes (a bounded set) instead of being checked again.
    ids_raw = bytes(mv[ids_at:ids_at + 8 * layout.s])
    if layout.prio_at >= 0:
        prio = np.ndarray((layout.s, layout.t), _PRIO_DTYPE, mv, payload_at + layout.prio_at)
        _check_ids_and_priorities(ids, prio, layout.s, layout.t, exc=CorruptChunkError)
    else:
        prio = None
        if ids_raw not in layout.good_ids:
            _check_ids_and_priorities(ids, None, layout.s, layout.t, exc=CorruptChunkError)
            if len(layout.good_ids) >= 1024:
                layout.good_ids.clear()
            layout.good_ids.add(ids_raw)
    try:
        if layout.packed is not None:
            steps = spec.validated_packed(payload, layout.packed)
        else:
            steps = spec.validated({name[len(_STEP_PREFIX):]: np.ndarray(shape, dtype, payload.data, offset)
                                    for name, dtype, _count, offset, shape in layout.views
                                    if name.startswith(_STEP_PREFIX)}, (layout.s, layout.t))
    except SpecMismatchError as exc:
        raise CorruptChunkError(f"chunk values do not fit the spec: {exc}", reason="values") from exc
    return Chunk(actor_id=actor, sequence=sequence, policy_version=policy, stream_ids=ids,
                 steps=steps, priorities=prio)


def _format_error(magic: bytes, version: int) -> CorruptChunkError:
    """Why a prefix is not one of this format (wrong magic, version or reserved bytes)."""
    if magic != MAGIC:
        return CorruptChunkError(f"not a shardreplay chunk (magic {bytes(magic)!r})", reason="format")
    older = (f" (an older shardreplay, {_OLDER[version]} checksums): upgrade the actors"
             if version in _OLDER else "")
    return CorruptChunkError(f"chunk of format {version}{older}; this reader reads format "
                             f"{FORMAT_VERSION} only", reason="format")


def _unpack_header(raw: memoryview) -> dict[str, Any]:
    try:
        head = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=1 << 16,
                               max_bin_len=0, max_array_len=1 << 16, max_map_len=64, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CorruptChunkError(f"unreadable chunk header: {exc}", reason="header") from exc
    if not isinstance(head, dict):
        raise CorruptChunkError("chunk header is not a map", reason="header")
    return head


def _checked_layout(head: dict[str, Any], spec: Spec) -> _Layout:
    """Check a header against the layout the spec expects for its sizes; return that layout."""
    if head.get("fp") != _info(spec).fingerprint:
        raise CorruptChunkError(f"chunk of spec {head.get('fp')!r} does not match the learner's spec "
                                f"{_info(spec).fingerprint!r}: actors and learner must use the same Spec",
                                reason="spec")
    if head.keys() != _HEADER_KEYS:
        raise CorruptChunkError(f"header has keys {sorted(map(str, head))}, expected {sorted(_HEADER_KEYS)}",
                                reason="header")
    s, t, entries = head.get("S"), head.get("T"), head.get("arrays")
    for label, v in (("S", s), ("T", t)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _MAX_DIM:
            raise CorruptChunkError(f"header {label}={v!r} is not a sane size", reason="header")
    if not isinstance(entries, list) or not entries:
        raise CorruptChunkError("header lacks its array table", reason="header")
    has_prio = any(isinstance(e, list) and e and e[0] == "priorities" for e in entries)
    layout = _layout(spec, s, t, has_prio)  # type: ignore[arg-type]
    if entries != layout.entries:
        bad = next((e, x) for e, x in zip([*entries, None], [*layout.entries, None], strict=False) if e != x)
        raise CorruptChunkError(f"array entry {bad[0]!r} does not match the spec's {bad[1]!r}",
                                reason="header")
    return layout
