"""Which chunks a shard stored: per actor, sorted inclusive intervals of sequences.

A chunk is a duplicate only when its own ``(actor_id, sequence)`` was stored, never
because a later one was. An actor's record is a few intervals (consecutive sequences in
a life, a new clock reading per life)::

    stored 5 6 7   9 10        1_000_000 1_000_001      (2 lives, chunk 8 missing)
    -> [[5, 7], [9, 10], [1_000_000, 1_000_001]]

Beyond ``max_intervals`` per actor the two oldest intervals are joined (a WARNING says
how many). Saved with each checkpoint part as ``{"stored": {"<actor_id>": [[lo, hi],
...]}}``; an older part's ``{"high_water": {"<actor_id>": q}}`` reads as ``[[-(2**62), q]]``
(docs/semantics.md, "Chunks across crashes").
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from shardreplay.errors import CheckpointFormatError, ConfigError

__all__ = ["DEFAULT_MAX_INTERVALS", "OLD_MARK_FLOOR", "StoredIds", "merge_stored"]

log = logging.getLogger("shardreplay.learner")
DEFAULT_MAX_INTERVALS = 1024
OLD_MARK_FLOOR = -(2**62)  # the low end of an old part's high-water mark


class StoredIds:
    """Per actor, the sequences stored, as sorted disjoint inclusive intervals.

    Args:
        max_intervals: intervals kept per actor (see the module docstring).

    Raises:
        ConfigError: ``max_intervals`` below 1.
    """

    def __init__(self, max_intervals: int = DEFAULT_MAX_INTERVALS) -> None:
        if max_intervals < 1:
            raise ConfigError(f"max_intervals must be >= 1, got {max_intervals}")
        self.max_intervals = max_intervals
        # Per actor: the intervals' low ends and high ends, both sorted.
        self._lo: dict[int, list[int]] = {}
        self._hi: dict[int, list[int]] = {}

    def __contains__(self, identity: object) -> bool:
        """``(actor_id, sequence) in ids``: was that chunk stored."""
        if not isinstance(identity, tuple) or len(identity) != 2:
            return False
        actor, seq = identity
        lo = self._lo.get(actor)
        if not lo:
            return False
        i = bisect.bisect_right(lo, seq) - 1
        return i >= 0 and seq <= self._hi[actor][i]

    def add(self, actor_id: int, sequence: int) -> bool:
        """Record ``(actor_id, sequence)`` as stored; False when it was already."""
        lo = self._lo.get(actor_id)
        if lo is None:
            self._lo[actor_id], self._hi[actor_id] = [sequence], [sequence]
            return True
        hi = self._hi[actor_id]
        if sequence == hi[-1] + 1:  # the common case: the next chunk in order
            hi[-1] = sequence
            return True
        i = bisect.bisect_right(lo, sequence) - 1
        if i >= 0 and sequence <= hi[i]:
            return False
        joins_left = i >= 0 and hi[i] == sequence - 1
        joins_right = i + 1 < len(lo) and lo[i + 1] == sequence + 1
        if joins_left and joins_right:  # fills the one hole between two intervals
            hi[i] = hi[i + 1]
            del lo[i + 1], hi[i + 1]
        elif joins_left:
            hi[i] = sequence
        elif joins_right:
            lo[i + 1] = sequence
        else:
            lo.insert(i + 1, sequence)
            hi.insert(i + 1, sequence)
            self._bound(actor_id)
        return True

    def add_interval(self, actor_id: int, first: int, last: int) -> None:
        """Record every sequence in ``first .. last`` (inclusive) as stored."""
        if last < first:
            return
        lo = self._lo.setdefault(actor_id, [])
        hi = self._hi.setdefault(actor_id, [])
        # Intervals overlapping or touching [first, last] are absorbed into it.
        start = bisect.bisect_left(hi, first - 1)
        end = bisect.bisect_right(lo, last + 1)
        if start < end:
            first, last = min(first, lo[start]), max(last, hi[end - 1])
        lo[start:end] = [first]
        hi[start:end] = [last]
        self._bound(actor_id)

    def update(self, other: StoredIds) -> None:
        """Add every interval of ``other`` (the union)."""
        for actor, first, last in other.intervals():
            self.add_interval(actor, first, last)

    def intervals(self) -> Iterator[tuple[int, int, int]]:
        """``(actor_id, first, last)`` of every interval, by actor then sequence."""
        for actor in sorted(self._lo):
            yield from ((actor, a, b) for a, b in zip(self._lo[actor], self._hi[actor], strict=True))

    def actors(self) -> list[int]:
        """The actors with something stored, sorted."""
        return sorted(a for a, lo in self._lo.items() if lo)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"stored": {"<actor_id>": [[lo, hi], ...]}}``."""
        return {"stored": {str(a): [[x, y] for x, y in zip(self._lo[a], self._hi[a], strict=True)]
                           for a in self.actors()}}

    def load_state(self, state: Mapping[str, Any] | None) -> None:
        """Add what a saved part holds (this format, or an old ``high_water`` one).

        Raises:
            CheckpointFormatError: the state is not one of the two shapes.
        """
        state = state or {}
        try:
            for actor, pairs in (state.get("stored") or {}).items():
                for first, last in pairs:
                    self.add_interval(int(actor), int(first), int(last))
            for actor, mark in (state.get("high_water") or {}).items():
                self.add_interval(int(actor), OLD_MARK_FLOOR, int(mark))
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointFormatError(f"malformed ingest state in a checkpoint part: {exc}; expected "
                                        '{"stored": {"<actor>": [[lo, hi], ...]}}') from exc

    def _bound(self, actor_id: int) -> None:
        lo, hi = self._lo[actor_id], self._hi[actor_id]
        while len(lo) > self.max_intervals:
            presumed = lo[1] - hi[0] - 1
            log.warning("actor %d: more than %d gaps in its stored chunks; the %d sequences between %d and "
                        "%d are presumed stored from now on (a chunk among them would be dropped as a "
                        "duplicate)", actor_id, self.max_intervals - 1, presumed, hi[0], lo[1])
            hi[0] = hi[1]
            del lo[1], hi[1]


def merge_stored(states: Iterable[Mapping[str, Any] | None],
                 max_intervals: int = DEFAULT_MAX_INTERVALS) -> StoredIds:
    """The union of the stored chunks over the saved parts of one checkpoint.

    Raises:
        CheckpointFormatError: a part's state is malformed.
    """
    merged = StoredIds(max_intervals)
    for state in states:
        merged.load_state(state)
    return merged
