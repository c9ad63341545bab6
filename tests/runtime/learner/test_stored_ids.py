"""StoredIds: which chunks a shard stored, as per-actor intervals of sequences."""

from __future__ import annotations

import itertools
import logging
import random

import pytest

from shardreplay.errors import CheckpointFormatError, ConfigError
from shardreplay.runtime.learner.ingest import StoredIds, merge_stored


def _intervals(ids: StoredIds, actor: int = 0) -> list[tuple[int, int]]:
    return [(a, b) for x, a, b in ids.intervals() if x == actor]


def test_a_later_chunk_never_makes_an_earlier_one_a_duplicate() -> None:
    ids = StoredIds()
    assert ids.add(0, 11) and ids.add(0, 12)
    assert (0, 10) not in ids  # a high-water mark would have said "stored"
    assert ids.add(0, 10)
    assert not ids.add(0, 11)
    assert _intervals(ids) == [(10, 12)]


@pytest.mark.parametrize("order", [[5, 7, 6], [7, 5, 6], [6, 5, 7], [1, 9, 5, 3, 7, 2, 8, 4, 6]])
def test_adds_join_touching_intervals(order: list[int]) -> None:
    ids = StoredIds()
    for q in order:
        assert ids.add(3, q)
    assert _intervals(ids, 3) == [(min(order), max(order))]
    assert (3, min(order) - 1) not in ids and (3, max(order) + 1) not in ids and (4, min(order)) not in ids


def test_random_adds_match_a_set() -> None:
    rng = random.Random(7)
    ids, reference = StoredIds(), set()
    for _ in range(3000):
        q = rng.randrange(400)
        assert ids.add(1, q) == (q not in reference)
        reference.add(q)
    assert {q for q in range(-5, 405) if (1, q) in ids} == reference
    pairs = _intervals(ids, 1)
    assert all(b + 1 < c for (_, b), (c, _) in itertools.pairwise(pairs))  # disjoint, not touching


def test_add_interval_absorbs_what_it_overlaps_or_touches() -> None:
    ids = StoredIds()
    for q in (1, 5, 9, 20):
        ids.add(0, q)
    ids.add_interval(0, 4, 10)
    assert _intervals(ids) == [(1, 1), (4, 10), (20, 20)]
    ids.add_interval(0, 2, 3)  # touches both neighbours
    assert _intervals(ids) == [(1, 10), (20, 20)]
    ids.add_interval(0, 30, 29)  # empty: nothing
    assert _intervals(ids) == [(1, 10), (20, 20)]


def test_the_bound_joins_the_oldest_intervals_and_says_how_many_it_presumes(caplog) -> None:
    ids = StoredIds(max_intervals=3)
    for q in (0, 10, 20):
        ids.add(0, q)
    with caplog.at_level(logging.WARNING, logger="shardreplay.learner"):
        ids.add(0, 30)
    assert _intervals(ids) == [(0, 10), (20, 20), (30, 30)]
    assert (0, 5) in ids  # presumed stored
    assert "the 9 sequences between 0 and 10 are presumed stored" in caplog.text
    with pytest.raises(ConfigError):
        StoredIds(max_intervals=0)


def test_state_round_trip_and_union() -> None:
    a, b = StoredIds(), StoredIds()
    for q in (1, 2, 3, 7):
        a.add(0, q)
    b.add_interval(0, 4, 5)
    b.add(2, 100)
    merged = merge_stored([a.state_dict(), b.state_dict(), None])
    assert merged.state_dict() == {"stored": {"0": [[1, 5], [7, 7]], "2": [[100, 100]]}}
    assert (2, 100) in merged and (2, 99) not in merged
    with pytest.raises(CheckpointFormatError, match="malformed ingest state"):
        merge_stored([{"stored": {"0": [[1]]}}])
