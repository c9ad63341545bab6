"""The M -> N restore plan: which episodes go to which new shard, row and offset. Pure and
deterministic, so the ranks' plans partition the episodes; the rules (spread: one piece of
a saved stream per new row, :func:`_split_pieces`; merge: :func:`_balance`; each row's
newest episodes kept, :func:`_fit`): docs/semantics.md, "Checkpoints".
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from shardreplay.errors import ConfigError
from shardreplay.kernels.plan import balance_longest_first


@dataclass(frozen=True)
class EpisodeTable:
    """The saved episodes of all parts, in canonical order (part, row, start): an
    episode's index is its new id, unique across all new shards.

    Per episode: its part, start index and length in that part, its saved row, and its
    age (steps stored after it in that row). All int64 arrays of one length.
    """

    part: np.ndarray
    start: np.ndarray
    length: np.ndarray
    row: np.ndarray
    age: np.ndarray

    def __len__(self) -> int:
        return int(self.part.shape[0])


@dataclass(frozen=True)
class NewLayout:
    """The rows of every new shard: shard ``s`` has ``num_streams[s]`` rows of
    ``stream_capacity[s]`` slots. Global row ``offsets[s] + r`` is row ``r`` of shard ``s``.

    Raises:
        ConfigError: no shard, or a shard without rows or slots.
    """

    num_streams: tuple[int, ...]
    stream_capacity: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.num_streams or len(self.num_streams) != len(self.stream_capacity) or \
                min(self.num_streams) < 1 or min(self.stream_capacity) < 1:
            raise ConfigError(f"a restore layout needs >= 1 shard, each with >= 1 row of >= 1 slot; got "
                              f"rows {self.num_streams}, capacities {self.stream_capacity}")

    @classmethod
    def even(cls, num_shards: int, num_streams: int, stream_capacity: int) -> NewLayout:
        """``num_shards`` shards alike."""
        return cls((num_streams,) * num_shards, (stream_capacity,) * num_shards)

    @property
    def num_shards(self) -> int:
        """How many new shards."""
        return len(self.num_streams)

    @property
    def total_rows(self) -> int:
        """Rows over all new shards."""
        return sum(self.num_streams)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The global index of each shard's first row."""
        return tuple(int(x) for x in np.cumsum((0, *self.num_streams[:-1])))

    def capacity(self) -> int:
        """Slots over all new shards."""
        return sum(n * c for n, c in zip(self.num_streams, self.stream_capacity, strict=True))

    def interleaved_rows(self) -> np.ndarray:
        """Global row ids ordered row 0 of every shard, then row 1 of every shard that has
        one, ...: the first (largest) bins of a merge spread over all shards."""
        shard = np.repeat(np.arange(self.num_shards), self.num_streams)
        offsets = np.asarray(self.offsets, np.int64)
        row = np.arange(self.total_rows, dtype=np.int64) - offsets[shard]
        return np.lexsort((shard, row)).astype(np.int64)


@dataclass(frozen=True)
class ShardPlan:
    """What one new shard receives, and what capacity made it drop.

    Per placed episode (row by row, in each row oldest first): its index in the
    :class:`EpisodeTable` (its new id), new row, offset in the row, and how many leading
    steps are skipped (an episode longer than the row keeps its newest steps). In merge
    mode, episodes no new row could take are counted on shard 0.
    """

    ids: np.ndarray
    row: np.ndarray
    offset: np.ndarray
    skip: np.ndarray
    row_lengths: np.ndarray
    dropped_episodes: int
    dropped_steps: int

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def plan_shard(episodes: EpisodeTable, layout: NewLayout, shard: int) -> ShardPlan:
    """The placements of new shard ``shard`` of ``layout`` (vectorised: no Python work
    per episode except the merge-mode balancing, which is compiled)."""
    rows, pre_dropped = assign_rows(episodes, layout)
    lengths, age = episodes.length, episodes.age
    num_streams, stream_capacity = layout.num_streams[shard], layout.stream_capacity[shard]
    first_row = layout.offsets[shard]
    out_ids, out_rows, out_offsets, out_skips = [], [], [], []
    row_lengths = np.zeros(num_streams, np.int64)
    dropped_eps = dropped_steps = 0
    if shard == 0:
        dropped_eps, dropped_steps = int(pre_dropped.shape[0]), int(lengths[pre_dropped].sum())
    for r in range(num_streams):
        ids = rows[first_row + r]
        in_row = ids[np.lexsort((ids, -age[ids]))]  # oldest first; ties: canonical order
        kept, skip, dropped = _fit(in_row, lengths[in_row], stream_capacity)
        placed = lengths[kept] - skip
        dropped_eps += int(dropped.shape[0])
        dropped_steps += int(lengths[dropped].sum() + skip.sum())
        out_ids.append(kept)
        out_rows.append(np.full(kept.shape[0], r, np.int64))
        out_offsets.append(np.cumsum(placed) - placed)
        out_skips.append(skip)
        row_lengths[r] = placed.sum()
    ids, row, offset, skip = (np.concatenate(xs).astype(np.int64)
                              for xs in (out_ids, out_rows, out_offsets, out_skips))
    return ShardPlan(ids, row, offset, skip, row_lengths, dropped_eps, dropped_steps)


def assign_rows(episodes: EpisodeTable, layout: NewLayout) -> tuple[list[np.ndarray], np.ndarray]:
    """Episode indices of every new row (global row ``layout.offsets[s] + r``), in
    canonical order, and the indices dropped before assignment (merge mode only)."""
    lengths = episodes.length
    ends = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # sum of [lo, hi) = ends[hi] - ends[lo]
    pieces = _saved_streams(episodes)
    total_rows = layout.total_rows
    if len(pieces) <= total_rows:
        pieces = _split_pieces(pieces, ends, layout)
        dealt = _deal_pieces(pieces, ends, layout)
        return [np.arange(lo, hi, dtype=np.int64) for lo, hi in dealt], np.empty(0, np.int64)
    kept, dropped = _drop_oldest(episodes, layout.capacity())
    rows_in_order = layout.interleaved_rows()
    bins = _balance(lengths[kept], _row_capacities(layout)[rows_in_order])
    row_of = rows_in_order[bins]
    order = np.argsort(row_of, kind="stable")  # canonical order within each row
    bounds = np.searchsorted(row_of[order], np.arange(total_rows + 1))
    return [kept[order[bounds[r]:bounds[r + 1]]] for r in range(total_rows)], dropped


def _saved_streams(episodes: EpisodeTable) -> list[tuple[int, int]]:
    """Runs ``[lo, hi)`` of consecutive episodes of one saved stream (same part and row)."""
    n = len(episodes)
    if n == 0:
        return []
    change = np.ones(n, bool)
    change[1:] = (episodes.part[1:] != episodes.part[:-1]) | (episodes.row[1:] != episodes.row[:-1])
    starts = np.flatnonzero(change).tolist()
    return list(zip(starts, [*starts[1:], n], strict=True))


def _split_pieces(pieces: list[tuple[int, int]], ends: np.ndarray, layout: NewLayout
                  ) -> list[tuple[int, int]]:
    """Split the largest piece at the episode boundary nearest its middle until there
    are ``total_rows`` pieces or none has two episodes. A split that would make the
    pieces overflow the rows more (:func:`_overflow`: rows of unequal capacity, where a
    half may go to a smaller row than the whole) is not made: that piece stays whole."""
    caps = np.sort(_row_capacities(layout))[::-1]
    uneven = bool(caps[0] != caps[-1])  # rows alike: a split never overflows more
    sizes = [int(ends[hi] - ends[lo]) for lo, hi in pieces]
    heap = [(-size, lo, hi) for size, (lo, hi) in zip(sizes, pieces, strict=True)]
    heapq.heapify(heap)
    done: list[tuple[int, int]] = []
    count = len(pieces)
    while heap and count < layout.total_rows:
        _size, lo, hi = heapq.heappop(heap)
        if hi - lo < 2:
            done.append((lo, hi))
            continue
        cut = lo + _best_cut(ends[lo + 1:hi + 1] - ends[lo])
        halves = [int(ends[cut] - ends[lo]), int(ends[hi] - ends[cut])]
        if uneven:
            others = [-s for s, _lo, _hi in heap] + [int(ends[b] - ends[a]) for a, b in done]
            whole = [*others, halves[0] + halves[1]]
            if _overflow([*others, *halves], caps) > _overflow(whole, caps):
                done.append((lo, hi))
                continue
        for a, b in ((lo, cut), (cut, hi)):
            heapq.heappush(heap, (-int(ends[b] - ends[a]), a, b))
        count += 1
    return sorted(done + [(lo, hi) for _s, lo, hi in heap])


def _overflow(sizes: list[int], caps_desc: np.ndarray) -> int:
    """Steps lost when pieces of ``sizes`` go one per row, the largest to the largest
    row (the least loss any one-piece-per-row assignment can have)."""
    ordered = np.sort(np.asarray(sizes, np.int64))[::-1]
    return int(np.maximum(ordered - caps_desc[:ordered.shape[0]], 0).sum())


def _best_cut(piece_ends: np.ndarray) -> int:
    """Index ``c`` in ``1..len-1`` splitting prefix sums ``piece_ends`` most evenly
    (ties: the smallest ``c``)."""
    return int(np.argmin(np.abs(2 * piece_ends[:-1] - piece_ends[-1]))) + 1


def _deal_pieces(pieces: list[tuple[int, int]], ends: np.ndarray, layout: NewLayout
                 ) -> list[tuple[int, int]]:
    """Each piece to its own row: largest first to a shard with a free row that holds
    it whole (where none does: with the longest rows), the least filled for its capacity
    among those (ties: lowest shard). Largest first, a piece finds a row that holds it
    whenever the pieces fit the rows at all (the i-th largest piece fits the i-th longest
    row). Fill is compared as the exact fraction ``filled / capacity`` (integer cross
    products), so every machine deals alike."""
    sizes = [int(ends[hi] - ends[lo]) for lo, hi in pieces]
    shard_cap = [n * c for n, c in zip(layout.num_streams, layout.stream_capacity, strict=True)]
    # One heap per row length: with rows alike this is the plain least-filled deal.
    heaps: dict[int, list[tuple[Fraction, int]]] = {}
    for s in range(layout.num_shards):
        heaps.setdefault(layout.stream_capacity[s], []).append((Fraction(0), s))
    filled = [0] * layout.num_shards
    per_shard: list[list[int]] = [[] for _ in range(layout.num_shards)]
    for k in sorted(range(len(pieces)), key=lambda k: (-sizes[k], k)):
        open_caps = [c for c, h in heaps.items() if h]
        holding = [c for c in open_caps if c >= sizes[k]]
        cap = min(holding, key=lambda c: heaps[c][0]) if holding else max(open_caps)
        _fill, s = heapq.heappop(heaps[cap])
        per_shard[s].append(k)
        filled[s] += sizes[k]
        if len(per_shard[s]) < layout.num_streams[s]:
            heapq.heappush(heaps[cap], (Fraction(filled[s], shard_cap[s]), s))
    rows = [(0, 0)] * layout.total_rows
    for s, ks in enumerate(per_shard):
        for r, k in enumerate(sorted(ks)):
            rows[layout.offsets[s] + r] = pieces[k]
    return rows


def _drop_oldest(episodes: EpisodeTable, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Drop the oldest episodes (ties: canonical order) until the rest hold at most
    ``capacity`` steps; returns (kept, dropped) indices, each sorted."""
    n = len(episodes)
    excess = int(episodes.length.sum()) - capacity
    if excess <= 0:
        return np.arange(n, dtype=np.int64), np.empty(0, np.int64)
    order = np.lexsort((np.arange(n), -episodes.age))
    count = int(np.searchsorted(np.cumsum(episodes.length[order]), excess, side="left")) + 1
    keep = np.ones(n, bool)
    keep[order[:count]] = False
    return np.flatnonzero(keep).astype(np.int64), np.sort(order[:count]).astype(np.int64)


def _balance(sizes: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Greedy longest-first: each item to the bin least filled for its capacity
    ``caps[b]`` (ties: lowest index)."""
    order = np.argsort(-sizes, kind="stable")
    return balance_longest_first(order.astype(np.int64), sizes.astype(np.int64), caps.astype(np.int64))


def _row_capacities(layout: NewLayout) -> np.ndarray:
    """The capacity of every global row."""
    return np.repeat(np.asarray(layout.stream_capacity, np.int64), np.asarray(layout.num_streams, np.int64))


def _fit(ids: np.ndarray, lengths: np.ndarray, capacity: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keep the newest episodes (the last of ``ids``) that fit ``capacity``; returns
    (kept, skips, dropped). The newest is kept even when longer than the row: it then
    skips its oldest steps."""
    n = ids.shape[0]
    if n == 0:
        return ids, np.empty(0, np.int64), ids
    newest_first = np.cumsum(lengths[::-1])
    keep = max(1, int(np.searchsorted(newest_first, capacity, side="right")))
    skips = np.zeros(keep, np.int64)
    skips[0] = max(0, int(newest_first[keep - 1]) - capacity)
    return ids[n - keep:], skips, ids[:n - keep]
