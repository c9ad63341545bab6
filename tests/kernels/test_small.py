"""The small kernels against tests/kernels/reference.py: uniform draws, restore-plan
balancing, running episode returns."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from shardreplay.kernels.plan import balance_longest_first
from shardreplay.kernels.returns import track_returns
from shardreplay.kernels.sampling import draw_written, written_total
from tests.kernels import reference as ref

FIRST, MID, LAST = 0, 1, 2
NO_ROWS = np.zeros((0, 3), np.int64)  # no storage rows to prefetch


@pytest.mark.parametrize("pos", [[7], [5, 5, 5], [3, 0, 6, 1], [0, 4], [9, 9, 9, 2], [1], [0, 0], [8, 11]])
def test_draw_written(pos: list[int]) -> None:
    rng = np.random.default_rng(len(pos) + sum(pos))
    cap = 6
    valid = rng.random(cap * len(pos) + 2) < 0.6
    positions = np.array(pos, np.int64)
    for size, got0, n_raw in ((10, 0, 40), (10, 4, 40), (3, 3, 5), (10, 0, 0), (200, 0, 64)):
        raw = rng.bit_generator.random_raw(n_raw)
        fast, slow = np.full(size, -1), np.full(size, -1)
        assert (draw_written(raw, positions, cap, valid, fast, got0, NO_ROWS)
                == ref.draw_written(raw, positions, cap, valid, slow, got0))
        np.testing.assert_array_equal(fast, slow)
        written = np.concatenate([r * cap + np.arange(min(p, cap)) for r, p in enumerate(pos)])
        assert np.isin(fast[got0:][fast[got0:] >= 0], written[valid[written]]).all()


def test_draw_written_is_uniform_over_valid_written_slots() -> None:
    """Unequal rows (a search per draw) and a written count far from a power of two
    (many words rejected): every valid written slot as likely, chi-square."""
    rng = np.random.default_rng(5)
    cap, pos = 40, np.array([40, 13, 0, 33, 57], np.int64)
    valid = rng.random(cap * pos.shape[0]) < 0.7
    out = np.empty(200_000, np.int64)
    got = 0
    while got < out.shape[0]:
        got = draw_written(rng.bit_generator.random_raw(100_000), pos, cap, valid, out, got, NO_ROWS)
    assert written_total(pos, cap) == 40 + 13 + 33 + 40
    allowed = np.concatenate([r * cap + np.arange(min(p, cap)) for r, p in enumerate(pos)])
    allowed = allowed[valid[allowed]]
    counts = np.bincount(out, minlength=valid.shape[0])
    assert counts.sum() == counts[allowed].sum()  # nothing outside the valid written slots
    assert stats.chisquare(counts[allowed]).pvalue > 1e-3


def test_balance_longest_first() -> None:
    rng = np.random.default_rng(4)
    for items, bins in ((0, 3), (1, 1), (1, 4), (20, 3), (50, 7)):
        sizes = rng.integers(0, 10, items)
        order = np.argsort(-sizes, kind="stable").astype(np.int64)
        for caps in (np.full(bins, 12), rng.integers(1, 40, bins)):  # rows alike, and not
            np.testing.assert_array_equal(
                balance_longest_first(order, sizes.astype(np.int64), caps.astype(np.int64)),
                ref.balance_longest_first(order, sizes, caps))


def test_balance_longest_first_fills_bins_for_their_capacity() -> None:
    """Bins of 5 and 40: 30 steps in 2-step items go 4 : 26, not 16 : 14."""
    sizes = np.full(15, 2, np.int64)
    assign = balance_longest_first(np.arange(15, dtype=np.int64), sizes, np.array([5, 40], np.int64))
    assert np.bincount(assign, weights=sizes).tolist() == [4.0, 26.0]


@pytest.mark.parametrize("seed", range(3))
def test_track_returns(seed: int) -> None:
    rng = np.random.default_rng(seed)
    streams = 5
    running, last = rng.normal(size=streams), np.zeros(streams)
    running_ref, last_ref = running.copy(), last.copy()
    for t_len in (1, 4, 9):
        rows = rng.permutation(streams)[:3].astype(np.int64)
        types = rng.choice([FIRST, MID, MID, LAST], (3, t_len)).astype(np.uint8)
        reward = rng.normal(size=(3, t_len)).astype(np.float32)
        finished = np.empty(types.size)
        n = track_returns(rows, reward, types, running, last, finished)
        want = ref.track_returns(rows, reward, types, running_ref, last_ref)
        np.testing.assert_array_equal(finished[:n], want)
        np.testing.assert_array_equal(running, running_ref)
        np.testing.assert_array_equal(last, last_ref)
