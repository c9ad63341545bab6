"""The sum tree on its own: sums equal the leaf sums after updates, the prefix search
returns the right leaf (boundaries and zero leaves included), weighted draws follow p
(chi-square, fixed seed), all against tests/kernels/reference.py."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from shardreplay.kernels import sum_tree as kern
from shardreplay.samplers import SumMinTree
from tests.kernels import reference as ref

SIZES = [1, 2, 7, 8, 9, 64, 65, 1000]


def _levels(tree: SumMinTree) -> list[np.ndarray]:
    return [tree.sums[tree.offsets[i]:tree.offsets[i] + tree.sizes[i]] for i in range(len(tree.sizes))]


def _set(tree: SumMinTree, slots: np.ndarray, priority: np.ndarray, valid: np.ndarray, alpha: float,
         new: np.ndarray | None = None) -> float:
    """The sampler's call: leaves of ``slots`` from ``priority`` (storing ``new`` there first)."""
    return kern.set_from_priorities(tree.sums, tree.mins, tree.sizes, tree.offsets, slots.astype(np.int64),
                                    valid, priority, alpha, np.zeros(0, np.float32) if new is None else new)


def _check(tree: SumMinTree, leaves: np.ndarray) -> None:
    for got, want in zip(_levels(tree), ref.level_sums(leaves, tree.sizes), strict=True):
        np.testing.assert_array_equal(got, want)
    mins = [tree.mins[tree.offsets[i]:tree.offsets[i] + tree.sizes[i]] for i in range(len(tree.sizes) - 1)]
    for got, want in zip(mins, ref.level_mins(leaves, tree.sizes), strict=True):
        np.testing.assert_array_equal(got, want)
    assert tree.min_positive == ref.min_positive(leaves)
    assert tree.sums.ctypes.data % 64 == 0  # a node's 8 children: one cache line


@pytest.mark.parametrize("n", SIZES)
def test_sums_equal_the_leaf_sums_after_updates(n: int) -> None:
    rng = np.random.default_rng(n)
    tree = SumMinTree(n)
    priority = np.zeros(n, np.float32)
    valid = np.zeros(n, bool)
    for i in range(30):
        slots = rng.integers(0, n, int(rng.integers(0, n + 1)))  # empty, repeated slots too
        if i % 2:  # in order (ancestors shared by neighbours), and in any order (sorted first)
            slots.sort()
        priority[slots] = rng.choice([0.0, 0.5, 1.0, 3.0], slots.shape[0]) * rng.random(slots.shape[0])
        valid[slots] = rng.random(slots.shape[0]) < 0.8
        _set(tree, slots, priority, valid, 0.6)
        leaves = ref.leaves_from_priorities(valid, priority, 0.6)
        np.testing.assert_array_equal(tree.leaves(np.arange(n)), leaves)
        _check(tree, leaves)
    # Order does not matter: a tree rebuilt at once equals the updated one, bit for bit.
    rebuilt = SumMinTree(n)
    rebuilt.rebuild(kern.leaves_from_priorities(valid, priority, 0.6))
    np.testing.assert_array_equal(rebuilt.sums, tree.sums)
    np.testing.assert_array_equal(rebuilt.mins, tree.mins)


def test_new_priorities_are_stored_in_order_and_their_maximum_returned() -> None:
    tree = SumMinTree(20)
    priority = np.zeros(20, np.float32)
    valid = np.ones(20, bool)
    valid[12] = False
    top = _set(tree, np.array([3, 7, 3, 12]), priority, valid, 0.6,
               np.array([5.0, 1.0, 2.0, 0.5], np.float32))
    assert top == 5.0
    assert priority[[3, 7, 12]].tolist() == [2.0, 1.0, 0.5]  # a repeated slot keeps its last
    leaves = ref.leaves_from_priorities(valid, priority, 0.6)
    np.testing.assert_array_equal(tree.leaves(np.arange(20)), leaves)
    _check(tree, leaves)
    assert _set(tree, np.array([3]), priority, valid, 0.6) == 0.0  # nothing new


def test_priority_zero_and_invalid_slots_get_no_mass_even_with_alpha_zero() -> None:
    tree = SumMinTree(10)
    priority = np.array([0, 1, 2, 0, 5, 0, 0, 0, 0, 7], np.float32)
    valid = np.array([1, 1, 0, 1, 1, 0, 0, 0, 0, 1], bool)
    _set(tree, np.arange(10), priority, valid, 0.0)
    np.testing.assert_array_equal(tree.leaves(np.arange(10)), [0, 1, 0, 0, 1, 0, 0, 0, 0, 1])
    assert tree.total == 3.0 and tree.min_positive == 1.0
    _set(tree, np.arange(10), np.zeros(10, np.float32), valid, 0.0)
    assert tree.total == 0.0 and tree.min_positive == np.inf


@pytest.mark.parametrize("seed", range(4))
def test_set_from_keys_is_resolve_then_set_and_stamps_the_applied_blocks(seed: int) -> None:
    """One call of the learner's update equals keys.resolve_keys, then set_from_priorities of
    the current keys' slots, then the applied blocks stamped; a bad key or priority changes
    nothing."""
    from shardreplay.kernels import keys as codec

    rng = np.random.default_rng(seed)
    n, tag, epoch, block = 200, 5, int(rng.integers(0, 3000)), kern.PRIORITY_BLOCK
    generation = rng.integers(0, 4, n).astype(np.uint32)  # 0: never written, no key is current
    valid = rng.random(n) < 0.9
    slots = rng.integers(0, n, 64)
    keys = ref.encode_keys(np.zeros(64, np.int64), np.full(64, tag), slots,
                           generation[slots] + epoch + rng.integers(-1, 1, 64))  # current or stale
    new = rng.random(64).astype(np.float32)
    want_tree, got_tree = SumMinTree(n), SumMinTree(n)
    want_prio, got_prio = np.ones(n, np.float32), np.ones(n, np.float32)
    want_marks, got_marks = np.zeros(-(-n // block), np.int64), np.zeros(-(-n // block), np.int64)
    status, _, s, v, m = codec.resolve_keys(keys, new, generation, n, epoch, tag)
    assert status == codec.OK and 0 < m < 64
    want_top = _set(want_tree, s[:m], want_prio, valid, 0.6, v[:m])
    want_marks[s[:m] // block] = 7 + m
    args = (got_tree.sums, got_tree.mins, got_tree.sizes, got_tree.offsets)
    got = kern.set_from_keys(*args, keys, new, generation, epoch, tag, valid, got_prio, 0.6, got_marks, 7)
    assert got == (codec.OK, -1, m, want_top)
    for a, b in ((got_tree.sums, want_tree.sums), (got_tree.mins, want_tree.mins), (got_prio, want_prio),
                 (got_marks, want_marks)):
        np.testing.assert_array_equal(a, b)
    before = [a.copy() for a in (got_tree.sums, got_tree.mins, got_prio, got_marks)]
    bad_key, bad_prio = keys.copy(), new.copy()
    bad_key[40] = -3
    bad_prio[9] = np.nan
    for k, p, want_status, at in ((bad_key, new, codec.BAD_KEY, 40), (keys, bad_prio, codec.BAD_PRIORITY, 9)):
        assert kern.set_from_keys(*args, k, p, generation, epoch, tag, valid, got_prio, 0.6, got_marks,
                                  99)[:3] == (want_status, at, 0)
        for a, b in zip((got_tree.sums, got_tree.mins, got_prio, got_marks), before, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n", SIZES)
def test_prefix_search_at_boundaries_and_past_zero_leaves(n: int) -> None:
    rng = np.random.default_rng(n + 1)
    leaves = rng.integers(0, 4, n).astype(np.float64)  # integers: every prefix sum is exact
    leaves[rng.random(n) < 0.3] = 0.0
    leaves[-1] = 0.0 if n > 1 else 1.0  # a zero last leaf: targets past the end skip it
    if not leaves.any():
        leaves[0] = 2.0
    tree = SumMinTree(n)
    tree.rebuild(leaves)
    cum = np.cumsum(leaves)
    targets = np.concatenate([[0.0], cum, cum - 0.5, cum + 0.5, [cum[-1], cum[-1] * 2]])  # every boundary
    targets = targets[targets >= 0]
    got = kern.find_prefix(tree.sums, tree.offsets, tree.levels, targets)
    assert (leaves[got] > 0).all()  # also for targets at or past the total
    below = targets < cum[-1]
    np.testing.assert_array_equal(got[below], ref.find_prefix(leaves, targets[below]))


@pytest.mark.parametrize("seed", range(3))
def test_prefix_search_on_float_leaves_lands_in_the_targets_range(seed: int) -> None:
    rng = np.random.default_rng(seed)
    leaves = rng.random(5000) ** 3
    leaves[rng.random(5000) < 0.2] = 0.0
    tree = SumMinTree(5000)
    tree.rebuild(leaves)
    targets = rng.random(20000) * tree.total
    got = kern.find_prefix(tree.sums, tree.offsets, tree.levels, targets)
    cum = np.cumsum(leaves)
    slack = 1e-9 * tree.total  # the tree adds in another order than cumsum
    assert (leaves[got] > 0).all()
    assert ((cum[got] - leaves[got] - slack <= targets) & (targets <= cum[got] + slack)).all()
    same = ref.find_prefix(leaves, targets) == got
    assert same.mean() > 0.999


def test_weighted_draws_follow_p_chi_square() -> None:
    rng = np.random.default_rng(7)
    n = 200
    leaves = rng.random(n) * 3
    leaves[::7] = 0.0
    tree = SumMinTree(n)
    tree.rebuild(leaves)
    u = rng.random(400_000)
    starts, prob, weights = kern.draw_weighted(tree.sums, tree.mins, tree.offsets, tree.levels, u, 0.4,
                                               np.zeros((0, 3), np.int64))  # no rows to prefetch
    p = leaves / leaves.sum()
    counts = np.bincount(starts, minlength=n)
    assert counts[p == 0].sum() == 0
    drawable = p > 0
    _stat, pvalue = stats.chisquare(counts[drawable], p[drawable] * u.shape[0])
    assert pvalue > 1e-3
    want_starts, want_prob, want_weights = ref.draw_weighted(leaves, u, 0.4)
    np.testing.assert_array_equal(starts, want_starts)
    np.testing.assert_allclose(prob, want_prob, rtol=1e-12)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
    assert weights.max() == pytest.approx(1.0)  # the smallest drawable leaf weighs 1
