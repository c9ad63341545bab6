"""Chunks of steps (:class:`Chunk`: what an actor ships), their wire format and its packed
form (no pickle). The byte layouts of a chunk (``SRCK``) and of a packed chunk (``SRCZ``),
and the header's rules: docs/transports.md, "Chunks" and "Packed chunks". Decoded arrays
are read-only views of the input, every value checked in one compiled pass
(:mod:`shardreplay.spec.validation`).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from shardreplay._hashing import xxh3_64
from shardreplay.errors import ConfigError, CorruptChunkError, SpecMismatchError
from shardreplay.spec import Spec
from shardreplay.spec.layout import RecordLayout, aligned, step_parts
from shardreplay.spec.validation import packed_steps

__all__ = ["CODECS", "FORMAT_VERSION", "MAGIC", "PACKED_MAGIC", "Chunk", "Encoding", "PackedEncoding",
           "check_codec", "decode", "encode", "is_packed", "pack", "peek_identity", "unpack",
           "wire_encoding"]

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
PACKED_MAGIC = b"SRCZ"
PACKING_VERSION = 1
CODECS = ("none", "lz4", "zstd")
_PACKED_HEAD = struct.Struct("<4sBB2xQQQQ")
_PACKED_FROM = 40  # the packed checksum covers every byte after it
_ZSTD_LEVEL = 1  # level 1: most of the ratio on frames at a fraction of level 3's CPU


class _SpecInfo:
    """What the codec needs of a spec, computed once per Spec object (hashing is slow)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec  # held so that id(spec) is not reused while cached
        self.fingerprint = spec.fingerprint
        # Each step array's name, wire dtype (little-endian; one-byte types stay "|") and
        # shape of one step (a chunk adds [S, T]).
        self.fields = [(name, dtype.newbyteorder("<"), shape) for name, dtype, shape in
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
        self.payload_at = at = aligned(_PREFIX.size + len(self.header))
        # For the encoder: the header with its zero padding as one block, the zero padding
        # between arrays and at the end, and each array's key in a chunk (a bare step
        # name, "stream_ids", "priorities").
        self.head_block = np.zeros(at - _PREFIX.size, np.uint8)
        self.head_block[:len(self.header)] = np.frombuffer(self.header, np.uint8)
        ends = [at + off + c * d.itemsize for _n, d, c, off, _s in self.views]
        starts = [at + off for _n, _d, _c, off, _s in self.views[1:]] + [at + self.nbytes]
        self.tail_gaps = [(a, b) for a, b in zip(ends, starts, strict=True) if b > a]
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
        wire: the bytes the chunk was decoded from, as received (packed or not; a view
            valid as long as the arrays are), so a learner can log them unchanged
            (:mod:`shardreplay.runtime.learner.wal`); None for a chunk built in memory.
    """

    actor_id: int
    sequence: int
    policy_version: int
    stream_ids: np.ndarray
    steps: Mapping[str, np.ndarray]
    priorities: np.ndarray | None = None
    wire: memoryview | None = field(default=None, repr=False)

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


def encode(chunk: Chunk, spec: Spec) -> bytes:
    """Serialise a chunk for the wire or a file, validated first (:class:`Encoding`), so a
    bad actor fails where the bug is, not at the learner.

    Raises:
        SpecMismatchError: the steps, stream ids or priorities do not fit ``spec``, or an
            id is negative or too large.
    """
    enc = Encoding(chunk, spec)
    out = bytearray(enc.nbytes)
    enc.write_into(out)
    return bytes(out)  # redis-py and hashing callers want bytes


class Encoding:
    """A chunk checked and ready to be written where the caller wants it (:func:`encode`
    writes it to new bytes; the local transport straight into its ring). Steps of the
    spec's exact dtypes and shapes (what actors build) have their values checked by
    :meth:`write_into`, in the decoder's compiled pass; anything else is validated (and
    cast) here.

    Raises:
        SpecMismatchError: as :func:`encode` (a bad value in exact-dtype steps: from
            :meth:`write_into`).
    """

    __slots__ = ("_arrays", "_chunk", "_layout", "_spec", "_unchecked", "nbytes")

    def __init__(self, chunk: Chunk, spec: Spec) -> None:
        actor, sequence, version = chunk.actor_id, chunk.sequence, chunk.policy_version
        if not (type(actor) is int and type(sequence) is int and type(version) is int
                and 0 <= actor <= _MAX_ID and 0 <= sequence <= _MAX_ID and 0 <= version <= _MAX_ID):
            _check_ids(actor, sequence, version, exc=SpecMismatchError)  # numpy ints, or raises
        ids = chunk.stream_ids
        if type(ids) is not np.ndarray:
            ids = np.asarray(ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise SpecMismatchError(f"stream_ids must be a 1-d integer array, "
                                    f"got {ids.dtype}{list(ids.shape)}")
        s = int(ids.shape[0])
        st = chunk.steps.get("step_type")
        st_shape = np.shape(st) if st is not None else (0, 0)
        if len(st_shape) != 2 or st_shape[0] != s:
            raise SpecMismatchError(f"steps['step_type'] must be shaped [S={s}, T], got {list(st_shape)}")
        t = int(st_shape[1])
        if not (1 <= s <= _MAX_DIM and 1 <= t <= _MAX_DIM):
            raise SpecMismatchError(f"a chunk needs 1 to {_MAX_DIM} streams and steps, got S={s}, T={t}")
        layout = _layout(spec, s, t, chunk.priorities is not None)
        steps = chunk.steps
        self._unchecked = layout.packed is not None and _exact(steps, layout.exact)
        arrays = dict(steps) if self._unchecked else spec.validate(steps, (s, t))
        arrays["stream_ids"] = ids
        prio = None
        if chunk.priorities is not None:
            prio = np.asarray(chunk.priorities)
            if prio.dtype.kind not in "fiu":
                raise SpecMismatchError(f"priorities must be numbers, got {prio.dtype}")
            with np.errstate(over="ignore"):  # an overflow becomes inf, rejected just below
                prio = arrays["priorities"] = prio.astype(np.float32, copy=False)
        key = ids.tobytes() if prio is None and ids.dtype == _IDS_DTYPE else None
        _check_ids_once(layout, ids, prio, key, exc=SpecMismatchError)
        self._chunk, self._arrays, self._layout, self._spec = chunk, arrays, layout, spec
        self.nbytes = layout.payload_at + layout.nbytes

    def write_into(self, out: bytearray | memoryview | np.ndarray) -> None:
        """Write the encoded chunk to the first :attr:`nbytes` bytes of a writable buffer
        (any previous content: every padding byte is written too).

        Raises:
            SpecMismatchError: exact-dtype steps hold a value the spec forbids (NaN in a
                finite field, a step type or discount out of range); the buffer then
                holds a partial chunk, and no checksum.
        """
        layout, chunk, arrays = self._layout, self._chunk, self._arrays
        raw = np.frombuffer(out, np.uint8, self.nbytes)
        payload_at = layout.payload_at
        raw[_PREFIX.size:payload_at] = layout.head_block  # header and its zero padding
        for start, stop in layout.tail_gaps:  # zero padding, whatever was there before
            raw[start:stop] = 0
        for key, dtype, at, shape in layout.copies:  # one copy of each array
            np.ndarray(shape, dtype, raw, at)[...] = arrays[key]
        if self._unchecked and layout.packed is not None:  # _unchecked implies packed
            layout.packed.check(self._spec, raw[payload_at:], chunk.steps)
        _PREFIX.pack_into(raw.data, 0, MAGIC, FORMAT_VERSION, len(layout.header), self.nbytes, 0,
                          int(chunk.actor_id), int(chunk.sequence), int(chunk.policy_version))
        _DIGEST.pack_into(raw.data, _DIGEST_AT, xxh3_64(raw[_HASHED_FROM:]))


class PackedEncoding:
    """A chunk packed for the wire (:func:`pack`), written where the caller wants it like
    an :class:`Encoding`.

    Raises:
        SpecMismatchError: as :func:`encode`.
        ConfigError: ``codec`` is unknown or its package is not installed.
    """

    __slots__ = ("_data", "nbytes")

    def __init__(self, chunk: Chunk, spec: Spec, codec: str) -> None:
        enc = Encoding(chunk, spec)
        # Only pack() reads the plain encoding (and copies what it keeps): a scratch buffer
        # of this thread, reused, spares two chunk-sized allocations (bench_ingest.py --ab).
        scratch = _scratch(enc.nbytes)
        enc.write_into(scratch)
        self._data = pack(scratch[:enc.nbytes], spec, codec)
        self.nbytes = len(self._data)

    def write_into(self, out: bytearray | memoryview | np.ndarray) -> None:
        """Write the packed chunk to the first :attr:`nbytes` bytes of ``out``."""
        np.frombuffer(out, np.uint8, self.nbytes)[:] = np.frombuffer(self._data, np.uint8)


def wire_encoding(chunk: Chunk, spec: Spec, compression: str) -> Encoding | PackedEncoding:
    """How a chunk crosses a file or network transport: packed (:func:`pack`) when
    ``compression`` is not ``"none"`` or ``spec`` has a ``frame_stack`` field (its new
    frames then travel once), else the plain encoding, byte for byte :func:`encode`'s.

    Raises:
        SpecMismatchError: as :func:`encode`.
        ConfigError: an unknown codec, or its package is missing.
    """
    if compression == "none" and not spec_has_frame_stacks(spec):
        return Encoding(chunk, spec)
    return PackedEncoding(chunk, spec, compression)


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """A writable buffer of at least ``nbytes``, this thread's own, reused by the next
    call (it keeps the largest size asked for)."""
    buf: bytearray | None = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = bytearray(nbytes)
    return memoryview(buf)


def spec_has_frame_stacks(spec: Spec) -> bool:
    """True when a field of ``spec`` is ``frame_stack``."""
    return any(f.frame_stack for f in spec.fields.values())


def _exact(steps: Mapping[str, Any], exact: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]) -> bool:
    """True when ``steps`` is a dict of exactly these arrays, each of this dtype and shape."""
    if type(steps) is not dict or len(steps) != len(exact):
        return False
    for name, dtype, shape in exact:
        v = steps.get(name)
        if type(v) is not np.ndarray or v.dtype != dtype or v.shape != shape:
            return False
    return True


def _check_ids_once(layout: _Layout, ids: np.ndarray, prio: np.ndarray | None, key: bytes | None, *,
                    exc: type[Exception]) -> None:
    """Check stream ids and priorities; skipped for stream ids whose bytes ``key`` passed
    before (actors send the same ids chunk after chunk); ``key`` None: always checked."""
    if key is not None and key in layout.good_ids:
        return
    s, t = layout.s, layout.t
    listed = ids.tolist()
    if s and (min(listed) < 0 or max(listed) > _MAX_ID or len(set(listed)) != s):
        raise _make(exc, "stream_ids must be distinct and in [0, 2**63)", "values")
    if prio is not None:
        if prio.shape != (s, t) or prio.dtype.kind != "f":
            raise _make(exc, f"priorities must be float [{s}, {t}], got {prio.dtype}{list(prio.shape)}",
                        "values")
        if prio.size and not (np.isfinite(prio).all() and prio.min() >= 0):
            raise _make(exc, "priorities must be finite and >= 0", "values")
    if key is not None:
        if len(layout.good_ids) >= 1024:
            layout.good_ids.clear()
        layout.good_ids.add(key)


def _check_ids(actor_id: Any, sequence: Any, version: Any, *, exc: type[Exception]) -> None:
    for label, v in (("actor_id", actor_id), ("sequence", sequence), ("policy_version", version)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 0 <= int(v) <= _MAX_ID:
            raise _make(exc, f"{label} must be an integer in [0, 2**63), got {v!r}", "header")


def _make(exc: type[Exception], message: str, reason: str) -> Exception:
    if issubclass(exc, CorruptChunkError):
        return exc(message, reason=reason)
    return exc(message)


def peek_identity(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """``(actor_id, sequence)`` from a chunk's prefix without checking anything else (for
    log lines about a chunk :func:`decode` refused); None when it cannot be read."""
    try:
        magic, version, *_, actor, sequence, _pv = _PREFIX.unpack_from(memoryview(data).cast("B"))
        if magic != MAGIC or version != FORMAT_VERSION:
            return None
        return (actor, sequence)
    except Exception:  # any malformed input means "unknown", never an exception here
        return None


def decode(data: bytes | bytearray | memoryview, spec: Spec, *, max_bytes: int) -> Chunk:
    """Parse ``data`` (an encoded chunk, or a packed one: :func:`unpack` first) and fully
    validate it against the learner's ``spec``, refusing more than ``max_bytes`` first.
    Decoded arrays are read-only views into the bytes.

    Raises:
        CorruptChunkError: with ``reason`` one of ``too_large``, ``truncated``,
            ``format``, ``checksum``, ``header``, ``spec``, ``values``.
    """
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    received = mv
    if mv[:4] == PACKED_MAGIC:
        mv = memoryview(unpack(mv, spec, max_bytes=max_bytes))
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
    payload_at = aligned(_PREFIX.size + hlen)
    if hlen > _MAX_HEADER_BYTES or payload_at > n:
        raise CorruptChunkError(f"header length {hlen} is impossible", reason="header")
    if actor > _MAX_ID or sequence > _MAX_ID or policy > _MAX_ID:  # unsigned: never negative
        _check_ids(actor, sequence, policy, exc=CorruptChunkError)  # raises, naming the id
    layout = _header_layout(bytes(mv[_PREFIX.size:_PREFIX.size + hlen]), spec)
    if layout.nbytes != n - payload_at:
        raise CorruptChunkError(f"the arrays need {layout.nbytes} bytes, the chunk has {n - payload_at}",
                                reason="header")
    payload = np.frombuffer(mv, np.uint8, offset=payload_at)  # read-only: mv is
    ids_at = payload_at + layout.ids_at
    ids = np.ndarray((layout.s,), _IDS_DTYPE, mv, ids_at)
    if layout.prio_at >= 0:
        prio = np.ndarray((layout.s, layout.t), _PRIO_DTYPE, mv, payload_at + layout.prio_at)
        _check_ids_once(layout, ids, prio, None, exc=CorruptChunkError)
    else:
        prio = None
        _check_ids_once(layout, ids, None, bytes(mv[ids_at:ids_at + 8 * layout.s]), exc=CorruptChunkError)
    try:
        if layout.packed is not None:
            steps = spec.validated_packed(payload, layout.packed)
        else:
            steps = spec.validated(layout.record.arrays(payload, _STEP_PREFIX), (layout.s, layout.t))
    except SpecMismatchError as exc:
        raise CorruptChunkError(f"chunk values do not fit the spec: {exc}", reason="values") from exc
    return Chunk(actor, sequence, policy, ids, steps, prio, received)


def _format_error(magic: bytes, version: int) -> CorruptChunkError:
    """Why a prefix is not one of this format (wrong magic, version or reserved bytes)."""
    if magic != MAGIC:
        return CorruptChunkError(f"not a shardreplay chunk (magic {bytes(magic)!r})", reason="format")
    older = (f" (an older shardreplay, {_OLDER[version]} checksums): upgrade the actors"
             if version in _OLDER else "")
    return CorruptChunkError(f"chunk of format {version}{older}; this reader reads format "
                             f"{FORMAT_VERSION} only", reason="format")


def _header_layout(raw: bytes, spec: Spec) -> _Layout:
    """The layout a chunk's header bytes name, checked against ``spec`` in full the first
    time these bytes are seen (CorruptChunkError ``spec`` or ``header`` when they do not fit)."""
    info = _info(spec)
    layout = info.headers.get(raw)
    if layout is None:
        try:
            head = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=1 << 16,
                                   max_bin_len=0, max_array_len=1 << 16, max_map_len=64, max_ext_len=0)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise CorruptChunkError(f"unreadable chunk header: {exc}", reason="header") from exc
        if not isinstance(head, dict):
            raise CorruptChunkError("chunk header is not a map", reason="header")
        layout = _checked_layout(head, spec)
        if len(info.headers) > 256:
            info.headers.clear()
        info.headers[raw] = layout
    return layout


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


# -- packed chunks ----------------------------------------------------------------------

@dataclass(frozen=True)
class _StackedArray:
    """Where one frame-stacked field's array sits in an encoded chunk."""

    offset: int  # from the start of the chunk
    nbytes: int
    steps: int  # S * T
    per_stream: int  # T: every T-th step starts a stream's run, sent whole
    stack: int  # K
    frame_bytes: int


def is_packed(data: bytes | bytearray | memoryview) -> bool:
    """True when ``data`` starts like a packed chunk (cheap: reads four bytes)."""
    return bytes(memoryview(data)[:4]) == PACKED_MAGIC


def check_codec(codec: str) -> str:
    """``codec`` if it is one of :data:`CODECS` and its package is installed.

    Raises:
        ConfigError: an unknown codec, or its package (``lz4``, ``zstandard``) is missing.
    """
    if codec not in CODECS:
        raise ConfigError(f"compression {codec!r} is not one of {', '.join(CODECS)}")
    if codec != "none":
        _module(codec)
    return codec


def pack(chunk: bytes | bytearray | memoryview, spec: Spec, codec: str = "lz4") -> bytes:
    """A packed form of an encoded chunk of ``spec``: frames once, then compressed.

    Raises:
        ConfigError: ``codec`` is unknown or its package is not installed.
        CorruptChunkError: ``chunk`` is not an encoded chunk of ``spec`` (its header
            does not parse as one).
    """
    check_codec(codec)
    raw = np.frombuffer(chunk, np.uint8)
    stacked = _stacked_arrays(raw, spec)
    parts: list[Any] = []
    at = 0
    for arr in stacked:
        parts.append(raw[at:arr.offset])
        at = arr.offset + arr.nbytes
    parts.append(raw[at:])
    for arr in stacked:
        parts.extend(_frames_once(raw[arr.offset:arr.offset + arr.nbytes], arr))
    body = b"".join(p.tobytes() if isinstance(p, np.ndarray) else p for p in parts)
    sent = _compress(codec, body)
    out = bytearray(_PACKED_FROM + len(sent))
    out[_PACKED_FROM:] = sent
    _PACKED_HEAD.pack_into(out, 0, PACKED_MAGIC, PACKING_VERSION, CODECS.index(codec), len(out), len(body),
                    len(raw), 0)
    struct.pack_into("<Q", out, 32, xxh3_64(memoryview(out)[_PACKED_FROM:]))
    return bytes(out)


def unpack(data: bytes | bytearray | memoryview, spec: Spec, *, max_bytes: int) -> memoryview:
    """The encoded chunk that :func:`pack` packed into ``data``; neither the packed bytes,
    the body nor the rebuilt chunk may exceed ``max_bytes`` (checked before allocating).

    Raises:
        CorruptChunkError: with ``reason`` ``too_large``, ``truncated``, ``format``,
            ``checksum`` or ``header``.
    """
    mv = memoryview(data).cast("B") if memoryview(data).ndim != 1 else memoryview(data)
    n = len(mv)
    if n > max_bytes:
        raise CorruptChunkError(f"chunk of {n} bytes exceeds max_bytes={max_bytes}", reason="too_large")
    if n < _PACKED_FROM:
        raise CorruptChunkError(f"packed chunk of {n} bytes is shorter than its header", reason="truncated")
    magic, version, codec_id, total, body_len, chunk_len, digest = _PACKED_HEAD.unpack_from(mv)
    if magic != PACKED_MAGIC or version != PACKING_VERSION or codec_id >= len(CODECS):
        raise CorruptChunkError(f"packed chunk of version {version}, codec {codec_id}: this reader reads "
                                f"version {PACKING_VERSION}, codecs {', '.join(CODECS)}", reason="format")
    if total != n:
        raise CorruptChunkError(f"packed chunk says {total} bytes but {n} arrived", reason="truncated")
    if xxh3_64(mv[_PACKED_FROM:]) != digest:
        raise CorruptChunkError("checksum mismatch: the packed chunk was damaged in transit or on disk",
                                reason="checksum")
    # The body adds one flag byte per step of a stacked field to what it keeps of the
    # chunk, so it never reaches twice the chunk's size.
    if chunk_len > max_bytes or body_len > 2 * chunk_len:
        raise CorruptChunkError(f"packed chunk rebuilds {chunk_len} bytes from a {body_len}-byte body "
                                f"(max_bytes={max_bytes})", reason="too_large")
    body = _decompress(CODECS[codec_id], mv[_PACKED_FROM:], body_len)
    return _rebuild(np.frombuffer(body, np.uint8), spec, chunk_len)


def _rebuild(body: np.ndarray, spec: Spec, chunk_len: int) -> memoryview:
    """Put the cut-out stacks back: the inverse of :func:`pack`'s body."""
    raw = np.empty(chunk_len, np.uint8)  # every byte is written below
    stacked = _stacked_arrays(body, spec)  # the body starts with the chunk's prefix and header
    src = dst = 0
    for arr in stacked:  # the arrays between the stacked ones, in order
        size = arr.offset - dst
        raw[dst:arr.offset] = _take(body, src, size)
        src, dst = src + size, arr.offset + arr.nbytes
    size = chunk_len - dst
    raw[dst:] = _take(body, src, size)
    src += size
    for arr in stacked:
        src = _stacks_back(body, src, raw[arr.offset:arr.offset + arr.nbytes], arr)
    if src != len(body):
        raise CorruptChunkError(f"packed body has {len(body) - src} bytes left over", reason="header")
    return raw.data


def _take(body: np.ndarray, at: int, size: int) -> np.ndarray:
    if size < 0 or at + size > len(body):
        raise CorruptChunkError("packed body is shorter than its chunk needs", reason="truncated")
    return body[at:at + size]


def _stacked_arrays(raw: np.ndarray, spec: Spec) -> list[_StackedArray]:
    """The frame-stacked arrays of an encoded chunk, by offset (read from its header)."""
    if len(raw) < _PREFIX.size:
        raise CorruptChunkError("not an encoded chunk: too short", reason="truncated")
    magic, _v, hlen, *_rest = _PREFIX.unpack_from(raw[:_PREFIX.size].tobytes())
    if magic != MAGIC:
        raise CorruptChunkError(f"not an encoded chunk (magic {bytes(magic)!r})", reason="format")
    layout = _header_layout(raw[_PREFIX.size:_PREFIX.size + hlen].tobytes(), spec)
    stacks = {f"{_STEP_PREFIX}{name}": f.stack_size for name, f in spec.fields.items() if f.frame_stack}
    out = []
    for name, dtype, count, offset, shape in layout.views:
        if name in stacks:
            frame = int(np.prod(shape[3:], dtype=np.int64)) * dtype.itemsize
            out.append(_StackedArray(layout.payload_at + offset, count * dtype.itemsize,
                                     layout.s * layout.t, layout.t, stacks[name], frame))
    return out


def _frames_once(block: np.ndarray, arr: _StackedArray) -> tuple[np.ndarray, np.ndarray]:
    """The continuation flags of every step and the frames to send, for one field."""
    x = block.reshape(arr.steps, arr.stack, arr.frame_bytes)
    cont = np.ones(arr.steps, np.bool_)  # one-frame stacks: every step's frame is new
    if arr.stack > 1:
        cont[1:] = (x[1:, :-1] == x[:-1, 1:]).all(axis=(1, 2))
    cont[::arr.per_stream] = False  # a stream's first step in the chunk: its whole stack
    keep = np.ones((arr.steps, arr.stack), np.bool_)
    keep[cont, :-1] = False
    return cont.view(np.uint8), x[keep]


def _stacks_back(body: np.ndarray, at: int, out: np.ndarray, arr: _StackedArray) -> int:
    """Rebuild one field's stacks into ``out`` from ``body`` at ``at``; the new offset."""
    flags = _take(body, at, arr.steps)
    if flags.max(initial=0) > 1 or flags[::arr.per_stream].any():
        raise CorruptChunkError("packed stack flags are damaged", reason="header")
    at += arr.steps
    added = np.where(flags == 1, 1, arr.stack)
    ends = np.cumsum(added)
    frames = int(ends[-1]) if arr.steps else 0
    src = _take(body, at, frames * arr.frame_bytes).reshape(frames, arr.frame_bytes)
    idx = (ends[:, None] - arr.stack + np.arange(arr.stack)).ravel()
    # In range by construction (each stream's first step sent its whole stack, checked
    # above): "clip" never clips, it spares the temporary copy that mode="raise" makes.
    np.take(src, idx, axis=0, out=out.reshape(-1, arr.frame_bytes), mode="clip")
    return at + frames * arr.frame_bytes


def _module(codec: str) -> Any:
    try:
        if codec == "lz4":
            import lz4.block

            return lz4.block
        import zstandard

        return zstandard
    except ImportError as exc:
        package = "lz4" if codec == "lz4" else "zstandard"
        raise ConfigError(f"compression {codec!r} needs the {package} package: pip install {package} "
                          "(or choose --compression none)") from exc


def _compress(codec: str, body: bytes) -> bytes:
    if codec == "none":
        return body
    if codec == "lz4":
        return _module("lz4").compress(body, store_size=False)
    return _module("zstd").ZstdCompressor(level=_ZSTD_LEVEL).compress(body)


def _decompress(codec: str, sent: memoryview, body_len: int) -> bytes:
    try:
        if codec == "none":
            data = bytes(sent)
        elif codec == "lz4":
            data = _module("lz4").decompress(sent, uncompressed_size=body_len)
        else:
            data = _module("zstd").ZstdDecompressor().decompress(sent, max_output_size=body_len)
    except ConfigError:
        raise
    except Exception as exc:  # each codec raises its own error types on damaged input
        raise CorruptChunkError(f"packed chunk does not decompress ({codec}): {exc}",
                                reason="format") from exc
    if len(data) != body_len:
        raise CorruptChunkError(f"packed body is {len(data)} bytes, its header says {body_len}",
                                reason="truncated")
    return data
