"""Incremental parts (format versions 3 and 4; docs/semantics.md, "Incremental
checkpoints"): which rows a part continuing a shard's :class:`Chain` (kept in
``Shard.checkpoint_notes``) writes itself, its segment table (:class:`Segments`), and
reading rows that live in earlier files (:class:`ChainedReader`).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardreplay.buffer.shard import ring_runs
from shardreplay.checkpoint.format import PartReader, WholeReads
from shardreplay.checkpoint.manifest import is_complete
from shardreplay.checkpoint.records import ManifestPart, PartMeta, RefSource
from shardreplay.errors import CheckpointFormatError
from shardreplay.kernels.codes import PRIORITY_BLOCK as BLOCK
from shardreplay.spec.validation import check_step_values

if TYPE_CHECKING:
    from shardreplay.buffer.shard import Shard

SEGMENT_ARRAYS = ("ref.row", "ref.step", "ref.count", "ref.source", "ref.first")
MOST_REFS = 16  # earlier files a part reads rows from, at most (chosen in docs/semantics.md)


def open_part(directory: Path, part: ManifestPart) -> PartReader | ChainedReader:
    """A reader of ``part`` of the checkpoint in ``directory``: a :class:`PartReader`
    for a full part, a :class:`ChainedReader` for an incremental one.

    Raises:
        CheckpointFormatError: an unreadable or malformed file or segment table.
    """
    own = PartReader(directory / part.file, part)
    if not (part.refs or part.chained_steps):
        return own
    try:
        return ChainedReader(Path(directory).parent, own, part.refs, part.chained_steps)
    except BaseException:
        own.close()
        raise


class ChainedReader(WholeReads):
    """:class:`PartReader` of an incremental part: the rows of ``field.*`` and of the
    ``chained_steps`` arrays are read from the files its segment table names (opened and
    verified on first use), everything else from the part itself.

    Raises:
        CheckpointFormatError: a malformed segment table (its counts do not add up to
            the stored steps, or a source outside ``refs``).
    """

    def __init__(self, root: Path, own: PartReader, refs: tuple[RefSource, ...],
                 chained_steps: tuple[str, ...] = ()) -> None:
        self._root, self._own, self._refs, self._steps = Path(root), own, refs, chained_steps
        self.path, self.metadata, self.header = own.path, own.metadata, own.header
        self._opened: dict[int, PartReader] = {}
        self._over: dict[int, tuple[np.ndarray, ...]] = {}  # by source: step types and discounts put over
        self._stack = ExitStack()
        seg = {name: own.array(name).astype(np.int64) for name in SEGMENT_ARRAYS}
        self._source, self._first, count = seg["ref.source"], seg["ref.first"], seg["ref.count"]
        self._offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
        steps = int(own.array("row_length").sum())
        if len({a.shape for a in seg.values()}) != 1 or (count < 0).any() or \
                int(self._offsets[-1]) != steps or (self._first < 0).any() or \
                ((self._source < -1) | (self._source >= len(refs))).any():
            raise CheckpointFormatError(f"{self.path}: malformed segment table (ref.*)")

    def _reader(self, source: int) -> PartReader:
        if source < 0:
            return self._own
        reader = self._opened.get(source)
        if reader is None:
            ref = self._refs[source]
            reader = self._stack.enter_context(PartReader(ref.path(self._root), ref))
            self._opened[source] = reader
        return reader

    def names(self) -> list[str]:
        """Names of the arrays (user fields as whole arrays, as in a full part)."""
        return self._own.names()

    def entry(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """Dtype and shape of array ``name`` (a field: every stored step's rows)."""
        dtype, shape = self._own.entry(name)
        if self._chained(name):
            shape = (int(self._offsets[-1]), *shape[1:])
        return dtype, shape

    def _chained(self, name: str) -> bool:
        return name.startswith("field.") or name in self._steps

    def rows_into(self, name: str, start: int, out: np.ndarray, *, defer: bool = False) -> None:
        """Fill ``out`` with rows ``start:start+len(out)`` of ``name`` (see
        :meth:`PartReader.rows_into`), a field's rows from the files that hold them.

        Raises:
            CheckpointFormatError: rows out of range, or a missing or corrupt file or block.
        """
        if not self._chained(name):
            self._own.rows_into(name, start, out, defer=defer)
            return
        stop = start + out.shape[0]
        if start < 0 or stop > int(self._offsets[-1]):
            raise CheckpointFormatError(f"{self.path}: rows {start}..{stop} of {name!r} lie outside "
                                        f"its {int(self._offsets[-1])} steps")
        if name == "priority":
            out[...] = self._priorities[start:stop]
            return
        over = name in ("step_type", "discount") and "step_type" in self._steps  # saved as written
        defer = defer and not over  # checked before values are put over some
        pos = start
        k = int(np.searchsorted(self._offsets, start, side="right")) - 1
        while pos < stop:
            end = min(int(self._offsets[k + 1]), stop)
            if end > pos:
                first = int(self._first[k]) + pos - int(self._offsets[k])
                src = int(self._source[k])
                reader, piece = self._reader(src), out[pos - start:end - start]
                reader.rows_into(name, first, piece, defer=defer)
                if over and src >= 0 and "prio.block" not in reader.names():  # a full part's, as written
                    _overlay(piece, first, name, self._seals(src))
            pos = end
            k += 1
        if over:  # sealed where this part's save sealed them (docs/semantics.md)
            _overlay(out, start, name, self._seals(-1))

    def _seals(self, source: int) -> tuple[np.ndarray, ...]:
        """Put over step types and discounts from ``source``: -1 ``sealed.*``, a full part ``seal.*``."""
        if source not in self._over:
            reader = self._reader(source)
            steps = int(self._offsets[-1]) if source < 0 else reader.entry("step_type")[1][0]
            self._over[source] = saved_seals(reader, steps, "sealed" if source < 0 else "seal")
        return self._over[source]

    @cached_property
    def _priorities(self) -> np.ndarray:
        """Every saved step's priority: each block from the file ``prio.source`` names (-1: own)."""
        cap = PartMeta.parse(self.metadata.get("buffer_meta", "{}"), self.path).stream_capacity
        source = self._own.array("prio.source").astype(np.int64)
        pos = self._own.array("row_pos").astype(np.int64)
        flat = np.zeros(source.shape[0] * BLOCK, np.float32)
        if flat.size < pos.shape[0] * cap or ((source < -1) | (source >= len(self._refs))).any():
            raise CheckpointFormatError(f"{self.path}: malformed prio.source")
        for k in np.unique(source).tolist():
            reader, take = self._reader(k), np.flatnonzero(source == k)
            if "prio.block" not in reader.names():  # a part with every step's priority, by slot here
                whole, values, i = np.zeros(flat.size, np.float32), reader.array("priority"), 0
                for a, n in ring_runs(reader.array("row_pos").astype(np.int64), cap):
                    whole[a:a + n], i = values[i:i + n], i + n
                flat.reshape(-1, BLOCK)[take] = whole.reshape(-1, BLOCK)[take]
                continue
            have, values = reader.array("prio.block").astype(np.int64), reader.array("prio.values")
            at = np.searchsorted(have, take)
            if values.shape != (have.shape[0] * BLOCK,) or (at >= have.shape[0]).any() or \
                    not np.array_equal(have[at], take):
                raise CheckpointFormatError(f"{reader.path}: prio.block lacks blocks {self.path} reads there")
            flat.reshape(-1, BLOCK)[take] = values.reshape(-1, BLOCK)[at]
        return np.concatenate([flat[:0], *(flat[a:a + n] for a, n in ring_runs(pos, cap))])

    def check_pending(self) -> None:
        """Wait for every deferred check, of this part and of the files it read from.

        Raises:
            CheckpointFormatError: a block's hash differs from the one recorded.
        """
        self._own.check_pending()
        for reader in self._opened.values():
            reader.check_pending()

    def verify_all(self) -> None:
        """Check every block of the part and of every file it refers to."""
        self._own.verify_all()
        for k in range(len(self._refs)):
            self._reader(k).verify_all()

    def close(self) -> None:
        """Close every file."""
        self._stack.close()
        self._opened.clear()
        self._own.close()


AnyPartReader = PartReader | ChainedReader


def _overlay(out: np.ndarray, start: int, name: str, seals: tuple[np.ndarray, ...]) -> None:
    """Put the ``name`` values of ``seals`` (:func:`saved_seals`) over ``out``'s rows from ``start``."""
    index, values = seals[0], seals[1 if name == "step_type" else 2]
    lo, hi = np.searchsorted(index, [start, start + out.shape[0]])
    out[index[lo:hi] - start] = values[lo:hi]


def saved_seals(reader: AnyPartReader, steps: int, kind: str = "seal") -> tuple[np.ndarray, ...]:
    """A part's ``seal.*`` arrays (empty without): which of its ``steps`` saved steps sealing
    changed, and their step types and discounts as they were (``kind="sealed"``: as sealed,
    ``sealed.*``; CheckpointFormatError: malformed)."""
    if "seal.index" not in reader.names():
        return np.empty(0, np.int64), np.empty(0, np.uint8), np.empty(0, np.float32)
    index = reader.array("seal.index")
    types, discounts = reader.array(f"{kind}.step_type"), reader.array(f"{kind}.discount")
    if index.dtype.kind not in "iu" or not index.shape == types.shape == discounts.shape or \
            (index.size and (index.min() < 0 or index.max() >= steps)):
        raise CheckpointFormatError(f"{reader.path}: malformed seal.* arrays")
    check_step_values(types, discounts, exc=CheckpointFormatError, where=f"{reader.path}: {kind}.*: ")
    return index, types, discounts


@dataclass(frozen=True)
class Segments:
    """Where the field rows of a part's stored steps are, in (row, time) order:
    ``count`` steps of ``row`` from absolute step ``step`` on, in source ``source`` (-1:
    the part's own file, else an index into ``sources``) from row ``first`` of its arrays."""

    row: np.ndarray
    step: np.ndarray
    count: np.ndarray
    source: np.ndarray
    first: np.ndarray
    sources: tuple[RefSource, ...]

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The table as the ``ref.*`` arrays of a part."""
        return {"ref.row": self.row, "ref.step": self.step, "ref.count": self.count,
                "ref.source": self.source, "ref.first": self.first}


@dataclass(frozen=True)
class Chain:
    """The last part a shard saved under a root (``clears``: the shard's at the save): its
    checkpoint and file, and its segment table (own rows: source -1)."""

    clears: int
    own: RefSource
    segments: Segments
    seen: int  # the shard's updates_applied at the save: blocks marked later changed since
    prio: np.ndarray  # per priority block: its file (-1: own, else in segments.sources)


def full_segments(hi: np.ndarray, cap: int) -> Segments:
    """The table of a full part of rows at positions ``hi``: every step in its own file."""
    lo = hi - np.minimum(hi, cap)
    count = hi - lo
    first = np.cumsum(count) - count
    rows = np.arange(hi.shape[0], dtype=np.int64)
    return Segments(rows, lo.astype(np.int64), count.astype(np.int64), np.full(hi.shape[0], -1, np.int64),
                    first.astype(np.int64), ())


def chain_of(shard: Shard, root: Path) -> Chain | None:
    """The chain a part of ``shard`` under ``root`` can continue; None (save it full) when its
    content was replaced since (``Shard.clears``) or that checkpoint is not complete."""
    chain = shard.checkpoint_notes.get(_key(root))
    if not isinstance(chain, Chain) or chain.clears != shard.clears:
        return None
    # A part of an incomplete checkpoint may be set aside (moved) at the next resume.
    directory = Path(root) / chain.own.checkpoint
    if not (chain.own.path(root).exists() and is_complete(directory, hashes=False)):
        return None
    return chain


def _key(root: Path) -> str:
    """The note of the chain under checkpoint root ``root`` (its resolved path)."""
    return f"chain:{Path(root).resolve()}"


def remember(shard: Shard, root: Path, own: RefSource, segments: Segments, seen: int,
             prio: np.ndarray) -> None:
    """After part file ``own`` was written: the next part of ``shard`` may continue from it."""
    shard.checkpoint_notes[_key(root)] = Chain(shard.clears, own, segments, seen, prio)


def block_sources(shard: Shard, chain: Chain, segments: Segments, start: np.ndarray) -> np.ndarray:
    """Per priority block of a part continuing ``chain`` with ``segments``, writing steps
    from ``start`` on: the file of ``segments.sources`` holding it unchanged, or -1 (the
    part writes it) when updated since ``chain.seen``, written since, or in no kept file."""
    where = {f: i for i, f in enumerate(segments.sources)}
    files = (*chain.segments.sources, chain.own)
    out = np.array([where.get(f, -1) for f in files], np.int8)[np.where(chain.prio < 0, len(files) - 1,
                                                                         chain.prio)]
    out[shard.priority_marks > chain.seen] = -1
    for a, n in ring_runs(shard.positions, shard.stream_capacity, start):
        if n:
            out[a // BLOCK:(a + n - 1) // BLOCK + 1] = -1
    return out


def forget(shard: Shard, root: Path) -> None:
    """The next part of ``shard`` under ``root`` is full."""
    shard.checkpoint_notes.pop(_key(root), None)


def plan(chain: Chain, hi: np.ndarray, cap: int, most: int = MOST_REFS) -> tuple[Segments, np.ndarray]:
    """The segment table of a part continuing ``chain`` at positions ``hi``, and the
    first absolute step of each row that the part writes itself (to ``hi``). It refers
    to at most ``most`` earlier files: past that, it writes the rows of the newest ones
    itself, and of each next newest while that holds no more steps than the part writes
    (docs/semantics.md, "Incremental checkpoints")."""
    lo = hi - np.minimum(hi, cap)
    prev = chain.segments
    files = (*prev.sources, chain.own)  # oldest first: a row's segments come in this order
    src = np.where(prev.source < 0, len(prev.sources), prev.source)
    a, b = np.maximum(prev.step, lo[prev.row]), np.minimum(prev.step + prev.count, hi[prev.row])
    live = b > a  # still in the ring
    size = np.bincount(src[live], (b - a)[live], len(files)).astype(np.int64)
    held = np.flatnonzero(size)
    keep, writes = len(held), int((hi - lo).sum() - size.sum())
    if keep > most:
        while keep and (keep > most or size[held[keep - 1]] <= writes):
            keep -= 1
            writes += int(size[held[keep]])
    index = np.full(len(files), -1, np.int64)
    index[held[:keep]] = np.arange(keep)
    ref = live & (index[src] >= 0)  # a prefix of each row: the files kept are the oldest
    start = lo.copy()
    np.maximum.at(start, prev.row[ref], b[ref])
    own = np.flatnonzero(hi > start)
    count = hi[own] - start[own]
    cols = [np.concatenate((earlier[ref], mine)).astype(np.int64) for earlier, mine in (
        (prev.row, own), (a, start[own]), (b - a, count), (index[src], np.full(own.shape, -1)),
        (prev.first + a - prev.step, np.cumsum(count) - count))]
    order = np.lexsort((cols[1], cols[0]))
    row, step, n, source, first = (c[order] for c in cols)
    return Segments(row, step, n, source, first, tuple(files[k] for k in held[:keep])), start
