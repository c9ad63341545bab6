"""The single-process buffer at every fill and field kind (issue 24).

Uniform draws stay uniform over the valid window starts at low, middle and full fill
(chi-square, fixed seeds, rows of equal and of unequal lengths); ``sample_transitions``
of a frame-stacked observation equals ``nstep_transitions`` of the same windows;
``spec_from_env(frame_stack=True)`` serves pixels end to end; construction is lazy (the
resident memory follows the steps written) and changes no result; a ``(1,)`` action given
as ``[num_envs]`` is taken as SB3 takes it. About 10 s in all.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

import shardreplay as sr
from shardreplay.buffer.nstep import nstep_transitions
from shardreplay.buffer.shard import shard_of_buffer
from shardreplay.errors import SpecMismatchError

# One worker for the whole module: its cases compile the same specialised kernels, which
# several workers would otherwise compile at once on a cold numba cache (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("single-env-kernels")

MID, FIRST, LAST = int(sr.StepType.MID), int(sr.StepType.FIRST), int(sr.StepType.LAST)


def _vector_spec() -> sr.Spec:
    return sr.Spec({"obs": sr.Field((2,), np.float32), "action": sr.Field((), np.int64),
                    "reward": sr.Field((), np.float32)})


def _write_row(buf: sr.ReplayBuffer, row: int, n: int, rng: np.random.Generator) -> None:
    """``n`` steps into stream ``row``: episodes of 2..30 steps (FIRST ... LAST)."""
    types = np.full(n, MID, np.uint8)
    t = 0
    while t < n:
        types[t] = FIRST
        t += int(rng.integers(2, 30))
        if t - 1 < n:
            types[t - 1] = LAST
    for a in range(0, n, 1_000):
        m = min(1_000, n - a)
        buf.extend({"obs": rng.standard_normal((1, m, 2), dtype=np.float32),
                    "action": rng.integers(0, 3, (1, m)),
                    "reward": rng.standard_normal((1, m)).astype(np.float32),
                    "step_type": types[None, a:a + m]}, stream_ids=np.array([row]))


@pytest.mark.parametrize("fill", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("streams,unequal", [(1, False), (8, False), (8, True)])
def test_uniform_draws_are_uniform_over_valid_starts_at_every_fill(fill: float, streams: int,
                                                                   unequal: bool) -> None:
    cap = 4_000
    buf = sr.ReplayBuffer(_vector_spec(), num_streams=streams, stream_capacity=cap, window=3, seed=7)
    rng = np.random.default_rng(11)
    for row in range(streams):
        # Unequal rows: row r holds (r + 1) / streams of the fill (the last one wraps at 100%).
        share = (row + 1) / streams if unequal else 1.0
        n = max(3, int(cap * fill * share)) if fill < 1 else cap + 37 * row
        _write_row(buf, row, n, rng)
    storage = shard_of_buffer(buf)._storage
    valid = np.flatnonzero(storage.valid)
    assert valid.size == len(buf) > 0
    draws = 12 * valid.size
    shard = shard_of_buffer(buf)
    starts = np.concatenate([shard.draw(min(65_536, draws - i)).starts for i in range(0, draws, 65_536)])
    assert storage.valid[starts].all()  # only valid starts are drawn
    counts = np.bincount(np.searchsorted(valid, starts), minlength=valid.size)
    assert np.array_equal(valid[np.searchsorted(valid, starts)], starts)
    expected = np.full(valid.size, draws / valid.size)
    p = stats.chisquare(counts, expected).pvalue
    assert p > 1e-3, f"draws not uniform over {valid.size} valid starts (p={p:.2e})"


def _pixel_specs() -> sr.Spec:
    return sr.Spec({"obs": sr.Field((4, 6, 5), np.uint8, frame_stack=True), "action": sr.Field((), np.int64),
                    "reward": sr.Field((), np.float32)})


def _write_pixels(buf: sr.ReplayBuffer, steps: int, seed: int) -> None:
    """One env with a 4-frame stack: a reset stack repeats its frame, each step shifts one in."""
    rng = np.random.default_rng(seed)
    stack = np.zeros((4, 6, 5), np.uint8)
    last = True
    for _ in range(steps):
        if last:
            stack[:] = rng.integers(0, 255, (6, 5), dtype=np.uint8)
            t = FIRST
        else:
            stack = np.concatenate([stack[1:], rng.integers(0, 255, (1, 6, 5), dtype=np.uint8)])
            t = LAST if rng.random() < 0.1 else MID
        last = t == LAST
        buf.add({"obs": stack[None], "action": rng.integers(0, 4, 1),
                 "reward": rng.random(1).astype(np.float32), "step_type": np.array([t], np.uint8),
                 "discount": np.array([0.0 if t == LAST else 1.0], np.float32)})


@pytest.mark.parametrize("window", [2, 4])
def test_sample_transitions_of_frame_stacks_equal_nstep_transitions(window: int) -> None:
    buf = sr.ReplayBuffer(_pixel_specs(), num_streams=1, stream_capacity=300, window=window, seed=3)
    _write_pixels(buf, 500, seed=5)
    rng = shard_of_buffer(buf).rng
    state = rng.bit_generator.state
    got = buf.sample_transitions(64, gamma=0.9)
    rng.bit_generator.state = state
    want = nstep_transitions(buf.sample(64), gamma=0.9)
    for name in ("obs", "next_obs", "action", "weights", "keys", "num_steps"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("reward", "bootstrap_discount"):  # a compiled sum against torch's: rounding
        assert torch.allclose(getattr(got, name), getattr(want, name), rtol=1e-6), name
    assert got.obs.shape == (64, 4, 6, 5)


class _PixelEnv:
    """A one-env vector env's spaces and autoreset mode, as gymnasium's Atari wrappers give."""

    def __init__(self) -> None:
        from gymnasium import spaces

        self.num_envs = 1
        self.single_observation_space = spaces.Box(0, 255, (4, 6, 5), np.uint8)
        self.single_action_space = spaces.Discrete(4)
        self.metadata = {"autoreset_mode": "next_step"}


def test_spec_from_env_offers_frame_stacks_and_pixels_go_end_to_end() -> None:
    env = _PixelEnv()
    spec = sr.spec_from_env(env, frame_stack=True)
    assert spec["obs"].frame_stack and spec["obs"].shape == (4, 6, 5)
    assert not sr.spec_from_env(env)["obs"].frame_stack
    buf = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=200, seed=0)
    conv = sr.GymStepConverter(1, autoreset_mode="next_step")
    rng = np.random.default_rng(0)
    obs = np.repeat(rng.integers(0, 255, (1, 1, 6, 5), dtype=np.uint8), 4, axis=1)
    conv.reset(obs)
    for t in range(120):
        next_obs = np.concatenate([obs[:, 1:], rng.integers(0, 255, (1, 1, 6, 5), dtype=np.uint8)], axis=1)
        done = np.array([t % 40 == 39])
        for step, ids in conv.step(np.array([t % 4]), next_obs, np.ones(1), done, np.zeros(1, bool), {}):
            buf.add(step, stream_ids=ids)
        obs = next_obs if not done[0] else np.repeat(next_obs[:, -1:], 4, axis=1)
    got = buf.sample_transitions(16, gamma=0.99)
    assert got.obs.shape == got.next_obs.shape == (16, 4, 6, 5)
    # A continuing step's next stack is its stack shifted by one frame.
    cont = got.bootstrap_discount > 0
    assert torch.equal(got.obs[cont, 1:], got.next_obs[cont, :3])
    with pytest.raises(sr.ConfigError, match="frame_stack"):
        sr.spec_from_env(type("E", (), {"observation_space": env.single_action_space,
                                        "action_space": env.single_action_space})(), frame_stack=True)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_construction_is_lazy_and_memory_follows_the_steps_written() -> None:
    # 100,000 steps of 84x84 frames: 0.84 GB of frame ring if touched at construction.
    spec = sr.Spec({"obs": sr.Field((4, 84, 84), np.uint8, frame_stack=True),
                    "action": sr.Field((), np.int64), "reward": sr.Field((), np.float32)})
    before = _rss_mib()
    buf = sr.ReplayBuffer(spec, num_streams=1, stream_capacity=100_000)
    built = _rss_mib()
    assert built - before < 64, f"construction made {built - before:.0f} MiB resident"
    stack = np.zeros((1, 4, 84, 84), np.uint8)
    for t in range(2_000):  # one new frame (7 KiB) per step: ~14 MiB
        stack = np.concatenate([stack[:, 1:], np.full((1, 1, 84, 84), t % 251, np.uint8)], axis=1)
        buf.add({"obs": stack, "action": np.zeros(1, np.int64), "reward": np.zeros(1, np.float32),
                 "step_type": np.array([FIRST if t == 0 else MID], np.uint8)})
    grown = _rss_mib() - built
    assert 10 < grown < 64, f"2,000 frames made {grown:.0f} MiB resident"
    del buf


def test_lazy_construction_changes_no_result() -> None:
    # The same writes and seed into a buffer whose pages were all touched first (as the
    # allocator did before) and into a lazily built one: the same samples.
    def run(touch: bool) -> list[Any]:
        buf = sr.ReplayBuffer(_pixel_specs(), num_streams=1, stream_capacity=50_000, window=3, seed=9)
        if touch:
            storage = shard_of_buffer(buf)._storage
            frame_rings = [s.frames for s in storage.stacked.values()]
            for arr in (storage.records, *storage.fields.values(), *frame_rings):
                if arr.flags.c_contiguous:  # small fields are views of the records
                    arr.reshape(-1).view(np.uint8)[::4096] = 0
        _write_pixels(buf, 700, seed=2)
        b = buf.sample(32)
        t = buf.sample_transitions(32, gamma=0.9)
        return [b.data["obs"], b.data["action"], b.mask, t.obs, t.next_obs, t.reward]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


def _float_spec(shape: tuple[int, ...] = (1,)) -> sr.Spec:
    return sr.Spec({"obs": sr.Field((3,), np.float32), "action": sr.Field(shape, np.float32),
                    "reward": sr.Field((), np.float32)})


def test_a_one_element_action_given_as_num_envs_is_taken_as_sb3_takes_it() -> None:
    envs = 3
    bufs = [sr.ReplayBuffer(_float_spec(), num_streams=envs, stream_capacity=50, seed=1) for _ in range(4)]
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((11, envs, 3), dtype=np.float32)
    actions = rng.uniform(-2, 2, (10, envs)).astype(np.float32)
    writers = [sr.GymStepWriter(b, autoreset_mode="next_step") for b in bufs[2:]]
    for w in writers:
        w.reset(obs[0])
    for t in range(10):
        step = {"obs": obs[t], "reward": np.ones(envs, np.float32),
                "step_type": np.full(envs, FIRST if t == 0 else MID, np.uint8)}
        bufs[0].add({**step, "action": actions[t][:, None]})
        bufs[1].add({**step, "action": actions[t]})  # [num_envs] for a (1,) field
        done = np.zeros(envs, bool)
        writers[0].step(actions[t][:, None], obs[t + 1], np.ones(envs), done, done, {})
        writers[1].step(actions[t], obs[t + 1], np.ones(envs), done, done, {})
    stored = [shard_of_buffer(b)._storage.fields["action"].copy() for b in bufs]
    assert np.array_equal(stored[0], stored[1]) and np.array_equal(stored[2], stored[3])
    assert np.array_equal(stored[0][:10], actions[:, 0, None])
    # Where the reshape would guess (a (2,) field given [num_envs]), the error says what to pass.
    two = sr.ReplayBuffer(_float_spec((2,)), num_streams=envs, stream_capacity=50)
    with pytest.raises(SpecMismatchError, match=r"expected shape \(3, 2\)"):
        two.add({"obs": obs[0], "action": actions[0], "reward": np.ones(envs, np.float32),
                 "step_type": np.zeros(envs, np.uint8)})


@pytest.mark.parametrize("short", [False, True], ids=["full path", "one-step path, obs array reused"])
@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_the_writer_takes_frame_stacks_and_stores_what_the_converter_and_add_store(mode: str,
                                                                                  short: bool) -> None:
    """Also on the compiled one-step path (built at once here), with the env writing each
    observation into the same array (the writer must copy what it holds)."""
    spec = sr.spec_from_env(_PixelEnv(), frame_stack=True)
    envs = 2
    a, b = (sr.ReplayBuffer(spec, num_streams=envs, stream_capacity=60, window=3, seed=0) for _ in range(2))
    assert shard_of_buffer(a).use_one_step(short) == short
    env_obs = np.zeros((envs, *spec["obs"].shape), np.uint8)
    held_arrays = set()
    writer, conv = sr.GymStepWriter(a, autoreset_mode=mode), sr.GymStepConverter(envs, autoreset_mode=mode)
    rng = np.random.default_rng(4)

    def fresh() -> np.ndarray:
        return np.repeat(rng.integers(0, 255, (1, 1, 6, 5), dtype=np.uint8), 4, axis=1)[0]

    obs = np.stack([fresh() for _ in range(envs)])
    writer.reset(obs)
    conv.reset(obs)
    ended = np.zeros(envs, bool)  # NEXT_STEP: the call after a done returns the reset stack
    for _ in range(90):
        term, trunc = rng.random(envs) < 0.08, rng.random(envs) < 0.04
        done = term | trunc
        shifted = np.concatenate([obs[:, 1:], rng.integers(0, 255, (envs, 1, 6, 5), dtype=np.uint8)], axis=1)
        info: dict[str, Any] = {}
        if mode == "same_step":
            nxt = np.stack([fresh() if d else s for d, s in zip(done, shifted, strict=True)])
            if done.any():
                info = {"final_obs": np.array([s if d else None for d, s in zip(done, shifted, strict=True)],
                                              dtype=object)}
        else:
            nxt = np.stack([fresh() if e else s for e, s in zip(ended, shifted, strict=True)])
            done = done & ~ended
            term, trunc = term & ~ended, trunc & ~ended
            ended = done
        action, reward = rng.integers(0, 4, envs), rng.random(envs)
        if short:
            env_obs[...] = nxt
        writer.step(action, env_obs if short else nxt, reward, term, trunc, info)
        held_arrays.add(id(writer._obs))
        for step, ids in conv.step(action, nxt, reward, term, trunc, info):
            b.add(step, stream_ids=ids)
        obs = nxt
    sa, sb = a.state_dict()["arrays"], b.state_dict()["arrays"]
    for name in sb:
        assert torch.equal(sa[name], sb[name]), name
    assert writer.num_steps == conv.num_steps and writer.num_episodes == conv.num_episodes > 0
    if short:  # the held observation is copied into one of two arrays, never a new one
        assert len(held_arrays) == 2
    got = a.sample_transitions(16, gamma=0.9)
    assert got.obs.shape == (16, 4, 6, 5)
