"""Incremental saves: which field rows a part writes, and which it takes from earlier files.

A shard remembers (in ``Shard.checkpoint_notes``, in this process) where its last saved
part put each stored step's field rows (:class:`Chain`: a segment table, see
:mod:`shardreplay.checkpoint.refs`).
Rows are append-only rings: a stored absolute step's field data never changes, so the
next part refers to the earlier files for every step it still stores that an earlier
part holds, and writes only the steps written since. Step types, discounts, episode
ids, generations and priorities, the episode tables and every counter are written
whole each time (they change: priorities are updated, sealing marks step types).

A chain continues only from a *complete* checkpoint under the same root, saved from the
same content (no restore or ``load_state_dict`` since: ``StreamStorage.clears``), with
the same policy (``seal``; ``drop`` removes steps and writes full parts). Otherwise the
part is full, and the chain starts again from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardreplay.buffer.shard import Shard
from shardreplay.checkpoint.manifest import is_complete
from shardreplay.checkpoint.records import RefSource


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
    """The last part a shard saved under ``root``: its checkpoint and file, and its
    segment table (own rows: source -1)."""

    root: str
    clears: int
    own: RefSource
    segments: Segments


def full_segments(hi: np.ndarray, cap: int) -> Segments:
    """The table of a full part of rows at positions ``hi``: every step in its own file."""
    lo = hi - np.minimum(hi, cap)
    count = hi - lo
    first = np.cumsum(count) - count
    rows = np.arange(hi.shape[0], dtype=np.int64)
    return Segments(rows, lo.astype(np.int64), count.astype(np.int64), np.full(hi.shape[0], -1, np.int64),
                    first.astype(np.int64), ())


def chain_of(shard: Shard, root: Path) -> Chain | None:
    """The chain a part of ``shard`` under ``root`` can continue (None: save it full)."""
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


def remember(shard: Shard, root: Path, own: RefSource, segments: Segments) -> None:
    """After part file ``own`` was written: the next part of ``shard`` may continue from it."""
    shard.checkpoint_notes[_key(root)] = Chain(str(Path(root).resolve()), shard.clears, own, segments)


def forget(shard: Shard, root: Path) -> None:
    """The next part of ``shard`` under ``root`` is full."""
    shard.checkpoint_notes.pop(_key(root), None)


def plan(chain: Chain, hi: np.ndarray, cap: int) -> tuple[Segments, np.ndarray]:
    """The segment table of a part continuing ``chain`` at positions ``hi``, and the
    first absolute step of each row that the part writes itself (to ``hi``)."""
    lo = hi - np.minimum(hi, cap)
    prev = chain.segments
    sources: list[RefSource] = []
    index: dict[RefSource, int] = {}
    cols: list[tuple[int, int, int, int, int]] = []
    own_start = lo.copy()
    own_first = 0
    by_row = np.argsort(prev.row, kind="stable")
    bounds = np.searchsorted(prev.row[by_row], np.arange(hi.shape[0] + 1))
    for r in range(hi.shape[0]):
        covered = int(lo[r])
        for k in by_row[bounds[r]:bounds[r + 1]].tolist():
            s, n = int(prev.step[k]), int(prev.count[k])
            a, b = max(s, int(lo[r])), min(s + n, int(hi[r]))
            if b <= a or a != covered:
                continue  # gone from the ring (or, never, a gap: written below)
            src = chain.own if prev.source[k] < 0 else prev.sources[int(prev.source[k])]
            if src not in index:
                index[src] = len(sources)
                sources.append(src)
            cols.append((r, a, b - a, index[src], int(prev.first[k]) + a - s))
            covered = b
        own_start[r] = covered
        if hi[r] > covered:
            cols.append((r, covered, int(hi[r]) - covered, -1, own_first))
            own_first += int(hi[r]) - covered
    table = np.array(cols, np.int64).reshape(-1, 5)
    row, step, count, source, first = (np.ascontiguousarray(table[:, j]) for j in range(5))
    segments = Segments(row, step, count, source, first, tuple(sources))
    return segments, own_start
