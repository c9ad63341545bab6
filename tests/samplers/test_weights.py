"""Importance weights and the beta schedule (docs/semantics.md, sampling rule 3).

``w_i = (N P(i))^-beta / max_j (N P(j))^-beta`` with ``N = len(buffer)`` and the
maximum over every valid start that can be drawn (P > 0), not only the batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardreplay import LinearSchedule, ReplayBuffer, testing
from tests.support.buffers import all_keys, filled_buffer, flat_slots
from tests.support.reference import MID, SPEC


def _setup(alpha: float, beta, seed: int = 0):
    buf = filled_buffer(2, sampler="prioritized", alpha=alpha, beta=beta, seed=seed)
    keys, slots = all_keys(buf)
    rng = np.random.default_rng(seed)
    prios = rng.uniform(0.1, 4.0, keys.size).astype(np.float32)
    prios[:2] = 0.0  # valid but never drawn: must not enter the maximum
    prios[2] = 0.01  # the rarest drawable start: it sets the maximum weight
    buf.update_priorities(keys, prios)
    return buf, slots, prios


def _expected(buf, slots, prios, alpha, beta):
    """P and w per flat slot, from the formula (N = len(buf), max over all P > 0)."""
    n = len(buf)
    mass = np.where(prios > 0, prios.astype(np.float64) ** alpha, 0.0)
    p = np.zeros(buf.capacity)
    p[slots] = mass / mass.sum()
    w = np.full(buf.capacity, np.nan)
    drawable = p > 0
    raw = (n * p[drawable]) ** -beta
    w[drawable] = raw / raw.max()
    return p, w


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_weights_follow_the_formula_with_the_global_maximum(alpha: float, beta: float) -> None:
    buf, slots, prios = _setup(alpha, beta)
    assert len(buf) == slots.size  # N counts every valid start, priority 0 included
    p, w = _expected(buf, slots, prios, alpha, beta)
    rarest = slots[2]
    for size in (3, 64):
        batch = buf.sample(size)
        drawn = flat_slots(buf, batch.keys.numpy())
        np.testing.assert_allclose(batch.probabilities.numpy(), p[drawn], rtol=1e-9)
        np.testing.assert_allclose(batch.weights.numpy(), w[drawn], rtol=1e-5)
        if beta > 0 and rarest not in drawn:
            # Normalising by the batch maximum would have given some item weight 1.
            assert batch.weights.max().item() < 1.0
    assert batch.weights.dtype.is_floating_point and batch.probabilities.dtype.itemsize == 8


def test_weights_are_one_for_uniform_and_fifo() -> None:
    for sampler in ("uniform", "fifo"):
        batch = filled_buffer(2, sampler=sampler, seed=0).sample(10)
        assert (batch.weights.numpy() == 1.0).all()


def test_linear_beta_schedule_moves_one_step_per_sample_call() -> None:
    alpha, schedule = 0.8, LinearSchedule(0.2, 1.0, steps=4)
    buf, slots, prios = _setup(alpha, schedule, seed=1)
    calls_so_far = testing.sampler_counters(buf)["draws"]  # all_keys() sampled once already
    assert calls_so_far == 1
    for call in range(calls_so_far, calls_so_far + 6):
        beta = schedule(call)
        _, w = _expected(buf, slots, prios, alpha, beta)
        batch = buf.sample(32)
        drawn = flat_slots(buf, batch.keys.numpy())
        np.testing.assert_allclose(batch.weights.numpy(), w[drawn], rtol=1e-5,
                                   err_msg=f"call {call}, beta {beta}")
    assert schedule(calls_so_far + 5) == 1.0  # it ran to its end and stays there


def test_beta_schedule_position_changes_weights() -> None:
    # w(beta) = (P / P_min)^-beta, so at beta = 1 every weight is the cube of its beta = 1/3 value.
    buf, _, _ = _setup(1.0, LinearSchedule(0.0, 1.0, steps=3), seed=2)
    first = buf.sample(400)  # call 1 (all_keys made call 0): beta = 1/3
    for _ in range(3):
        last = buf.sample(400)  # calls 2, 3, 4: beta 2/3, 1, 1
    w_first = dict(zip(flat_slots(buf, first.keys.numpy()).tolist(), first.weights.tolist(), strict=True))
    w_last = dict(zip(flat_slots(buf, last.keys.numpy()).tolist(), last.weights.tolist(), strict=True))
    common = sorted(set(w_first) & set(w_last))
    assert len(common) > 5
    np.testing.assert_allclose([w_last[s] for s in common], [w_first[s] ** 3 for s in common], rtol=1e-5)
    assert min(w_last.values()) < 0.5  # the weights really moved


def test_weights_track_the_global_minimum_across_updates_in_a_large_tree() -> None:
    # 6 x 30 = 180 slots: the minimum lives in one of 12 blocks and moves as it is updated.
    alpha, beta = 0.9, 0.6
    buf = ReplayBuffer(SPEC, num_streams=6, stream_capacity=30, window=2, sampler="prioritized",
                       alpha=alpha, beta=beta, seed=4)
    buf.extend({"obs": np.zeros((6, 30, 2)), "act": np.zeros((6, 30), np.int64),
                "step_type": np.full((6, 30), MID)})
    keys, slots = all_keys(buf)
    prios = np.ones(keys.size, np.float32)
    rng = np.random.default_rng(8)
    for round_ in range(25):
        pick = rng.choice(keys.size, size=12, replace=False)
        new = rng.uniform(0.05, 5.0, 12).astype(np.float32)
        if round_ % 3 == 0:  # lift the current minimum: the next one must take over
            drawable = np.flatnonzero(prios > 0)
            pick[0] = drawable[np.argmin(prios[drawable])]
            new[0] = 10.0
        if round_ % 4 == 1:
            new[1] = 0.0
        buf.update_priorities(keys[pick], new)
        prios[pick] = new
        p, w = _expected(buf, slots, prios, alpha, beta)
        batch = buf.sample(64)
        drawn = flat_slots(buf, batch.keys.numpy())
        np.testing.assert_allclose(batch.probabilities.numpy(), p[drawn], rtol=1e-9)
        np.testing.assert_allclose(batch.weights.numpy(), w[drawn], rtol=1e-5,
                                   err_msg=f"round {round_}")
