"""The small kernels against kernels/reference/small.py: uniform acceptance, n-step
returns, restore-plan balancing, running episode returns."""

from __future__ import annotations

import numpy as np
import pytest

from shardreplay.kernels.nstep import nstep_scalar
from shardreplay.kernels.plan import balance_longest_first
from shardreplay.kernels.reference import small as ref
from shardreplay.kernels.returns import track_returns
from shardreplay.kernels.sampling import accept_valid, accept_written

FIRST, MID, LAST = 0, 1, 2


@pytest.mark.parametrize("seed", range(3))
def test_accept_valid(seed: int) -> None:
    rng = np.random.default_rng(seed)
    valid = rng.random(50) < 0.4
    for size, got0, n_cand in ((10, 0, 40), (10, 7, 40), (10, 10, 5), (1, 0, 1), (5, 0, 0)):
        cand = rng.integers(0, 50, n_cand)
        fast, slow = np.full(size, -1), np.full(size, -1)
        assert accept_valid(cand, valid, fast, got0) == ref.accept_valid(cand, valid, slow, got0)
        np.testing.assert_array_equal(fast, slow)


@pytest.mark.parametrize("lengths", [[7], [5, 5, 5], [3, 0, 6, 1], [0, 4], [6, 6, 6, 2]])
def test_accept_written(lengths: list[int]) -> None:
    rng = np.random.default_rng(len(lengths))
    cap = 6
    valid = rng.random(cap * len(lengths) + 2) < 0.6
    ends = np.cumsum(np.minimum(lengths, cap))
    for size, got0 in ((10, 0), (10, 4), (3, 3)):
        cand = rng.integers(0, ends[-1], 40)
        fast, slow = np.full(size, -1), np.full(size, -1)
        assert (accept_written(cand, ends, cap, valid, fast, got0)
                == ref.accept_written(cand, ends, cap, valid, slow, got0))
        np.testing.assert_array_equal(fast, slow)


@pytest.mark.parametrize(("window", "n", "dtype"),
                         [(2, 1, np.float64), (4, 3, np.float64), (5, 2, np.float32), (2, 1, np.float32)])
def test_nstep_scalar(window: int, n: int, dtype: type) -> None:
    rng = np.random.default_rng(window * 10 + n)
    batch = 64
    idx = rng.integers(0, 100, (batch, window))
    ends = rng.integers(1, window + 1, batch)  # steps kept: a LAST at ends - 1 (or none)
    mask = np.arange(window)[None, :] < ends[:, None]
    reward, discount = rng.normal(size=100).astype(dtype), rng.choice([0.0, 1.0], 100, p=[0.2, 0.8])
    ret, boot = np.empty(batch, dtype), np.empty(batch, dtype)
    m, last = np.empty(batch, np.int64), np.empty(batch, np.int64)
    nstep_scalar(idx, mask, reward, discount.astype(np.float32), 0.97, n, ret, boot, m, last)
    want = ref.nstep_scalar(idx, mask, reward, discount.astype(np.float32), 0.97, n)
    tol = 1e-12 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(ret, want[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(boot, want[1], rtol=tol, atol=tol)
    np.testing.assert_array_equal(m, want[2])
    np.testing.assert_array_equal(last, want[3])
    assert (m < n).any() and (m == n).any()


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
