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
probability 2^-64). Older formats (1: zlib's CRC-32, 2: XXH64) checksummed with a
slower algorithm than XXH3 (:mod:`shardreplay._hashing`); their chunks are rejected with a
reason that says so.
Sizes in the header are checked against the spec and the bytes actually present before
anything is allocated, and decoded arrays are zero-copy, read-only views of the input,
validated once, every value in one compiled pass (:mod:`shardreplay.spec.validation`: a
buffer's ``extend`` does not check them again). Array offsets and the payload length
come from :class:`~shardreplay.spec.layout.RecordLayout`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardreplay._hashing import xxh3_64
from shardreplay.errors import CorruptChunkError, SpecMismatchError
from shardreplay.spec import Spec
from shardreplay.transport.packing import PACKED_MAGIC, pack, unpack
from shardreplay.transport.wire import (
    _DIGEST,
    _DIGEST_AT,
    _HASHED_FROM,
    _HEADER_KEYS,
    _IDS_DTYPE,
    _MAX_DIM,
    _MAX_HEADER_BYTES,
    _MAX_ID,
    _OLDER,
    _PREFIX,
    _PREFIX_READ,
    _PRIO_DTYPE,
    _STEP_PREFIX,
    FORMAT_VERSION,
    MAGIC,
    _align8,
    _info,
    _Layout,
    _layout,
    _unpack_header,
)

__all__ = ["FORMAT_VERSION", "MAGIC", "Chunk", "Encoding", "PackedEncoding", "decode", "encode",
           "peek_identity", "wire_encoding"]

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
    return bytes(out)  # redis-py and hashing callers want bytes


class Encoding:
    """A chunk checked and ready to be written where the caller wants it (:func:`encode`
    writes it to new bytes; the local transport writes it straight into its ring).

    Steps that are already arrays of the spec's exact dtypes and shapes (what actors
    build) are not passed through ``spec.validate``: :meth:`write_into` checks their
    values in the written bytes, in the one compiled pass the decoder uses, and raises
    before the chunk is complete (``spec.validate`` then names the bad field). Anything
    else is validated (and cast) here.

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
    """A chunk packed for the wire (:mod:`shardreplay.transport.packing`), written where
    the caller wants it like an :class:`Encoding`.

    Raises:
        SpecMismatchError: as :func:`encode`.
        ConfigError: ``codec`` is unknown or its package is not installed.
    """

    __slots__ = ("_data", "nbytes")

    def __init__(self, chunk: Chunk, spec: Spec, codec: str) -> None:
        enc = Encoding(chunk, spec)
        # The plain encoding only feeds pack(), which copies what it keeps: it goes to a
        # scratch buffer of this thread, reused chunk after chunk, instead of two new
        # chunk-sized objects (allocating, faulting and copying them cost an actor more
        # than packing a Pong chunk; benchmarks/transport/bench_ingest.py --ab).
        scratch = _scratch(enc.nbytes)
        enc.write_into(scratch)
        self._data = pack(scratch[:enc.nbytes], spec, codec)
        self.nbytes = len(self._data)

    def write_into(self, out: bytearray | memoryview | np.ndarray) -> None:
        """Write the packed chunk to the first :attr:`nbytes` bytes of ``out``."""
        np.frombuffer(out, np.uint8, self.nbytes)[:] = np.frombuffer(self._data, np.uint8)


def wire_encoding(chunk: Chunk, spec: Spec, compression: str) -> Encoding | PackedEncoding:
    """How a chunk crosses a file or network transport: packed (:mod:`~shardreplay.transport.packing`)
    when ``compression`` is not ``"none"`` or ``spec`` has a ``frame_stack`` field (its new
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
    """:func:`_check_ids_and_priorities`, skipped for stream ids whose bytes ``key`` passed
    before: actors send the same ids chunk after chunk, so the layout keeps a bounded set
    of them. ``key`` None (priorities to check too): always checked, nothing kept."""
    if key is not None and key in layout.good_ids:
        return
    _check_ids_and_priorities(ids, prio, layout.s, layout.t, exc=exc)
    if key is not None:
        if len(layout.good_ids) >= 1024:
            layout.good_ids.clear()
        layout.good_ids.add(key)


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
        data: the encoded chunk, or a packed one (:mod:`shardreplay.transport.packing`:
            rebuilt first, and its rebuilt bytes then checked like any chunk). Decoded
            arrays are read-only views into it (into the rebuilt bytes when packed).
        spec: the learner's spec; the chunk's fingerprint, dtypes and shapes must match.
        max_bytes: chunks longer than this are rejected before anything else.

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
    payload_at = _align8(_PREFIX.size + hlen)
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
