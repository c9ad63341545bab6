"""n-step transitions: hand-made tables, and agreement with a plain per-item loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.nstep import Transitions, nstep_returns, nstep_transitions
from shardreplay.errors import ConfigError, SpecMismatchError

F, M, L = 0, 1, 2  # StepType values, written short so the tables stay readable


def make_batch(step_types, rewards, discounts, mask=None, obs=None, actions=None) -> Batch:
    """A Batch of windows given as nested lists [B][L]; obs default to 10*b + t."""
    st_ = torch.as_tensor(step_types).to(torch.uint8)
    b, length = st_.shape
    if obs is None:
        obs = (10 * torch.arange(b)[:, None] + torch.arange(length)[None, :]).float()[..., None]
    if actions is None:
        actions = torch.arange(b * length).view(b, length)
    if mask is None:
        mask = torch.ones(b, length, dtype=torch.bool)
    return Batch(
        data={"obs": torch.as_tensor(obs), "action": torch.as_tensor(actions),
              "reward": torch.as_tensor(rewards).to(torch.float32),
              "step_type": st_, "discount": torch.as_tensor(discounts).to(torch.float32),
              "episode_id": torch.zeros(b, length, dtype=torch.int64)},
        mask=torch.as_tensor(mask, dtype=torch.bool),
        keys=torch.arange(b, dtype=torch.int64),
        weights=torch.ones(b), probabilities=torch.full((b,), 1.0 / max(b, 1), dtype=torch.float64))


# -- exact tables: steps in -> numbers out ---------------------------------------------------
# Each row: step types, rewards, discounts, mask, gamma -> R, bootstrap discount, m.
TABLE = [
    pytest.param([M, M, M, M], [1, 2, 3, 4], [1, 1, 1, 1], [1, 1, 1, 1], 0.5,
                 2.75, 0.125, 3, id="full-window"),
    pytest.param([F, M, M, M], [1, 2, 3, 4], [1, 1, 1, 1], [1, 1, 1, 1], 0.5,
                 2.75, 0.125, 3, id="full-window-from-first"),
    pytest.param([M, M, L, L], [1, 2, 100, 100], [1, 1, 0, 0], [1, 1, 1, 0], 0.5,
                 2.0, 0.0, 2, id="termination-inside"),
    pytest.param([M, M, L, L], [1, 2, 100, 100], [1, 1, 1, 1], [1, 1, 1, 0], 0.5,
                 2.0, 0.25, 2, id="truncation-inside"),
    pytest.param([M, L, L, L], [7, 100, 100, 100], [1, 0, 0, 0], [1, 1, 0, 0], 0.9,
                 7.0, 0.0, 1, id="termination-next-step"),
    pytest.param([M, L, L, L], [7, 100, 100, 100], [1, 1, 1, 1], [1, 1, 0, 0], 0.9,
                 7.0, 0.9, 1, id="truncation-next-step"),
    pytest.param([M, M, M, L], [1, 2, 3, 100], [1, 1, 1, 0], [1, 1, 1, 1], 0.5,
                 2.75, 0.0, 3, id="termination-at-window-end"),
    pytest.param([M, M, M, L], [1, 2, 3, 100], [1, 1, 1, 1], [1, 1, 1, 1], 0.5,
                 2.75, 0.125, 3, id="truncation-at-window-end"),
    pytest.param([M, M, M, M], [1, 2, 3, 4], [1, 0.5, 0.5, 1], [1, 1, 1, 1], 0.5,
                 1.6875, 0.03125, 3, id="fractional-discounts"),
    pytest.param([M, M, L, L], [1, 2, 100, 100], [0.3, 0.5, 0.5, 0.5], [1, 1, 1, 0], 1.0,
                 2.0, 0.25, 2, id="fractional-discount-into-start-ignored"),
    pytest.param([M, M, M, M], [1, 2, 3, 4], [1, 1, 1, 1], [1, 1, 1, 1], 0.0,
                 1.0, 0.0, 3, id="gamma-zero"),
    pytest.param([M, M, M, M], [1, 2, 3, 4], [1, 1, 1, 1], [1, 1, 1, 1], 1.0,
                 6.0, 1.0, 3, id="gamma-one"),
    pytest.param([M, M], [3, 5], [1, 1], [1, 1], 0.99, 3.0, 0.99, 1, id="one-step"),
    pytest.param([F, L], [3, 5], [1, 0], [1, 1], 0.99, 3.0, 0.0, 1, id="one-step-terminal"),
]


@pytest.mark.parametrize(("types", "rewards", "discounts", "mask", "gamma", "ret", "boot", "m"), TABLE)
def test_table(types, rewards, discounts, mask, gamma, ret, boot, m):
    batch = make_batch([types], [rewards], [discounts], [mask])
    t = nstep_transitions(batch, gamma)
    assert isinstance(t, Transitions)
    assert t.reward.tolist() == pytest.approx([ret], abs=1e-6)
    assert t.bootstrap_discount.tolist() == pytest.approx([boot], abs=1e-7)
    assert t.num_steps.tolist() == [m]
    assert t.obs.tolist() == [[0.0]]
    assert t.next_obs.tolist() == [[float(m)]]
    assert t.action.tolist() == [0]


def test_table_rows_together_match_rows_alone():
    rows = [p.values for p in TABLE if len(p.values[0]) == 4 and p.values[4] == 0.5]
    batch = make_batch(*[[r[i] for r in rows] for i in range(4)])
    t = nstep_transitions(batch, 0.5)
    assert t.reward.tolist() == pytest.approx([r[5] for r in rows])
    assert t.bootstrap_discount.tolist() == pytest.approx([r[6] for r in rows])
    assert t.next_obs[:, 0].tolist() == [10.0 * b + r[7] for b, r in enumerate(rows)]


# -- random windows against a plain loop -----------------------------------------------------
def random_stream(rng: np.random.Generator, num_steps: int, fractional: bool):
    """One stream of whole and partial episodes: step types, rewards, discounts."""
    types, discounts = [], []
    while len(types) < num_steps:
        ep_len = int(rng.integers(2, 9))
        types += [F] + [M] * (ep_len - 2) + [L]
        mids = rng.uniform(0.0, 1.0, ep_len - 1) if fractional else np.ones(ep_len - 1)
        end = float(rng.choice([0.0, 1.0, rng.uniform()])) if fractional else float(rng.integers(0, 2))
        discounts += [1.0, *mids[1:], end]
    rewards = rng.normal(size=num_steps)
    return np.array(types[:num_steps]), rewards, np.array(discounts[:num_steps])


def windows(types, rewards, discounts, length):
    """Every valid window of a stream (the rule of docs/semantics.md), padded with a copy of its LAST."""
    out = []
    for start in range(len(types)):
        if types[start] == L:
            continue
        idx, valid = [], []
        for k in range(length):
            t = start + k
            if t >= len(types):
                break
            idx.append(t)
            valid.append(True)
            if types[t] == L:
                break
        if len(idx) < length and types[idx[-1]] != L:
            continue  # the stream ends before the window completes
        idx += [idx[-1]] * (length - len(idx))
        valid += [False] * (length - len(valid))
        out.append((idx, valid))
    return out


def reference(types, rewards, discounts, gamma):
    """The n-step return of one window, stepping forward until LAST or the window's end."""
    total, scale = 0.0, 1.0
    for t in range(len(types) - 1):
        total += scale * rewards[t]
        scale *= gamma * discounts[t + 1]
        if types[t + 1] == L or t + 1 == len(types) - 1:
            return total, scale, t + 1
    raise AssertionError("unreachable: a window has length >= 2")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), length=st.integers(2, 7),
       gamma=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]) | st.floats(0.0, 1.0),
       fractional=st.booleans())
def test_matches_reference_loop(seed, length, gamma, fractional):
    rng = np.random.default_rng(seed)
    types, rewards, discounts = random_stream(rng, 60, fractional)
    ws = windows(types, rewards, discounts, length)
    idx = np.array([w[0] for w in ws])
    mask = np.array([w[1] for w in ws])
    obs = rng.normal(size=(60, 2))
    batch = Batch(
        data={"o": torch.tensor(obs[idx]), "a": torch.tensor(idx), "r": torch.tensor(rewards[idx]),
              "step_type": torch.tensor(types[idx], dtype=torch.uint8),
              "discount": torch.tensor(discounts[idx], dtype=torch.float32)},
        mask=torch.tensor(mask), keys=torch.arange(len(ws)), weights=torch.ones(len(ws)),
        probabilities=torch.ones(len(ws), dtype=torch.float64))
    t = nstep_transitions(batch, gamma, observation="o", action="a", reward="r")
    d32 = torch.tensor(discounts, dtype=torch.float32).double().numpy()
    for b, (i, _) in enumerate(ws):
        ret, boot, m = reference(types[i], rewards[i], d32[i], gamma)
        assert t.reward[b].item() == pytest.approx(ret, rel=1e-9, abs=1e-9)
        assert t.bootstrap_discount[b].item() == pytest.approx(boot, rel=1e-9, abs=1e-12)
        assert int(t.num_steps[b]) == m
        assert torch.equal(t.next_obs[b], torch.tensor(obs[i[m]]))
        assert torch.equal(t.obs[b], torch.tensor(obs[i[0]]))
        assert int(t.action[b]) == i[0]
    if not fractional:  # 0/1 discounts: bootstrap is gamma^m, or 0 exactly after a termination
        last = torch.tensor(types[idx])[torch.arange(len(ws)), t.num_steps] == L
        terminated = last & (torch.tensor(d32[idx])[torch.arange(len(ws)), t.num_steps] == 0)
        assert (t.bootstrap_discount[terminated] == 0).all()
        expected = torch.tensor(gamma, dtype=torch.float64) ** t.num_steps
        assert torch.allclose(t.bootstrap_discount[~terminated], expected[~terminated])


# -- dtypes, shapes, nested fields -------------------------------------------------------------
def test_dtypes():
    batch = make_batch([[M, M, M]], [[1, 2, 3]], [[1, 1, 1]])
    t = nstep_transitions(batch, 0.9)
    assert t.reward.dtype == torch.float32 and t.bootstrap_discount.dtype == torch.float32
    assert t.num_steps.dtype == torch.int64
    mask = torch.ones(1, 3, dtype=bool)
    ret, boot, _ = nstep_returns(torch.tensor([[1, 2, 3]]), torch.ones(1, 3), mask, 0.5)
    assert ret.dtype == torch.float32 and ret.tolist() == [2.0]  # integer rewards
    ret, boot, _ = nstep_returns(torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64), torch.ones(1, 3),
                                 torch.ones(1, 3, dtype=bool), 0.5)
    assert ret.dtype == torch.float64 and boot.dtype == torch.float64


def test_vector_reward_and_padding_nan():
    reward = torch.tensor([[[1.0, 10.0], [2.0, 20.0], [float("nan"), float("inf")]]])
    mask = torch.tensor([[True, True, False]])
    ret, boot, m = nstep_returns(reward, torch.tensor([[1.0, 0.0, 0.0]]), mask, 0.5)
    assert ret.tolist() == [[1.0, 10.0]] and boot.tolist() == [0.0] and m.tolist() == [1]
    ret, _, _ = nstep_returns(reward[:, :2], torch.ones(1, 2), torch.ones(1, 2, dtype=bool), 0.5)
    assert ret.tolist() == [[1.0, 10.0]]  # the reward at the bootstrap step is never summed


def test_nested_observation():
    batch = make_batch([[M, M, L]], [[1, 2, 3]], [[1, 1, 0]])
    data = dict(batch.data)
    obs = data.pop("obs")
    data["obs.pos"], data["obs.vel"] = obs, -obs
    batch = Batch(data, batch.mask, batch.keys, batch.weights, batch.probabilities)
    t = nstep_transitions(batch, 0.5)
    assert set(t.obs) == {"obs.pos", "obs.vel"}
    assert t.next_obs["obs.pos"].tolist() == [[2.0]]
    assert t.next_obs["obs.vel"].tolist() == [[-2.0]]


def test_empty_batch():
    t = nstep_transitions(make_batch(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3)), 0.9)
    assert t.reward.shape == (0,) and t.next_obs.shape == (0, 1)


# -- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [-0.1, 1.01, math.nan, math.inf, True, "0.9", None])
def test_bad_gamma(gamma):
    with pytest.raises(ConfigError, match="gamma"):
        nstep_transitions(make_batch([[M, M]], [[1, 1]], [[1, 1]]), gamma)


def test_numpy_gamma():
    t = nstep_transitions(make_batch([[M, M, M]], [[1, 2, 3]], [[1, 1, 1]]), np.float32(0.5))
    assert t.reward.tolist() == [2.0] and t.bootstrap_discount.tolist() == [0.25]


def test_window_too_short():
    with pytest.raises(ConfigError, match="L = n \\+ 1 >= 2"):
        nstep_transitions(make_batch([[M]], [[1]], [[1]]), 0.9)


def test_missing_fields():
    batch = make_batch([[M, M]], [[1, 1]], [[1, 1]])
    with pytest.raises(SpecMismatchError, match="'rew'"):
        nstep_transitions(batch, 0.9, reward="rew")
    with pytest.raises(SpecMismatchError, match="observation field 'o'"):
        nstep_transitions(batch, 0.9, observation="o")
    with pytest.raises(SpecMismatchError, match="'act'"):
        nstep_transitions(batch, 0.9, action="act")


@pytest.mark.parametrize(("types", "mask", "match"), [
    ([M, M, M], [1, 0, 1], "mask must be"),
    ([M, L, L], [1, 0, 0], "mask must be"),
    ([M, L, M], [1, 1, 1], "LAST before"),
    ([M, M, M], [1, 1, 0], "without a LAST"),
])
def test_inconsistent_windows(types, mask, match):
    batch = make_batch([types], [[1, 1, 1]], [[1, 1, 1]], [mask])
    with pytest.raises(SpecMismatchError, match=match):
        nstep_transitions(batch, 0.9)


def test_validate_false_skips_value_checks():
    batch = make_batch([[M, L, M]], [[1, 2, 3]], [[1, 1, 1]])
    t = nstep_transitions(batch, 0.5, validate=False)  # trusts the mask: a full window
    assert t.reward.tolist() == [2.0]


def test_shape_mismatch():
    with pytest.raises(SpecMismatchError, match="must start with"):
        nstep_returns(torch.ones(2, 4), torch.ones(2, 3), torch.ones(2, 3, dtype=bool), 0.9)
    with pytest.raises(SpecMismatchError, match="bool tensor"):
        nstep_returns(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), 0.9)
