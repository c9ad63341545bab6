"""Packed chunks: each new frame of a frame-stacked field sent once, the rest compressed.

A chunk of a ``frame_stack`` field (``Field((4, 84, 84), np.uint8, frame_stack=True)``)
carries ``[S, T, K, *frame]`` stacks, and consecutive steps of an episode share ``K - 1``
of their ``K`` frames. :func:`pack` turns an encoded chunk (:func:`~shardreplay.transport.codec.encode`)
into a packed one that holds, for each step of each stream, only the frame the step
added when its stack continues the previous step's (its oldest ``K - 1`` frames are the
previous stack's newest ``K - 1``), and the whole stack otherwise (the chunk's first step
of a stream, an episode's first step). The result is then compressed with LZ4 or
Zstandard (or not: ``"none"``). :func:`unpack` rebuilds the encoded chunk bit for bit;
its own checksum (checked by :func:`~shardreplay.transport.codec.decode`) proves it.

Wire layout of a packed chunk (little-endian)::

    offset 0   magic b"SRCZ"                                     4 bytes
           4   packing version (uint8), codec (uint8: 0 none, 1 lz4, 2 zstd), 2 zero bytes
           8   total_len (uint64): bytes of the packed chunk     8 bytes
          16   body_len (uint64): bytes of the body, uncompressed
          24   chunk_len (uint64): bytes of the rebuilt chunk
          32   XXH3-64 of every byte after offset 40 (what is sent)
          40   the body, compressed by the codec

The body is the encoded chunk with each frame-stacked field's array cut out, followed, for
each such field in the chunk's array order, by one byte per step (1: the step's stack
continues the previous one, only its newest frame follows; 0: the whole stack follows)
and the frames themselves, steps in ``[S, T]`` order. Nothing is unpickled; sizes are
checked against ``max_bytes`` before anything is allocated or decompressed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardreplay._hashing import xxh3_64
from shardreplay.errors import ConfigError, CorruptChunkError
from shardreplay.spec import Spec
from shardreplay.transport.wire import _PREFIX, _STEP_PREFIX, MAGIC, _layout, _unpack_header

__all__ = ["CODECS", "PACKED_MAGIC", "is_packed", "pack", "unpack"]

PACKED_MAGIC = b"SRCZ"
PACKING_VERSION = 1
CODECS = ("none", "lz4", "zstd")
_HEAD = struct.Struct("<4sBB2xQQQQ")
_HASHED_FROM = 40
_ZSTD_LEVEL = 1  # level 1: most of the ratio on frames at a fraction of level 3's CPU


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
    out = bytearray(_HASHED_FROM + len(sent))
    out[_HASHED_FROM:] = sent
    _HEAD.pack_into(out, 0, PACKED_MAGIC, PACKING_VERSION, CODECS.index(codec), len(out), len(body),
                    len(raw), 0)
    struct.pack_into("<Q", out, 32, xxh3_64(memoryview(out)[_HASHED_FROM:]))
    return bytes(out)


def unpack(data: bytes | bytearray | memoryview, spec: Spec, *, max_bytes: int) -> memoryview:
    """The encoded chunk that :func:`pack` packed into ``data``.

    Args:
        max_bytes: the largest chunk the reader accepts: neither the packed bytes, the
            body nor the rebuilt chunk may be larger (checked before allocating).

    Raises:
        CorruptChunkError: with ``reason`` ``too_large``, ``truncated``, ``format``,
            ``checksum`` or ``header``.
    """
    mv = memoryview(data).cast("B") if memoryview(data).ndim != 1 else memoryview(data)
    n = len(mv)
    if n > max_bytes:
        raise CorruptChunkError(f"chunk of {n} bytes exceeds max_bytes={max_bytes}", reason="too_large")
    if n < _HASHED_FROM:
        raise CorruptChunkError(f"packed chunk of {n} bytes is shorter than its header", reason="truncated")
    magic, version, codec_id, total, body_len, chunk_len, digest = _HEAD.unpack_from(mv)
    if magic != PACKED_MAGIC or version != PACKING_VERSION or codec_id >= len(CODECS):
        raise CorruptChunkError(f"packed chunk of version {version}, codec {codec_id}: this reader reads "
                                f"version {PACKING_VERSION}, codecs {', '.join(CODECS)}", reason="format")
    if total != n:
        raise CorruptChunkError(f"packed chunk says {total} bytes but {n} arrived", reason="truncated")
    if xxh3_64(mv[_HASHED_FROM:]) != digest:
        raise CorruptChunkError("checksum mismatch: the packed chunk was damaged in transit or on disk",
                                reason="checksum")
    # The body adds one flag byte per step of a stacked field to what it keeps of the
    # chunk, so it never reaches twice the chunk's size.
    if chunk_len > max_bytes or body_len > 2 * chunk_len:
        raise CorruptChunkError(f"packed chunk rebuilds {chunk_len} bytes from a {body_len}-byte body "
                                f"(max_bytes={max_bytes})", reason="too_large")
    body = _decompress(CODECS[codec_id], mv[_HASHED_FROM:], body_len)
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
    s, t, has_prio = _sizes(raw, hlen)
    layout = _layout(spec, s, t, has_prio)
    fields = {f"{_STEP_PREFIX}{name}": f for name, f in spec.fields.items() if f.frame_stack}
    out = []
    for name, dtype, count, offset, shape in layout.views:
        field = fields.get(name)
        if field is not None:
            frame = int(np.prod(shape[3:], dtype=np.int64)) * dtype.itemsize
            out.append(_StackedArray(layout.payload_at + offset, count * dtype.itemsize, s * t, t,
                                     field.stack_size, frame))
    return out


def _sizes(raw: np.ndarray, hlen: int) -> tuple[int, int, bool]:
    head = _unpack_header(raw[_PREFIX.size:_PREFIX.size + hlen].tobytes())
    try:
        s, t, arrays = int(head["S"]), int(head["T"]), head["arrays"]
        has_prio = any(e[0] == "priorities" for e in arrays)
    except Exception as exc:  # garbage of any kind is a damaged header
        raise CorruptChunkError(f"unreadable chunk header: {exc}", reason="header") from exc
    return s, t, has_prio


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
    # In range by construction (every stream's first step sent its whole stack, checked
    # above), so "clip" never clips: it only spares the copy through a temporary of
    # ``out`` that take's default mode="raise" makes (3/4 of a packed Pong chunk's decode).
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
