"""sample_transitions: the compiled gather agrees with nstep_transitions, and exact values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardreplay import (
    ConfigError,
    Field,
    ReplayBuffer,
    Spec,
    SpecMismatchError,
    nstep_transitions,
)

F, M, L = 0, 1, 2


def random_episodes(buffer: ReplayBuffer, steps: int, seed: int) -> None:
    """Random streams with terminations (discount 0) and truncations (discount 1)."""
    rng = np.random.default_rng(seed)
    s = buffer.num_streams
    types = np.zeros(s, np.uint8)
    for _ in range(steps):
        ends = rng.random(s) < 0.15
        new = np.where(types == L, F, np.where(ends & (types != F), L, M)).astype(np.uint8)
        discount = np.where((new == L) & (rng.random(s) < 0.5), 0.0, 1.0).astype(np.float32)
        buffer.add({"obs": rng.standard_normal((s, 3)).astype(np.float32),
                    "action": rng.integers(0, 5, s), "reward": rng.standard_normal(s).astype(np.float32),
                    "step_type": new, "discount": discount})
        types = new


def twin_buffers(sampler: str, window: int) -> tuple[ReplayBuffer, ReplayBuffer]:
    spec = Spec({"obs": Field((3,)), "action": Field((), np.int64), "reward": Field(())})
    bufs = tuple(ReplayBuffer(spec, num_streams=4, stream_capacity=64, window=window, sampler=sampler,
                              seed=7) for _ in range(2))
    for b in bufs:
        random_episodes(b, 150, seed=3)
    bufs[1].load_state_dict(bufs[0].state_dict())  # the same key tag: keys compare equal
    return bufs


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_sample_transitions_equals_nstep_transitions_of_the_same_windows(sampler, n):
    fast, ref = twin_buffers(sampler, window=4)
    for _ in range(5):
        got = fast.sample_transitions(256, gamma=0.9, n=n)
        batch = ref.sample(256)
        want = nstep_transitions(batch, 0.9, n)
        assert torch.equal(got.keys, batch.keys) and torch.equal(got.weights, batch.weights)
        assert torch.equal(got.obs, want.obs) and torch.equal(got.next_obs, want.next_obs)
        assert torch.equal(got.action, want.action) and torch.equal(got.num_steps, want.num_steps)
        torch.testing.assert_close(got.reward, want.reward, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.bootstrap_discount, want.bootstrap_discount, rtol=1e-6, atol=0)
        assert got.reward.dtype == torch.float32 and got.bootstrap_discount.dtype == torch.float32
        assert got.terminated is not None and want.terminated is not None and got.terminated.any()
        assert torch.equal(got.terminated, want.terminated) and torch.equal(got.truncated, want.truncated)
        if n == 3:  # the full window: the same as nstep_transitions itself
            full = nstep_transitions(batch, 0.9)
            torch.testing.assert_close(got.reward, full.reward, rtol=1e-6, atol=1e-6)
        terminal = got.bootstrap_discount == 0
        assert terminal.any() and (got.num_steps < n).any() == (n > 1)


# float16 and big-endian rewards take the path in steps (numba takes neither).
@pytest.mark.parametrize("reward_dtype", [np.float32, np.float16, np.dtype(">f4")])
def test_exact_values_of_one_stream(reward_dtype):
    spec = Spec({"obs": Field(()), "action": Field((), np.int64), "reward": Field((), reward_dtype)})
    buf = ReplayBuffer(spec, num_streams=1, stream_capacity=16, window=4, seed=0)
    # obs = t; rewards 1, 2, 4, 8 ...; a termination at t = 5, then a fresh episode.
    types = [F, M, M, M, M, L, F, M, M, M, M]
    discounts = [1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]
    for t, (st, d) in enumerate(zip(types, discounts, strict=True)):
        buf.add({"obs": [float(t)], "action": [t], "reward": [2.0 ** t], "step_type": [st], "discount": [d]})
    g = 0.5
    seen = {}
    for _ in range(20):
        tr = buf.sample_transitions(64, gamma=g)
        for o, a, r, no, bd, m in zip(tr.obs.tolist(), tr.action.tolist(), tr.reward.tolist(),
                                      tr.next_obs.tolist(), tr.bootstrap_discount.tolist(),
                                      tr.num_steps.tolist(), strict=True):
            seen[int(o)] = (a, r, no, bd, m)
    # start 0: r0 + g r1 + g^2 r2 = 1 + 1 + 1, bootstrap g^3 from o3
    assert seen[0] == (0, 3.0, 3.0, 0.125, 3)
    # start 3: the episode terminates at 5: r3 + g r4 = 8 + 8; bootstrap 0, next obs o5
    assert seen[3] == (3, 16.0, 5.0, 0.0, 2)
    # start 4: one step to the termination
    assert seen[4] == (4, 16.0, 5.0, 0.0, 1)
    assert 5 not in seen and 8 not in seen  # LAST starts nothing; 8 .. 10 incomplete
    assert set(seen) == {0, 1, 2, 3, 4, 6, 7}


def test_nested_observations_come_as_dicts():
    spec = Spec({"obs": {"pos": Field((2,)), "vel": Field(())}, "action": Field((), np.int64),
                 "reward": Field(())})
    buf = ReplayBuffer(spec, num_streams=2, stream_capacity=8, window=2, seed=0)
    for t in range(5):
        buf.add({"obs": {"pos": np.full((2, 2), t, np.float32), "vel": np.full(2, -t, np.float32)},
                 "action": [t, t], "reward": [1.0, 1.0], "step_type": [F if t == 0 else M] * 2})
    tr = buf.sample_transitions(32, gamma=0.9)
    assert set(tr.obs) == {"obs.pos", "obs.vel"}
    assert torch.equal(tr.next_obs["obs.pos"][:, 0], tr.obs["obs.pos"][:, 0] + 1)
    assert torch.equal(tr.next_obs["obs.vel"], tr.obs["obs.vel"] - 1)
    assert tr.bootstrap_discount.tolist() == pytest.approx([0.9] * 32)


def test_bad_arguments_raise_clear_errors():
    fast, _ = twin_buffers("uniform", window=3)
    with pytest.raises(ConfigError, match="gamma"):
        fast.sample_transitions(8, gamma=1.5)
    with pytest.raises(ConfigError, match=r"n must be an integer in \[1, 2\]"):
        fast.sample_transitions(8, gamma=0.9, n=3)
    with pytest.raises(ConfigError, match="batch_size"):
        fast.sample_transitions(0, gamma=0.9)
    with pytest.raises(SpecMismatchError, match="'rew'"):
        fast.sample_transitions(8, gamma=0.9, reward="rew")
    with pytest.raises(SpecMismatchError, match="observation field 'o'"):
        fast.sample_transitions(8, gamma=0.9, observation="o")


def test_to_moves_every_tensor_and_keys_still_update_priorities():
    fast, _ = twin_buffers("prioritized", window=2)
    tr = fast.sample_transitions(16, gamma=0.9).to("cpu", non_blocking=True)
    assert tr.obs.device.type == "cpu" and len(tr) == 16
    assert fast.update_priorities(tr.keys, (tr.reward.abs() + 0.1)) == 16  # torch tensors accepted


# Specs whose fields the compiled path reads each way it can: an observation and action
# of their own arrays (over 32 bytes) with a float64 reward, nested observations (read in
# steps, the action compiled), frame-stacked pixels (stacks rebuilt, the action compiled).
KIND_SPECS = {
    "own_arrays": Spec({"obs": Field((17,)), "action": Field((6,)), "reward": Field((), np.float64)}),
    "nested": Spec({"obs": {"a": Field((2,)), "b": Field((3,), np.int16)}, "action": Field((), np.int64),
                    "reward": Field(())}),
    "pixels": Spec({"obs": Field((4, 3, 3), np.uint8, frame_stack=True), "action": Field((2,), np.int32),
                    "reward": Field(())}),
}


def kind_episodes(buffer: ReplayBuffer, steps: int, seed: int) -> None:
    """Random steps of every field of the buffer's spec (stacks that roll frame by frame),
    episodes ending by terminations and truncations, streams at different positions."""
    rng = np.random.default_rng(seed)
    spec, s = buffer.spec, buffer.num_streams
    types = np.zeros(s, np.uint8)
    stacks: dict[str, np.ndarray] = {}
    for t in range(steps):
        ends = rng.random(s) < 0.15
        new = np.where(types == L, F, np.where(ends & (types != F), L, M)).astype(np.uint8)
        step: dict = {"step_type": new,
                      "discount": np.where((new == L) & (rng.random(s) < 0.5), 0.0, 1.0).astype(np.float32)}
        for name, f in spec.fields.items():
            if f.frame_stack:
                frame = rng.integers(0, 255, (s, 1, *f.shape[1:])).astype(f.dtype)
                old = stacks.setdefault(name, np.repeat(frame, f.shape[0], 1))
                value = np.where((new == F)[:, None, None, None], np.repeat(frame, f.shape[0], 1),
                                 np.concatenate([old[:, 1:], frame], 1))
            else:
                value = (rng.standard_normal((s, *f.shape)) * 50).astype(f.dtype)
            *parents, leaf = name.split(".")
            node = step
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        rows = np.arange(s) if t % 4 else np.arange(s - 1)  # the last stream falls behind
        buffer.add({k: ({kk: vv[rows] for kk, vv in v.items()} if isinstance(v, dict) else v[rows])
                    for k, v in step.items()}, stream_ids=rows)
        types[rows] = new[rows]
        for name in stacks:  # the streams written hold their new stacks
            stacks[name][rows] = step[name][rows]


@pytest.mark.parametrize("kind", sorted(KIND_SPECS))
@pytest.mark.parametrize("sampler", ["uniform", "fifo"])
def test_every_field_kind_equals_the_transitions_of_the_same_windows(kind, sampler):
    """The compiled path (one kernel for the returns, keys, ends and the gathers it can
    make) gives exactly what ``nstep_transitions`` computes from the same windows."""
    bufs = tuple(ReplayBuffer(KIND_SPECS[kind], num_streams=3, stream_capacity=40, window=4, sampler=sampler,
                              seed=5) for _ in range(2))
    for b in bufs:
        kind_episodes(b, 70, seed=2)
    bufs[1].load_state_dict(bufs[0].state_dict())
    for n in (1, 3):
        got = bufs[0].sample_transitions(32, gamma=0.8, n=n)
        batch = bufs[1].sample(32)
        want = nstep_transitions(batch, 0.8, n)
        assert torch.equal(got.keys, batch.keys) and torch.equal(got.weights, batch.weights)
        for part in ("obs", "next_obs"):
            a, b = getattr(got, part), getattr(want, part)
            pairs = [(a[k], b[k]) for k in b] if isinstance(b, dict) else [(a, b)]
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs), part
        assert got.action.dtype == want.action.dtype and torch.equal(got.action, want.action)
        assert torch.equal(got.num_steps, want.num_steps)
        assert got.reward.dtype == want.reward.dtype  # rewards up to ~200: float32 sums differ in ulps
        torch.testing.assert_close(got.reward, want.reward, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got.bootstrap_discount, want.bootstrap_discount, rtol=1e-6, atol=0)
        assert torch.equal(got.terminated, want.terminated) and torch.equal(got.truncated, want.truncated)
    assert (got.num_steps < 3).any() and got.terminated.any()
