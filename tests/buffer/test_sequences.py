"""Sequence windows (R2D2): starts every ``period`` steps of an episode, burn-in, stored
start state and sequence priorities (docs/semantics.md, "Sequence windows").

The window starts are checked against a plain-Python reference over random streams
(episode ends, abandoned episodes, wrapped rings, chunks and single steps); priorities
against the formula and, statistically, the draw (chi-square, fixed seeds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

import shardreplay as sr
from shardreplay import testing
from shardreplay.buffer.sequences import learn_mask
from shardreplay.errors import ConfigError, SpecMismatchError
from tests.support.sequences import FIRST, LAST, MID, SPEC, reference_starts, timelines, write

# Named by the tests below as they read.
_timelines, _write, reference_starts = timelines, write, reference_starts


@pytest.mark.slow  # 20 examples, numba compiles on the first: 20-110 s on a loaded machine
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(1, 6), period_frac=st.floats(0, 1), cap_extra=st.integers(0, 8),
       streams=st.integers(1, 3), steps=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_starts_match_the_reference(window: int, period_frac: float, cap_extra: int, streams: int,
                                    steps: int, seed: int) -> None:
    period = 1 + int(period_frac * (window - 1))
    cap = window + cap_extra
    rng = np.random.default_rng(seed)
    timelines = _timelines(rng, streams, steps)
    buf = sr.ReplayBuffer(SPEC, num_streams=streams, stream_capacity=cap, window=window, period=period,
                          sampler="prioritized", seed=seed)
    _write(buf, timelines, rng)
    want = reference_starts(timelines, cap, window, period)
    valid = testing.valid(buf)
    got = {(row, int(q)) for row in range(streams) for q in range(max(0, steps - cap), steps)
           if valid[row * cap + q % cap]}
    assert got == set(want)
    assert len(buf) == len(want) == testing.sampler_counters(buf)["samplable"]
    if want:  # every drawn window is a reference window, with its mask
        batch = buf.sample(64)
        obs, mask = batch.data["obs"].numpy(), batch.mask.numpy()
        for b in range(obs.shape[0]):
            start = (int(obs[b, 0, 0]), int(obs[b, 0, 1]))
            assert mask[b].sum() == want[start]
            np.testing.assert_array_equal(obs[b, :want[start], 1], start[1] + np.arange(want[start]))


def test_state_dict_keeps_the_grid_and_refuses_another_period() -> None:
    rng = np.random.default_rng(3)
    timelines = _timelines(rng, 2, 50)
    buf = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=16, window=5, period=3, seed=1)
    _write(buf, timelines, rng)
    state = buf.state_dict()
    again = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=16, window=5, period=3, seed=1)
    again.load_state_dict(state)
    np.testing.assert_array_equal(testing.valid(again), testing.valid(buf))
    # The grid goes on: the next writes validate the same starts in both.
    more = _timelines(np.random.default_rng(4), 2, 9)
    _write(buf, more, np.random.default_rng(5))
    _write(again, more, np.random.default_rng(5))
    np.testing.assert_array_equal(testing.valid(again), testing.valid(buf))
    other = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=16, window=5, period=2)
    with pytest.raises(ConfigError, match="period"):
        other.load_state_dict(state)


@pytest.mark.parametrize("period", [0, 6, 2.0, True])
def test_period_out_of_range_is_refused(period: object) -> None:
    with pytest.raises(ConfigError, match="period"):
        sr.ReplayBuffer(SPEC, num_streams=1, stream_capacity=16, window=5, period=period)  # type: ignore[arg-type]


def test_sample_sequences_gives_start_state_and_burn_in_mask() -> None:
    buf = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=64, window=6, period=3, seed=0)
    timelines = [[FIRST] + [MID] * 9 + [LAST], [FIRST] + [MID] * 30]
    _write(buf, [tl + [FIRST] * (31 - len(tl)) for tl in timelines], np.random.default_rng(0))
    seq = sr.sample_sequences(buf, 256, burn_in=2, state=("h",))
    data = seq.batch.data
    torch.testing.assert_close(seq.start_state["h"], data["h"][:, 0], rtol=0, atol=0)
    assert not seq.learn_mask[:, :2].any()
    assert torch.equal(seq.learn_mask[:, 2:], seq.batch.mask[:, 2:])
    # The episode of row 0 ends (LAST) at time 10: starts 0, 3, 6, 9 only; the last two
    # windows end at the LAST (5 and 2 steps unmasked), and 9's is all burn-in and padding.
    start_t = data["obs"][:, 0, 1]
    row0 = data["obs"][:, 0, 0] == 0
    assert set(start_t[row0].tolist()) == {0, 3, 6, 9}
    for t, unmasked, learned in ((6, 5, 3), (9, 2, 0), (0, 6, 4)):
        rows = row0 & (start_t == t)
        assert (seq.batch.mask[rows].sum(1) == unmasked).all()
        assert (seq.learn_mask[rows].sum(1) == learned).all()
    with pytest.raises(ConfigError, match="burn_in"):
        sr.sample_sequences(buf, 4, burn_in=6)
    with pytest.raises(SpecMismatchError, match="state fields"):
        sr.sample_sequences(buf, 4, burn_in=1, state=("core",))
    with pytest.raises(ConfigError, match="burn_in"):
        learn_mask(torch.ones(2, 6, dtype=torch.bool), -1)


def test_sequence_priorities_formula() -> None:
    rng = np.random.default_rng(0)
    td = rng.normal(size=(5, 7))
    mask = rng.random((5, 7)) < 0.6
    mask[4] = False
    got = sr.sequence_priorities(torch.from_numpy(td), torch.from_numpy(mask)).numpy()
    for b in range(4):
        d = np.abs(td[b][mask[b]])
        want = 0.9 * d.max() + 0.1 * d.mean() if d.size else 0.0
        assert got[b] == pytest.approx(want, rel=1e-6)
    assert got[4] == 0.0 and got.dtype == np.float32
    half = sr.sequence_priorities(torch.from_numpy(td), torch.from_numpy(mask), eta=0.5).numpy()
    d = np.abs(td[0][mask[0]])
    assert half[0] == pytest.approx(0.5 * d.max() + 0.5 * d.mean(), rel=1e-6)
    with pytest.raises(ConfigError, match="NaN"):
        sr.sequence_priorities(torch.tensor([[float("nan")]]), torch.tensor([[True]]))
    with pytest.raises(ConfigError, match=r"\[B, T\]"):
        sr.sequence_priorities(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


def test_sequence_priorities_set_the_draw_chi_square() -> None:
    """Priorities set through update_priorities: the draw is p^alpha over the grid's starts."""
    alpha = 0.7
    buf = sr.ReplayBuffer(SPEC, num_streams=3, stream_capacity=40, window=8, period=4,
                          sampler="prioritized", alpha=alpha, seed=11)
    rng = np.random.default_rng(12)
    timelines = _timelines(rng, 3, 60)
    _write(buf, timelines, rng)
    want = reference_starts(timelines, 40, 8, 4)
    # Give every start a priority of its own through sampled keys.
    prio = {start: float(rng.uniform(0.1, 3.0)) for start in want}
    for _ in range(20):
        batch = buf.sample(256)
        obs = batch.data["obs"].numpy()[:, 0]
        buf.update_priorities(batch.keys, np.array([prio[(r, t)] for r, t in obs], np.float32))
    starts = sorted(want)
    index = {s: i for i, s in enumerate(starts)}
    counts = np.zeros(len(starts))
    for _ in range(40):
        obs = buf.sample(1024).data["obs"].numpy()[:, 0]
        np.add.at(counts, [index[(r, t)] for r, t in obs], 1)
    p = np.array([prio[s] for s in starts], np.float32).astype(np.float64) ** alpha
    expected = counts.sum() * p / p.sum()
    assert stats.chisquare(counts, expected).pvalue > 1e-3


def test_uniform_sequences_draw_without_listing_the_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """With period 40 about 1 slot in 40 starts a sequence: the uniform draw still rejects
    (cost independent of capacity) instead of listing every valid slot (O(capacity))."""
    from shardreplay.samplers import uniform

    buf = sr.ReplayBuffer(SPEC, num_streams=2, stream_capacity=4000, window=80, period=40, seed=0)
    t = np.arange(4000) % 500
    types = np.where(t == 0, FIRST, np.where(t == 499, LAST, MID)).astype(np.uint8)
    times = np.broadcast_to(t, (2, 4000))
    buf.extend({"obs": np.stack([np.zeros_like(times), times], -1), "h": np.zeros((2, 4000, 3), np.float32),
                "step_type": np.broadcast_to(types, (2, 4000))})
    assert len(buf) / buf.num_steps < 0.05  # below the rejection threshold of plain windows

    def listed(*_args: object) -> np.ndarray:
        raise AssertionError("listed every valid slot")

    monkeypatch.setattr(uniform, "_written_valid", listed)
    starts = buf.sample(256).data["obs"][:, 0, 1].numpy()
    assert (starts % 40 == 0).all()
