"""Part files: the safetensors layout, written as a stream, read block by block.

A part file is a valid safetensors file (nothing pickled) that we write ourselves, to
stream arrays to disk without a second copy and to record an XXH64 hash of every
``BLOCK_BYTES`` block: a reader verifies exactly the blocks it reads. Whole blocks are
read straight into the destination, in runs of up to ``_RUN_BYTES`` per system call,
hashed on a helper thread while the next run is read; partial ones go through one
block-sized scratch buffer (no mmap: touched pages would count as resident twice).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from shardreplay._hashing import BlockHasher, xxh64
from shardreplay._io import atomic_writer
from shardreplay.errors import CheckpointDamagedError, CheckpointFormatError

if TYPE_CHECKING:  # the records a reader checks a file against (its size and block hashes)
    from shardreplay.checkpoint.records import ManifestPart, RefSource

BLOCK_BYTES = 1 << 20
# Whole blocks read per system call: large reads keep cold reads as fast as one read of
# the whole file, small enough that hashing a run overlaps reading the next.
_RUN_BYTES = 32 * BLOCK_BYTES
_HASH_THREADS = 1  # runs are checked in order; one thread keeps up with the disk
_ALIGN = 64
_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
           "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
           "F16": np.float16, "F32": np.float32, "F64": np.float64}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
MAX_HEADER_BYTES = 64 << 20


def _describe(pieces: list[np.ndarray], name: str, offset: int) -> dict[str, Any]:
    first = pieces[0]
    if first.dtype not in _NAMES or any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                                        for p in pieces):
        raise CheckpointFormatError(f"array {name!r}: dtype {first.dtype} or its pieces cannot be saved")
    rows = sum(p.shape[0] for p in pieces)
    nbytes = sum(p.nbytes for p in pieces)
    return {"dtype": _NAMES[first.dtype], "shape": [rows, *first.shape[1:]],
            "data_offsets": [offset, offset + nbytes]}


def write_part(path: Path, arrays: Mapping[str, np.ndarray | list[np.ndarray]],
               metadata: Mapping[str, str], empty_like: Mapping[str, np.ndarray] | None = None
               ) -> tuple[int, tuple[str, ...]]:
    """Write arrays as a safetensors file atomically; its size and block hashes.

    An array may be given as a list of pieces (views) concatenated along axis 0; an
    empty list takes dtype and trailing shape from ``empty_like[name]``.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    pieces_of: dict[str, list[np.ndarray]] = {}
    for name, arr in arrays.items():
        pieces = (list(arr) if isinstance(arr, list) else [arr]) or [(empty_like or {})[name][:0]]
        pieces_of[name] = pieces
        header[name] = _describe(pieces, name, offset)
        offset = header[name]["data_offsets"][1]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    hasher = BlockHasher(BLOCK_BYTES)
    with atomic_writer(path) as f:
        for piece in (struct.pack("<Q", len(text)), text):
            f.write(piece)
            hasher.feed(memoryview(piece))
        for pieces in pieces_of.values():
            for arr in pieces:
                if arr.size == 0:
                    continue  # no bytes (and memoryview cannot cast an empty shape)
                view = np.ascontiguousarray(arr).data.cast("B")
                for start in range(0, len(view), BLOCK_BYTES):
                    chunk = view[start:start + BLOCK_BYTES]
                    f.write(chunk)
                    hasher.feed(chunk)
    return 8 + len(text) + offset, tuple(hasher.finish())


def _hash_blocks(dest: memoryview, valid: int, skip: frozenset[int]) -> list[int | None]:
    """XXH64 of each BLOCK_BYTES block of ``dest``; -1 for blocks not fully read
    (``valid``), None for the blocks ``skip`` (indices into ``dest``'s blocks: checked
    already)."""
    out: list[int | None] = []
    for k, off in enumerate(range(0, len(dest), BLOCK_BYTES)):
        end = min(off + BLOCK_BYTES, len(dest))
        out.append(-1 if end > valid else None if k in skip else xxh64(dest[off:end]))
    return out


class WholeReads:
    """``rows``, ``array`` and the context of a part reader (:class:`PartReader`, and
    ``refs.ChainedReader`` of an incremental part), from its ``entry``, ``rows_into``
    and ``close``."""

    entry: Callable[[str], tuple[np.dtype, tuple[int, ...]]]
    rows_into: Callable[..., None]
    close: Callable[[], None]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of array ``name`` (a new verified array)."""
        dtype, shape = self.entry(name)
        out = np.empty((stop - start, *shape[1:]), dtype)
        self.rows_into(name, start, out)
        return out

    def array(self, name: str) -> np.ndarray:
        """The whole array ``name`` (a verified copy)."""
        return self.rows(name, 0, self.entry(name)[1][0])

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PartReader(WholeReads):
    """Read arrays (or row ranges of them) from a part file, verifying touched blocks,
    each at most once per reader (the file is taken not to change during one load).
    It keeps the last block it read: read in increasing file order where possible.

    Raises:
        CheckpointFormatError: unreadable, truncated or corrupt file, with its name.
    """

    def __init__(self, path: Path, expected: ManifestPart | RefSource) -> None:
        self.path = Path(path)
        try:
            self._hashes = [int(h, 16) for h in expected.block_xxh64]
        except (TypeError, ValueError) as exc:
            raise CheckpointFormatError(f"{path}: the description has no valid block hashes") from exc
        try:
            self._size = self.path.stat().st_size
            self._fd = os.open(self.path, os.O_RDONLY)
            with contextlib.suppress(AttributeError, OSError):  # a hint: read ahead further
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError as exc:
            raise CheckpointFormatError(f"{self.path}: cannot read ({exc})") from exc
        self._block = -1
        self._len = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, Future[list[int | None]]]] = []
        self._checked: set[int] = set()  # blocks hashed, or with a hash check pending
        try:
            self._scratch = bytearray(min(BLOCK_BYTES, self._size))  # small files, small scratch
            self._view = memoryview(self._scratch)
            if self._size != expected.bytes:
                raise self._fail(f"{self._size} bytes, the manifest says {expected.bytes} "
                                 "(truncated or replaced)")
            if len(self._hashes) != -(-self._size // BLOCK_BYTES):
                raise self._fail("the manifest's block hashes do not cover the file")
            self.header, self.data_start = self._read_header()
        except BaseException:
            self.close()
            raise
        self.metadata: dict[str, str] = self.header.pop("__metadata__", {})

    def _fail(self, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.path}: {why}")

    def _damaged(self, block: int, length: int) -> CheckpointDamagedError:
        start = block * BLOCK_BYTES
        return CheckpointDamagedError(f"{self.path}: checksum mismatch in block {block} (bytes "
                                      f"{start}..{start + length})")

    def _load_block(self, block: int) -> memoryview:
        if block != self._block:
            self._block = -1
            self._len = os.preadv(self._fd, [self._view], block * BLOCK_BYTES)
            if block not in self._checked:
                if xxh64(self._view[:self._len]) != self._hashes[block]:
                    raise self._damaged(block, self._len)
                self._checked.add(block)
            self._block = block
        return self._view[:self._len]

    def read_bytes(self, lo: int, hi: int, out: memoryview, *, defer: bool = False) -> None:
        """Copy verified bytes ``lo:hi`` of the file into ``out`` (``len(out) == hi - lo``);
        with ``defer`` the whole-block checks stay pending (``out`` may hold unverified
        bytes) until :meth:`check_pending`. Partial blocks at the ends go through the
        scratch block, hashed whole before any of their bytes is copied.

        Raises:
            CheckpointFormatError: a range outside the file, or (unless deferred) a
                checksum mismatch, raised once every check of the call has finished.
        """
        if lo < 0 or hi > self._size:
            raise self._fail(f"byte range {lo}..{hi} lies outside the file")
        pos = lo
        checks: list[tuple[int, Future[list[int | None]]]] = []
        try:
            while pos < hi:
                block = pos // BLOCK_BYTES
                begin = block * BLOCK_BYTES
                run_end = min(begin + _RUN_BYTES, hi)
                if run_end < self._size:
                    run_end -= run_end % BLOCK_BYTES  # whole blocks only (the last one may be short)
                if pos == begin and run_end > pos and block != self._block:
                    checks.append(self._read_run(pos, out[pos - lo:run_end - lo]))
                    pos = run_end
                    continue
                data = self._load_block(block)
                stop = min(hi - begin, len(data))
                out[pos - lo:pos - lo + stop - (pos - begin)] = data[pos - begin:stop]
                pos += stop - (pos - begin)
        finally:
            self._pending.extend(checks)
            if not defer:
                self.check_pending()

    def check_pending(self) -> None:
        """Wait for every deferred whole-block check; raise on the first bad block.

        Raises:
            CheckpointFormatError: a block's hash differs from the manifest's (or the
                file ended before it).
        """
        pending, self._pending = self._pending, []
        bad = [first + k for first, future in pending
               for k, h in enumerate(future.result()) if h is not None and h != self._hashes[first + k]]
        if bad:
            b = min(bad)
            raise self._damaged(b, min(BLOCK_BYTES, self._size - b * BLOCK_BYTES))

    def _read_run(self, start: int, dest: memoryview) -> tuple[int, Future[list[int | None]]]:
        """Read whole blocks from byte ``start`` into all ``dest``; (first block, future of their hashes)."""
        done = 0
        while done < len(dest):
            got = os.preadv(self._fd, [dest[done:]], start + done)
            if got <= 0:
                break  # the file shrank: the unread blocks fail their check
            done += got
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="shardreplay-xxh64")
        first = start // BLOCK_BYTES
        blocks = range(first, first + -(-len(dest) // BLOCK_BYTES))
        skip = frozenset(b - first for b in blocks if b in self._checked)
        self._checked.update(blocks)  # a failed check raises in check_pending, before any use
        return first, self._pool.submit(_hash_blocks, dest, done, skip)

    def _read_header(self) -> tuple[dict[str, Any], int]:
        if self._size < 8:
            raise self._fail("shorter than a header")
        raw = bytearray(8)
        self.read_bytes(0, 8, memoryview(raw))
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > self._size:
            raise self._fail(f"header length {n} is impossible (corrupt file)")
        text = bytearray(n)
        self.read_bytes(8, 8 + n, memoryview(text))
        try:
            header = json.loads(bytes(text))
        except ValueError as exc:
            raise self._fail(f"header is not JSON ({exc})") from exc
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        return header, 8 + n

    def verify_all(self) -> None:
        """Check every block of the file."""
        for block in range(len(self._hashes)):
            self._load_block(block)

    def names(self) -> list[str]:
        """Names of the arrays in the file."""
        return list(self.header)

    def entry(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """Dtype and shape of array ``name``."""
        dtype, shape, _b, _e = self._entry(name)
        return dtype, shape

    def _entry(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        try:
            e = self.header[name]
            dtype = np.dtype(_DTYPES[e["dtype"]])
            shape = tuple(int(d) for d in e["shape"])
            begin, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise self._fail(f"array {name!r} is missing or malformed in the header") from exc
        if end - begin != dtype.itemsize * math.prod(shape) or \
                self.data_start + end > self._size or begin < 0 or not shape:
            raise self._fail(f"array {name!r}: byte range does not match its shape")
        return dtype, shape, begin, end

    def rows_into(self, name: str, start: int, out: np.ndarray, *, defer: bool = False) -> None:
        """Fill ``out`` with rows ``start:start+len(out)`` of ``name``.

        A C-contiguous ``out`` is filled in place; any other (a field packed in a
        record array) through a contiguous temporary. With ``defer`` the whole-block
        checks are left to :meth:`check_pending` (see :meth:`read_bytes`).

        Raises:
            CheckpointFormatError: a missing array, rows out of range, a dtype or
                shape mismatch, or (unless deferred) a corrupt block.
        """
        if not out.flags.c_contiguous:
            tmp = np.empty(out.shape, out.dtype)  # kept alive by a pending check's view
            self.rows_into(name, start, tmp, defer=defer)
            out[...] = tmp
            return
        dtype, shape, begin, _end = self._entry(name)
        if out.dtype != dtype or out.shape[1:] != shape[1:] or start + out.shape[0] > shape[0]:
            raise self._fail(f"array {name!r} is {dtype}{list(shape)}; cannot read rows "
                             f"{start}..{start + out.shape[0]} as {out.dtype}{list(out.shape)}")
        if out.size == 0:
            return
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        lo = self.data_start + begin + start * row_bytes
        self.read_bytes(lo, lo + out.shape[0] * row_bytes, out.data.cast("B"), defer=defer)

    def close(self) -> None:
        """Close the file (and stop the checksum thread)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pending = []
            self._pool = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
