"""Chi-square tests of the sampling distributions (docs/semantics.md, sampling rule 3).

Fixed seeds, 40,000 draws each; a test passes when the chi-square p-value exceeds
1e-3. The negative controls show that the same test rejects a distribution only 10%
off, so a passing test means something.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from shardreplay import ReplayBuffer, testing
from tests.support.buffers import all_keys, filled_buffer, flat_slots
from tests.support.reference import FIRST, MID, SPEC

DRAWS = 40_000
P_MIN = 1e-3


def _counts(buf, n_slots_total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw counts per flat slot, and each draw's slot and reported probability."""
    batch = buf.sample(DRAWS)
    slots = flat_slots(buf, batch.keys.numpy())
    return np.bincount(slots, minlength=n_slots_total), slots, batch.probabilities.numpy()


def _chisquare_p(counts: np.ndarray, expected_p: np.ndarray) -> float:
    drawable = expected_p > 0
    f_exp = expected_p[drawable] / expected_p[drawable].sum() * counts[drawable].sum()
    return float(chisquare(counts[drawable], f_exp).pvalue)


def _priorities(n: int, seed: int) -> np.ndarray:
    """Varied priorities in [0.2, 3], three of them 0."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.2, 3.0, n).astype(np.float32)
    p[rng.choice(n, 3, replace=False)] = 0.0
    return p


@pytest.mark.parametrize("window", [1, 2, 4])
def test_uniform_draws_each_valid_start_with_probability_one_over_n(window: int) -> None:
    buf = filled_buffer(window, sampler="uniform", seed=100 + window)
    valid = testing.valid(buf)
    counts, _, probs = _counts(buf, valid.size)
    assert counts[~valid].sum() == 0
    np.testing.assert_allclose(probs, 1.0 / valid.sum())
    assert _chisquare_p(counts, valid.astype(float)) > P_MIN


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 1.3])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_prioritized_draws_p_alpha_over_sum(alpha: float, window: int) -> None:
    buf = filled_buffer(window, sampler="prioritized", alpha=alpha, beta=0.4, seed=7 + window)
    keys, slots = all_keys(buf)
    prios = _priorities(keys.size, seed=window)
    assert buf.update_priorities(keys, prios) == keys.size
    expected = np.zeros(buf.capacity)
    # Independent of the library: p^alpha over p > 0 (a priority-0 start is never drawn).
    expected[slots] = np.where(prios > 0, prios.astype(np.float64) ** alpha, 0.0)
    expected /= expected.sum()

    counts, drawn, probs = _counts(buf, buf.capacity)
    assert counts[expected == 0].sum() == 0, "a start of priority 0 (or an invalid one) was drawn"
    np.testing.assert_allclose(probs, expected[drawn], rtol=1e-9)
    assert _chisquare_p(counts, expected) > P_MIN


@pytest.mark.parametrize("alpha", [0.5, 1.3])
def test_reported_probabilities_are_the_drawing_probabilities(alpha: float) -> None:
    buf = filled_buffer(2, sampler="prioritized", alpha=alpha, seed=3)
    keys, slots = all_keys(buf)
    prios = _priorities(keys.size, seed=11)
    buf.update_priorities(keys, prios)
    expected = np.zeros(buf.capacity)
    expected[slots] = np.where(prios > 0, prios.astype(np.float64) ** alpha, 0.0)
    expected /= expected.sum()
    batch = buf.sample(2000)
    np.testing.assert_allclose(batch.probabilities.numpy(),
                               expected[flat_slots(buf, batch.keys.numpy())], rtol=1e-9)


def test_negative_control_chisquare_rejects_a_slightly_wrong_distribution() -> None:
    # The same machinery, against P perturbed by +-10%: the p-value must collapse.
    alpha = 1.0
    buf = filled_buffer(2, sampler="prioritized", alpha=alpha, seed=5)
    keys, slots = all_keys(buf)
    prios = _priorities(keys.size, seed=2)
    buf.update_priorities(keys, prios)
    expected = np.zeros(buf.capacity)
    expected[slots] = np.where(prios > 0, prios.astype(np.float64) ** alpha, 0.0)
    counts, _, _ = _counts(buf, buf.capacity)
    assert _chisquare_p(counts, expected) > P_MIN
    wrong = expected.copy()
    drawable = np.flatnonzero(wrong > 0)
    wrong[drawable[::2]] *= 1.1
    wrong[drawable[1::2]] *= 0.9
    assert _chisquare_p(counts, wrong) < 1e-6
    # Uniform (the alpha=0 answer) is also told apart from p^1.
    assert _chisquare_p(counts, (expected > 0).astype(float)) < 1e-6


def test_negative_control_uniform_rejects_tilted_distribution() -> None:
    buf = filled_buffer(1, sampler="uniform", seed=9)
    valid = testing.valid(buf)
    counts, _, _ = _counts(buf, valid.size)
    tilted = valid.astype(float)
    tilted[np.flatnonzero(valid)[:4]] *= 1.15
    assert _chisquare_p(counts, valid.astype(float)) > P_MIN
    assert _chisquare_p(counts, tilted) < 1e-6


def test_uniform_is_uniform_when_few_slots_are_valid() -> None:
    # 10 valid starts among 400 slots: the sampler lists valid slots instead of rejecting.
    buf = ReplayBuffer(SPEC, num_streams=4, stream_capacity=100, window=3, seed=17)
    types = np.array([[FIRST] + [MID] * 11])
    buf.extend({"obs": np.zeros((1, 12, 2)), "act": np.arange(12)[None], "step_type": types},
               stream_ids=[2])
    valid = testing.valid(buf)
    assert valid.sum() == 10 and valid.sum() / valid.size < 0.05
    counts, _, probs = _counts(buf, valid.size)
    assert counts[~valid].sum() == 0
    np.testing.assert_allclose(probs, 0.1)
    assert _chisquare_p(counts, valid.astype(float)) > P_MIN
