"""The M -> N restore plan: which episodes go to which new shard, row and offset.

Pure and deterministic: the same episode tables and the same N (and new layout) give
the same plan on every machine. Episodes are whole units (never split between rows).
The saved streams (rows of the M parts) are the starting pieces; two modes follow:

* **spread** (the saved streams fit one per new row: ``R_saved <= N * num_streams``):
  each new row receives one piece, a run of consecutive episodes of one saved stream.
  While rows are left over, the largest piece is split at the episode boundary nearest
  its middle, so data spreads over all rows; pieces are dealt to shards largest first,
  each to the least-filled shard with a free row. Nothing is lost when
  ``stream_capacity`` is at least the saved one: a saved stream, or any run of it,
  fits the row it came from. This covers resuming on the same layout.
* **merge** (more saved streams than new rows): when the steps exceed the new total
  capacity, the oldest episodes are dropped first; the rest are dealt to all new rows
  largest first (each to the least-filled row, rows of different shards interleaved),
  and a row that still overflows drops its oldest episodes.

"Oldest" is measured in the saved stream's own clock: an episode's **age** is the
number of steps stored after its end in its saved stream (0 for the newest). Within a
new row episodes are ordered oldest first (ties: saved part, row, time), so the steps
of each saved stream keep their time order. An episode longer than
``stream_capacity`` keeps only its newest steps (the loader seals it to start with
FIRST).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EpisodeRef:
    """One saved episode: where it is (part, start index, length), its saved row, and
    its age (steps stored after it in that row)."""

    part: int
    start: int
    length: int
    row: int
    age: int = 0


@dataclass(frozen=True)
class Placement:
    """Where (a suffix of) a saved episode goes: new row, offset in the row, and how
    many leading steps of the saved episode are skipped (capacity overflow)."""

    ref: EpisodeRef
    new_id: int
    row: int
    offset: int
    skip: int

    @property
    def length(self) -> int:
        """Steps placed."""
        return self.ref.length - self.skip


@dataclass(frozen=True)
class ShardPlan:
    """What one new shard receives, and what capacity made it drop.

    In merge mode, episodes no new row could take are counted on shard 0.
    """

    placements: list[Placement]
    row_lengths: np.ndarray
    dropped_episodes: int
    dropped_steps: int


def plan_shard(episodes: list[EpisodeRef], num_shards: int, shard: int, num_streams: int,
               stream_capacity: int) -> ShardPlan:
    """The placements of new shard ``shard`` of ``num_shards``.

    ``episodes`` must be in the canonical order (part, row, start): the list's index is
    the episode's new id, unique across all new shards.
    """
    rows, pre_dropped = assign_rows(episodes, num_shards, num_streams, stream_capacity)
    placements: list[Placement] = []
    row_lengths = np.zeros(num_streams, np.int64)
    dropped_eps = dropped_steps = 0
    if shard == 0:
        dropped_eps, dropped_steps = len(pre_dropped), sum(episodes[i].length for i in pre_dropped)
    for r in range(num_streams):
        in_row = sorted(rows[shard * num_streams + r], key=lambda i: (-episodes[i].age, i))
        kept, skips, dropped = _fit(in_row, [episodes[i].length for i in in_row], stream_capacity)
        dropped_eps += len(dropped)
        dropped_steps += sum(episodes[i].length for i in dropped) + sum(skips)
        offset = 0
        for i, skip in zip(kept, skips, strict=True):
            placements.append(Placement(episodes[i], i, r, offset, skip))
            offset += episodes[i].length - skip
        row_lengths[r] = offset
    return ShardPlan(placements, row_lengths, dropped_eps, dropped_steps)


def assign_rows(episodes: list[EpisodeRef], num_shards: int, num_streams: int,
                stream_capacity: int) -> tuple[list[list[int]], list[int]]:
    """Episode indices of every new row (row ``shard * num_streams + r``), and the
    indices dropped before assignment (merge mode only)."""
    lengths = [e.length for e in episodes]
    pieces = _saved_streams(episodes)
    total_rows = num_shards * num_streams
    if len(pieces) <= total_rows:
        pieces = _split_pieces(pieces, lengths, total_rows)
        return _deal_pieces(pieces, lengths, num_shards, num_streams), []
    kept, dropped = _drop_oldest(episodes, total_rows * stream_capacity)
    rows: list[list[int]] = [[] for _ in range(total_rows)]
    for i, b in zip(kept, _balance([lengths[i] for i in kept], total_rows), strict=True):
        # Bin b is row b // N of shard b % N: the first (largest) episodes spread over shards.
        rows[(b % num_shards) * num_streams + b // num_shards].append(i)
    return rows, dropped


def _saved_streams(episodes: list[EpisodeRef]) -> list[list[int]]:
    """Runs of consecutive episodes of one saved stream (same part and row)."""
    pieces: list[list[int]] = []
    for i, e in enumerate(episodes):
        if i and (e.part, e.row) == (episodes[i - 1].part, episodes[i - 1].row):
            pieces[-1].append(i)
        else:
            pieces.append([i])
    return pieces


def _split_pieces(pieces: list[list[int]], lengths: list[int], total_rows: int) -> list[list[int]]:
    """Split the largest piece at the episode boundary nearest its middle until there
    are ``total_rows`` pieces or none has two episodes."""
    heap = [(-sum(lengths[i] for i in p), p[0], p) for p in pieces]
    heapq.heapify(heap)
    done: list[list[int]] = []
    count = len(pieces)
    while heap and count < total_rows:
        _size, _first, piece = heapq.heappop(heap)
        if len(piece) < 2:
            done.append(piece)
            continue
        cut = _best_cut(np.cumsum([lengths[i] for i in piece]).tolist())
        for part in (piece[:cut], piece[cut:]):
            heapq.heappush(heap, (-sum(lengths[i] for i in part), part[0], part))
        count += 1
    return sorted(done + [p for _s, _f, p in heap], key=lambda p: p[0])


def _best_cut(ends: list[int]) -> int:
    """Index ``c`` in ``1..len-1`` splitting prefix sums ``ends`` most evenly."""
    total = ends[-1]
    return min(range(1, len(ends)), key=lambda c: (abs(2 * ends[c - 1] - total), c))


def _deal_pieces(pieces: list[list[int]], lengths: list[int], num_shards: int,
                 num_streams: int) -> list[list[int]]:
    """Each piece to its own row: largest first to the least-filled shard with a free row."""
    sizes = [sum(lengths[i] for i in p) for p in pieces]
    heap = [(0, s) for s in range(num_shards)]
    per_shard: list[list[int]] = [[] for _ in range(num_shards)]
    for k in sorted(range(len(pieces)), key=lambda k: (-sizes[k], k)):
        filled, s = heapq.heappop(heap)
        per_shard[s].append(k)
        if len(per_shard[s]) < num_streams:
            heapq.heappush(heap, (filled + sizes[k], s))
    rows: list[list[int]] = [[] for _ in range(num_shards * num_streams)]
    for s, ks in enumerate(per_shard):
        for r, k in enumerate(sorted(ks)):
            rows[s * num_streams + r] = list(pieces[k])
    return rows


def _drop_oldest(episodes: list[EpisodeRef], capacity: int) -> tuple[list[int], list[int]]:
    """Drop the oldest episodes until the rest hold at most ``capacity`` steps."""
    excess = sum(e.length for e in episodes) - capacity
    dropped: list[int] = []
    for i in sorted(range(len(episodes)), key=lambda i: (-episodes[i].age, i)):
        if excess <= 0:
            break
        dropped.append(i)
        excess -= episodes[i].length
    gone = set(dropped)
    return [i for i in range(len(episodes)) if i not in gone], sorted(dropped)


def _balance(sizes: list[int], bins: int) -> list[int]:
    """Greedy longest-first: each item to the least-filled bin (ties: lowest index)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    heap = [(0, b) for b in range(bins)]
    assign = [0] * len(sizes)
    for i in order:
        filled, b = heapq.heappop(heap)
        assign[i] = b
        heapq.heappush(heap, (filled + sizes[i], b))
    return assign


def _fit(ids: list[int], lengths: list[int], capacity: int) -> tuple[list[int], list[int], list[int]]:
    """Keep the newest episodes that fit ``capacity``; returns (kept, skips, dropped)."""
    total = 0
    first_kept = len(ids)
    for k in range(len(ids) - 1, -1, -1):
        if total + lengths[k] > capacity and total > 0:
            break
        total += lengths[k]
        first_kept = k
    kept = ids[first_kept:]
    skips = [0] * len(kept)
    if kept and total > capacity:  # a single episode longer than the row
        skips[0] = total - capacity
    return kept, skips, ids[:first_kept]
