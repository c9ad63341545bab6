"""GymStepConverter: hand-made sequences, and real CartPole vector envs in both autoreset modes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardreplay import Field, ReplayBuffer, Spec
from shardreplay.buffer.nstep import nstep_transitions
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.gym.steps import GymStepConverter
from shardreplay.spec.keys import unpack_keys

F, M, L = 0, 1, 2


def per_stream(writes_log, num_envs):
    """Reassemble writes into per-stream lists of (obs, action, reward, step_type, discount)."""
    streams = [[] for _ in range(num_envs)]
    for step, ids in writes_log:
        ids = range(num_envs) if ids is None else ids
        for j, i in enumerate(ids):
            streams[i].append((step["obs"][j].tolist(), step["action"][j].tolist(),
                               float(step["reward"][j]), int(step["step_type"][j]),
                               float(step["discount"][j])))
    return streams


def drive(conv, calls):
    """Feed (action, obs, reward, terminated, truncated, info) tuples; collect every write."""
    log = []
    for call in calls:
        log += conv.step(*call)
    return log


# -- hand-made sequences -------------------------------------------------------------------------
def test_next_step_table():
    conv = GymStepConverter(2)
    conv.reset(np.array([[0.0], [100.0]]))
    o = np.array
    calls = [  # env 0 terminates after 2 actions, env 1 is truncated after 1
        (o([1, 1]), o([[1.0], [101.0]]), o([0.5, 0.7]), o([0, 0]), o([0, 1]), {}),
        (o([1, 1]), o([[2.0], [110.0]]), o([0.25, 0.0]), o([1, 0]), o([0, 0]), {}),
        (o([1, 1]), o([[10.0], [111.0]]), o([0.0, 0.75]), o([0, 0]), o([0, 0]), {}),
        (o([1, 1]), o([[11.0], [112.0]]), o([0.125, 2.0]), o([0, 0]), o([0, 0]), {}),
    ]
    log = drive(conv, calls)
    assert all(ids is None for _, ids in log) and len(log) == 4
    s0, s1 = per_stream(log, 2)
    assert s0 == [([0.0], 1, 0.5, F, 1.0), ([1.0], 1, 0.25, M, 1.0),
                  ([2.0], 0, 0.0, L, 0.0), ([10.0], 1, 0.125, F, 1.0)]
    assert s1 == [([100.0], 1, pytest.approx(0.7), F, 1.0), ([101.0], 0, 0.0, L, 1.0),
                  ([110.0], 1, 0.75, F, 1.0), ([111.0], 1, 2.0, M, 1.0)]
    assert conv.num_episodes == 2 and conv.num_steps == 8


def test_same_step_table():
    conv = GymStepConverter(2, autoreset_mode="same_step")
    conv.reset(np.array([[0.0], [100.0]]))
    o = np.array
    final = o([None, o([101.0])], dtype=object)
    calls = [  # env 1 terminates (and is truncated) at once; the reset obs is 110
        (o([1, 1]), o([[1.0], [110.0]]), o([0.5, 0.7]), o([0, 1]), o([0, 1]), {"final_obs": final}),
        (o([1, 1]), o([[2.0], [111.0]]), o([0.6, 0.8]), o([0, 0]), o([0, 0]), {}),
    ]
    log = drive(conv, calls)
    assert [None if ids is None else ids.tolist() for _, ids in log] == [None, [1], None]
    s0, s1 = per_stream(log, 2)
    assert s0 == [([0.0], 1, 0.5, F, 1.0), ([1.0], 1, pytest.approx(0.6), M, 1.0)]
    assert s1 == [([100.0], 1, pytest.approx(0.7), F, 1.0), ([101.0], 0, 0.0, L, 0.0),
                  ([110.0], 1, pytest.approx(0.8), F, 1.0)]


def test_dict_observations_and_names():
    conv = GymStepConverter(1, observation="o", action="a", reward="r")
    conv.reset({"pos": np.zeros((1, 2)), "vel": np.ones((1,))})
    (step, _), = conv.step(np.array([[0.5]]), {"pos": np.ones((1, 2)), "vel": np.zeros((1,))},
                           np.array([1.0]), np.array([True]), np.array([False]))
    assert set(step) == {"o", "a", "r", "step_type", "discount"}
    assert step["o"]["pos"].tolist() == [[0.0, 0.0]] and step["a"].tolist() == [[0.5]]
    (step, _), = conv.step(np.array([[0.5]]), {"pos": np.full((1, 2), 9.0), "vel": np.zeros((1,))},
                           np.array([3.0]), np.array([False]), np.array([False]))
    assert step["o"]["pos"].tolist() == [[1.0, 1.0]] and step["step_type"].tolist() == [L]
    assert step["a"].tolist() == [[0.0]] and step["r"].tolist() == [0.0]
    assert step["discount"].tolist() == [0.0]


def test_holds_copies_of_observations():
    conv = GymStepConverter(1)
    obs = np.zeros((1, 3))
    conv.reset(obs)
    obs[:] = 7.0  # a vector env may reuse its output buffer
    (step, _), = conv.step(np.array([0]), obs, np.array([1.0]), np.array([False]), np.array([False]))
    assert step["obs"].tolist() == [[0.0, 0.0, 0.0]]


def test_errors():
    with pytest.raises(ConfigError, match="num_envs"):
        GymStepConverter(0)
    with pytest.raises(ConfigError, match="not supported"):
        GymStepConverter(2, autoreset_mode="disabled")
    conv = GymStepConverter(2)
    ok = (np.zeros(2, int), np.zeros((2, 4)), np.zeros(2), np.zeros(2, bool), np.zeros(2, bool))
    with pytest.raises(ConfigError, match="reset"):
        conv.step(*ok)
    with pytest.raises(SpecMismatchError, match="2 rows"):
        conv.reset(np.zeros((3, 4)))
    conv.reset(np.zeros((2, 4)))
    with pytest.raises(SpecMismatchError, match="terminated"):
        conv.step(ok[0], ok[1], ok[2], np.zeros(3, bool), ok[4])
    with pytest.raises(SpecMismatchError, match="action"):
        conv.step(np.zeros(1, int), *ok[1:])
    same = GymStepConverter(2, autoreset_mode="same_step")
    same.reset(np.zeros((2, 4)))
    with pytest.raises(SpecMismatchError, match="final_obs"):
        same.step(ok[0], ok[1], ok[2], np.array([True, False]), ok[4], {})


# -- real CartPole vector envs ---------------------------------------------------------------------
def run_cartpole(mode, num_envs=4, num_actions=300, seed=0):
    """Run CartPole with per-stream action sequences (an ignored NEXT_STEP action consumes none)."""
    gym = pytest.importorskip("gymnasium")
    envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode(mode)},
                        max_episode_steps=25)  # short limit: truncations happen too
    try:
        conv = GymStepConverter.from_env(envs)
        rng = np.random.default_rng(seed)
        plans = rng.integers(0, 2, size=(num_envs, num_actions))
        used = np.zeros(num_envs, int)
        obs, _ = envs.reset(seed=seed)
        conv.reset(obs)
        log, raw = [], []
        while used.max() < num_actions - 1:
            resetting = conv._types == L  # NEXT_STEP: these envs ignore their action
            action = plans[np.arange(num_envs), used]
            used += ~resetting
            obs, reward, term, trunc, info = envs.step(action)
            raw.append((obs.copy(), term.copy(), trunc.copy(), info))
            log += conv.step(action, obs, reward, term, trunc, info)
        return per_stream(log, num_envs), conv, raw, log
    finally:
        envs.close()


def check_stream(steps):
    assert steps[0][3] == F
    for prev, cur in itertools.pairwise(steps):
        assert (cur[3] == F) == (prev[3] == L), "FIRST exactly after LAST"
    for obs, action, reward, step_type, discount in steps:
        if step_type == L:
            assert (action, reward) == (0, 0.0)
            # CartPole terminates on angle/position, and is truncated at 25 steps here
            assert discount in (0.0, 1.0)
            assert (discount == 0.0) == (abs(obs[2]) > 0.2095 or abs(obs[0]) > 2.4)
        else:
            assert reward == 1.0 and discount == 1.0
        if step_type == F:
            assert max(abs(x) for x in obs) <= 0.05  # CartPole's reset range


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_cartpole_streams_are_well_formed(mode):
    streams, conv, _, _ = run_cartpole(mode)
    for steps in streams:
        check_stream(steps)
    ends = [s[4] for steps in streams for s in steps if s[3] == L]
    assert 0.0 in ends and 1.0 in ends, "both terminations and truncations occurred"
    assert conv.num_episodes == len(ends)
    assert conv.num_steps == sum(len(s) for s in streams)


def test_cartpole_final_observation_is_stored_at_last():
    streams, _, raw, _ = run_cartpole("NextStep", num_envs=2, num_actions=80)
    for i, steps in enumerate(streams):
        terminal = [obs[i].tolist() for obs, term, trunc, _ in raw if term[i] or trunc[i]]
        stored = [s[0] for s in steps if s[3] == L]
        assert stored and terminal[:len(stored)] == stored
        assert len(terminal) - len(stored) <= 1  # the last one may still be pending


def test_autoreset_modes_give_identical_streams():
    next_step, *_ = run_cartpole("NextStep", num_envs=3, num_actions=150, seed=3)
    same_step, *_ = run_cartpole("SameStep", num_envs=3, num_actions=150, seed=3)
    for a, b in zip(next_step, same_step, strict=True):
        k = min(len(a), len(b))
        assert k > 100 and a[:k] == b[:k]


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_buffer_windows_give_reference_nstep(mode):
    """Converter -> ReplayBuffer -> nstep_transitions agrees with a loop over the raw streams."""
    streams, _, _, log = run_cartpole(mode, num_envs=3, num_actions=200, seed=5)
    spec = Spec({"obs": Field((4,), np.float32), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})
    length, gamma = 4, 0.9
    buf = ReplayBuffer(spec, num_streams=3, stream_capacity=512, window=length, seed=0)
    for step, ids in log:
        buf.add(step, stream_ids=ids)
    assert buf.num_steps == sum(len(s) for s in streams)  # no ring wrap: slot = time index
    batch = buf.sample(512)
    t = nstep_transitions(batch, gamma)
    _, _, places, _ = unpack_keys(batch.keys.numpy())
    rows, slots = np.divmod(places, 512)
    for b, (row, slot) in enumerate(zip(rows, slots, strict=True)):
        steps = streams[row][slot:slot + length]
        total, scale = 0.0, 1.0
        for k in range(1, len(steps)):
            total += scale * steps[k - 1][2]
            scale *= gamma * steps[k][4]
            if steps[k][3] == L or k == length - 1:
                break
        assert t.num_steps[b].item() == k
        assert t.reward[b].item() == pytest.approx(total, rel=1e-6)
        assert t.bootstrap_discount[b].item() == pytest.approx(scale, rel=1e-6, abs=1e-9)
        assert t.obs[b].tolist() == pytest.approx(steps[0][0])
        assert t.next_obs[b].tolist() == pytest.approx(steps[k][0])
    assert (t.bootstrap_discount == 0).any() and (t.num_steps < length - 1).any()


# -- the autoreset mode is read, never guessed (gymnasium 0.29, CleanRL's pin) --------------------
class Gym029Like:
    """A gymnasium 1.x SAME_STEP vector env presented as gymnasium 0.29 presents its vector
    envs: no ``metadata["autoreset_mode"]``, final observations in ``info["final_observation"]``."""

    def __init__(self, env):
        self.env = env
        self.num_envs = env.num_envs
        self.metadata = {k: v for k, v in env.metadata.items() if k != "autoreset_mode"}

    def reset(self, **kwargs):
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, term, trunc, info = self.env.step(action)
        info = {k.replace("final_obs", "final_observation"): v for k, v in info.items()}
        return obs, reward, term, trunc, info


def collect_029(conv_for, num_envs=3, num_actions=150, seed=3):
    gym = pytest.importorskip("gymnasium")
    envs = Gym029Like(gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync",
                                   vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
                                   max_episode_steps=25))
    try:
        conv = conv_for(envs)
        rng = np.random.default_rng(seed)
        plans = rng.integers(0, 2, size=(num_envs, num_actions))
        obs, _ = envs.reset(seed=seed)
        conv.reset(obs)
        log = []
        for t in range(num_actions - 1):
            action = plans[:, t]
            log += conv.step(action, *envs.step(action))
        return per_stream(log, num_envs)
    finally:
        envs.env.close()


def test_gymnasium_0_envs_are_same_step_and_give_the_reference_streams(monkeypatch):
    import shardreplay.gym.modes as gym_modes

    monkeypatch.setattr(gym_modes, "_gymnasium_major", lambda: 0)
    streams = collect_029(GymStepConverter.from_env)
    reference, *_ = run_cartpole("NextStep", num_envs=3, num_actions=150, seed=3)
    for got, want in zip(streams, reference, strict=True):
        k = min(len(got), len(want))
        assert k > 100 and got[:k] == want[:k]


def test_an_env_without_a_mode_under_gymnasium_1_is_an_error_not_a_guess():
    with pytest.raises(ConfigError, match="autoreset_mode"):
        collect_029(GymStepConverter.from_env, num_actions=3)
    streams = collect_029(lambda e: GymStepConverter.from_env(e, autoreset_mode="same_step"))
    for steps in streams:
        check_stream(steps)


def test_a_same_step_env_fed_to_a_next_step_converter_raises():
    with pytest.raises(SpecMismatchError, match="same_step"):
        collect_029(lambda e: GymStepConverter(e.num_envs, autoreset_mode="next_step"))
