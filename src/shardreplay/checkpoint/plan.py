"""The M -> N restore plan: which episodes go to which new shard, row and offset.

Pure and deterministic: the same episode tables and the same N give the same plan on
every machine. Episodes are whole units (never split between rows), balanced by step
count with a greedy longest-first rule, first over shards, then over the rows of each
shard. Within a row, episodes keep their original order (saved part, row, time), so
episodes of one original stream stay in time order. A row that gets more steps than
``stream_capacity`` loses its oldest episodes; an episode longer than the capacity
keeps only its newest steps (and is sealed to start with FIRST).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EpisodeRef:
    """One saved episode: where it is (part, start index, length) and its order key."""

    part: int
    start: int
    length: int
    row: int


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
    """What one new shard receives, and what capacity made it drop."""

    placements: list[Placement]
    row_lengths: np.ndarray
    dropped_episodes: int
    dropped_steps: int


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


def plan_shard(episodes: list[EpisodeRef], num_shards: int, shard: int, num_streams: int,
               stream_capacity: int) -> ShardPlan:
    """The placements of new shard ``shard`` of ``num_shards``.

    ``episodes`` must be in the canonical order (part, row, start): the list's index is
    the episode's new id, unique across all new shards.
    """
    owners = _balance([e.length for e in episodes], num_shards)
    mine = [i for i, o in enumerate(owners) if o == shard]
    rows = _balance([episodes[i].length for i in mine], num_streams)
    placements: list[Placement] = []
    row_lengths = np.zeros(num_streams, np.int64)
    dropped_eps = dropped_steps = 0
    for r in range(num_streams):
        in_row = [i for i, rr in zip(mine, rows, strict=True) if rr == r]
        kept, skips, dropped = _fit(in_row, [episodes[i].length for i in in_row], stream_capacity)
        dropped_eps += len(dropped)
        dropped_steps += sum(episodes[i].length for i in dropped) + sum(skips)
        offset = 0
        for i, skip in zip(kept, skips, strict=True):
            placements.append(Placement(episodes[i], i, r, offset, skip))
            offset += episodes[i].length - skip
        row_lengths[r] = offset
    return ShardPlan(placements, row_lengths, dropped_eps, dropped_steps)


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
