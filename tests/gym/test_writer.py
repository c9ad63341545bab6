"""GymStepWriter stores exactly what GymStepConverter + ReplayBuffer.add store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardreplay.gym.steps as steps_module
import shardreplay.gym.writer as writer_module
import shardreplay.spec.coerce as coerce
import shardreplay.spec.validation as validation
import shardreplay.storage.one_step as one_step
from shardreplay import (
    ConfigError,
    Field,
    GymStepConverter,
    GymStepWriter,
    ReplayBuffer,
    Spec,
    SpecMismatchError,
    spec_from_env,
    testing,
)
from shardreplay.spec import StepType
from shardreplay.spec.keys import TAG_MASK, TAG_SHIFT

# One worker for the whole module: its cases compile the same specialised kernels, which
# several workers would otherwise compile at once on a cold numba cache (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("gym-step-kernels")

LAST = int(StepType.LAST)
SPEC = Spec({"obs": Field((4,), np.float32), "action": Field((), np.int64), "reward": Field((), np.float32)})


def drive(mode: str, sampler: str, num_envs: int, steps: int, seed: int):
    """The same random gym outputs into a writer's buffer and a converter's buffer."""
    a, b = (ReplayBuffer(SPEC, num_streams=num_envs, stream_capacity=50, window=4, sampler=sampler,
                         seed=0) for _ in range(2))
    writer, conv = GymStepWriter(a, autoreset_mode=mode), GymStepConverter(num_envs, autoreset_mode=mode)
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((num_envs, 4)).astype(np.float32)
    writer.reset(obs)
    conv.reset(obs)
    for t in range(steps):
        action = rng.integers(0, 2, num_envs)
        obs = rng.standard_normal((num_envs, 4)).astype(np.float32)
        reward = rng.random(num_envs) if t % 7 else [1.0] * num_envs  # float64 arrays and a list
        term, trunc = rng.random(num_envs) < 0.05, rng.random(num_envs) < 0.05
        info = {}
        if mode == "same_step" and (term | trunc).any():
            info = {"final_obs": np.array([rng.standard_normal(4).astype(np.float32) if d else None
                                           for d in term | trunc], dtype=object)}
        writer.step(action, obs, reward, term, trunc, info)
        for step, ids in conv.step(action, obs, reward, term, trunc, info):
            b.add(step, stream_ids=ids)
    return a, b, writer, conv


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "fifo"])
def test_writer_stores_what_the_converter_and_add_store(mode, sampler):
    a, b, writer, conv = drive(mode, sampler, num_envs=3, steps=300, seed=1)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["meta"].pop("key_tag") != sb["meta"].pop("key_tag")  # each buffer names its own keys
    assert sa["meta"] == sb["meta"]
    for name, arr in sa["arrays"].items():
        np.testing.assert_array_equal(arr, sb["arrays"][name], err_msg=name)
    assert len(a) == len(b) > 100
    assert testing.sampler_counters(a)["mass"] == testing.sampler_counters(b)["mass"]
    assert (writer.num_steps, writer.num_episodes) == (conv.num_steps, conv.num_episodes)
    assert writer.num_episodes > 20
    ta, tb = a.sample_transitions(64, gamma=0.9), b.sample_transitions(64, gamma=0.9)
    untag = ~np.int64(TAG_MASK << TAG_SHIFT)
    assert (ta.keys.numpy() & untag).tolist() == (tb.keys.numpy() & untag).tolist()
    assert ta.reward.tolist() == tb.reward.tolist()


def test_the_writer_builds_the_buffers_one_step_writer_when_made():
    """Compiled (or loaded from numba's cache) in the constructor, not in the first steps;
    every common step then takes its one compiled call, typed or not, and a step that
    ends an episode or follows one is written too (the next ones through Shard.write)."""
    buf = ReplayBuffer(SPEC, num_streams=2, stream_capacity=8, window=2)
    shard = testing.shard(buf)
    assert shard._one_step is None  # a buffer alone builds it after many adds
    writer = GymStepWriter(buf, autoreset_mode="next_step")
    assert shard._one_step is not None and shard._one_step._kernels[1] is not None
    through_shard: list[int] = []
    write = shard.write
    shard.write = lambda *args: through_shard.append(1) or write(*args)
    writer.reset(np.zeros((2, 4), np.float32))
    no = np.zeros(2, bool)
    for reward in (np.ones(2, np.float32), np.ones(2), [1.0, 1.0], np.ones(2, np.float32)):
        writer.step(np.zeros(2, np.int64), np.ones((2, 4), np.float32), reward, no, no)
    assert through_shard == [] and buf.num_steps == 8
    ended = np.ones(2, bool)
    writer.step(np.zeros(2, np.int64), np.ones((2, 4), np.float32), np.ones(2, np.float32), ended, no)
    assert through_shard == [] and writer.num_episodes == 2
    writer.step(np.zeros(2, np.int64), np.ones((2, 4), np.float32), np.ones(2, np.float32), no, no)
    assert through_shard == [1] and buf.num_steps == 12


def test_bad_inputs_raise_and_write_nothing():
    buf = ReplayBuffer(SPEC, num_streams=2, stream_capacity=8, window=2)
    writer = GymStepWriter(buf, autoreset_mode="next_step")
    ok = (np.zeros(2, np.int64), np.zeros((2, 4), np.float32), np.ones(2), np.zeros(2, bool),
          np.zeros(2, bool))
    with pytest.raises(ConfigError, match="reset"):
        writer.step(*ok)
    writer.reset(np.zeros((2, 4), np.float32))
    writer.step(*ok)
    before = buf.state_dict()["arrays"]["step_type"].clone()
    nan_obs = np.full((2, 4), np.nan, np.float32)
    with pytest.raises(SpecMismatchError, match="'obs'"):
        writer.step(ok[0], nan_obs, *ok[2:])
    with pytest.raises(SpecMismatchError, match="'obs'"):
        writer.step(ok[0], np.zeros((2, 5), np.float32), *ok[2:])
    with pytest.raises(SpecMismatchError, match="terminated"):
        writer.step(*ok[:3], np.zeros(3, bool), ok[4])
    with pytest.raises(SpecMismatchError, match="same_step"):
        writer.step(*ok[:3], np.ones(2, bool), ok[4], {"final_obs": [np.zeros(4)] * 2})
    np.testing.assert_array_equal(buf.state_dict()["arrays"]["step_type"], before)
    assert buf.num_steps == 2


def test_an_int64_action_into_a_uint8_field_is_range_checked_every_call():
    spec = Spec({"obs": Field((4,), np.float32), "action": Field((), np.uint8), "reward": Field(())})
    writer = GymStepWriter(ReplayBuffer(spec, num_streams=1, stream_capacity=8, window=2),
                           autoreset_mode="next_step")
    writer.reset(np.zeros((1, 4), np.float32))
    args = (np.zeros((1, 4), np.float32), np.ones(1), np.zeros(1, bool), np.zeros(1, bool))
    writer.step(np.array([3]), *args)
    with pytest.raises(SpecMismatchError, match="range"):
        writer.step(np.array([300]), *args)


def test_spec_from_a_real_cartpole_vector_env_and_a_short_run():
    gym = pytest.importorskip("gymnasium")
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    try:
        spec = spec_from_env(envs)
        assert spec["obs"].shape == (4,) and spec["action"].dtype == np.int64
        buf = ReplayBuffer(spec, num_streams=2, stream_capacity=300, window=2, seed=0)
        writer = GymStepWriter.from_env(envs, buf)
        assert writer.autoreset_mode == "next_step"
        obs, _ = envs.reset(seed=0)
        writer.reset(obs)
        envs.action_space.seed(0)
        for _ in range(200):
            writer.step(action := envs.action_space.sample(), *envs.step(action))
        assert buf.num_steps == 400 and writer.num_episodes > 5
        tr = buf.sample_transitions(1024, gamma=0.99)
        assert set(np.round(tr.reward.numpy(), 4)) <= {0.0, 1.0}  # CartPole pays 1; 0 after a reset
        assert (tr.bootstrap_discount == 0).any()
    finally:
        envs.close()


def test_inputs_of_other_kinds_store_the_same_steps():
    """int32 actions, float32 rewards, lists and strided views: each kind is checked once
    (or every call, for lists) and stores what the usual kind stores."""
    bufs = [ReplayBuffer(SPEC, num_streams=2, stream_capacity=16, window=2) for _ in range(2)]
    writers = [GymStepWriter(b, autoreset_mode="next_step") for b in bufs]
    rng = np.random.default_rng(5)
    obs = rng.standard_normal((2, 4)).astype(np.float32)
    for w in writers:
        w.reset(obs)
    for t in range(20):
        obs8 = rng.standard_normal((2, 8)).astype(np.float32)
        action, reward = rng.integers(0, 3, 2), rng.random(2)
        term, trunc = rng.random(2) < 0.2, np.zeros(2, bool)
        writers[0].step(action, np.ascontiguousarray(obs8[:, ::2]), reward, term, trunc)
        if t % 2:
            writers[1].step(action.astype(np.int32), obs8[:, ::2], reward.astype(np.float32), term, trunc)
        else:
            writers[1].step(action.tolist(), obs8[:, ::2].tolist(), reward.tolist(), term.tolist(), [0, 0])
    a, b = (w.buffer.state_dict()["arrays"] for w in writers)
    for name, arr in a.items():
        np.testing.assert_array_equal(arr, b[name], err_msg=name)
    assert writers[1].num_steps == 40 and writers[1].num_episodes == writers[0].num_episodes


@pytest.mark.parametrize("spec", [
    Spec({**{k: SPEC[k] for k in SPEC.fields}, "cost": Field((), np.float32)}),
    Spec({"obs": Field((4,), np.float32), "action": Field((4, 3, 3), np.uint8, frame_stack=True),
          "reward": Field((), np.float32)}),
], ids=["other field", "frame-stacked action"])
def test_specs_the_writer_cannot_fill_are_refused_with_the_way_out(spec):
    buffer = ReplayBuffer(spec, num_streams=2, stream_capacity=50, window=2, seed=0)
    with pytest.raises(ConfigError, match=r"GymStepConverter with ReplayBuffer\.add"):
        GymStepWriter(buffer, autoreset_mode="next_step")
    assert len(buffer) == 0


def test_fields_of_any_shape_and_strided_inputs_store_what_the_converter_stores():
    """The compiled write copies rows of a field of its own array (over 32 bytes a step)
    and of a record field, from dense inputs and from strided ones, with a cast (float64
    obs into float32) or without (the action), as ``ReplayBuffer.add`` stores them."""
    spec = Spec({"obs": Field((17,), np.float32), "action": Field((2,), np.float64),
                 "reward": Field((), np.float32)})
    a, b = (ReplayBuffer(spec, num_streams=2, stream_capacity=16, window=3, seed=0) for _ in range(2))
    writer = GymStepWriter(a, autoreset_mode="next_step")
    conv = GymStepConverter(2, autoreset_mode="next_step")
    rng = np.random.default_rng(4)
    obs = rng.standard_normal((2, 17)).astype(np.float32)
    writer.reset(obs)
    conv.reset(obs)
    for t in range(40):
        wide, action = rng.standard_normal((2, 17, 2)), rng.standard_normal((2, 2, 3))
        if t % 2:  # strided: obs and reward of other dtypes than the stored ones, the action not
            obs, action, reward = wide[..., 0], action[..., 1], rng.random(2)
        else:  # the stored dtypes, dense
            obs, action = np.ascontiguousarray(wide[..., 0], np.float32), np.ascontiguousarray(action[..., 1])
            reward = rng.random(2).astype(np.float32)
        term, trunc = rng.random(2) < 0.1, rng.random(2) < 0.1
        writer.step(action, obs, reward, term, trunc)
        for step, ids in conv.step(action, obs, reward, term, trunc, {}):
            b.add(step, stream_ids=ids)
    sa, sb = a.state_dict()["arrays"], b.state_dict()["arrays"]
    for name, arr in sa.items():
        np.testing.assert_array_equal(arr, sb[name], err_msg=name)
    assert writer.num_steps == conv.num_steps == 80 and writer.num_episodes == conv.num_episodes > 2


# Each kind, and the values of it that are not in their stored form (converted once each).
GYM_KINDS = {
    "list_action": (lambda a, o, r: (a.tolist(), o, r), {"action"}),
    "torch": (lambda a, o, r: (torch.from_numpy(a.copy()), torch.from_numpy(o.copy()), r), {"action", "obs"}),
    "float64_obs_and_reward": (lambda a, o, r: (a, o.astype(np.float64), r.astype(np.float64)),
                               {"obs", "reward"}),
    "int32_action": (lambda a, o, r: (a.astype(np.int32), o, r), {"action"}),
    "strided_obs": (lambda a, o, r: (a, np.repeat(o, 2, axis=1)[:, ::2], r), {"obs"}),
}


@pytest.mark.parametrize("kind", sorted(GYM_KINDS))
def test_natural_inputs_take_the_one_step_writer_and_store_what_typed_inputs_store(kind, monkeypatch):
    """Each kind takes the compiled write: no step goes through the full validation
    (patched to raise here), no value is cast in Python but an observation held over an
    episode end (the kernel takes each kind as it comes, in a form compiled for it), and
    the buffer holds what typed inputs give."""
    bufs = [ReplayBuffer(SPEC, num_streams=2, stream_capacity=16, window=2, seed=0) for _ in range(2)]
    writers = [GymStepWriter(b, autoreset_mode="next_step") for b in bufs]

    def no_full_path(*args):
        raise AssertionError("a natural input went through the full validation")
    monkeypatch.setattr(validation, "validate", no_full_path)
    casts = []
    for module in (coerce, writer_module):
        def counted(name, *args, _cast=module.as_stored, **kwargs):
            casts.append(name)
            return _cast(name, *args, **kwargs)
        monkeypatch.setattr(module, "as_stored", counted)
    natural, converted = GYM_KINDS[kind]
    rng = np.random.default_rng(3)
    obs = rng.standard_normal((2, 4)).astype(np.float32)
    for w in writers:
        w.reset(obs)
    for _ in range(20):
        action, obs = rng.integers(0, 3, 2), rng.standard_normal((2, 4)).astype(np.float32)
        reward, term = rng.random(2).astype(np.float32), rng.random(2) < 0.2
        writers[0].step(action, obs, reward, term, np.zeros(2, bool))
        writers[1].step(*natural(action, obs, reward), term, np.zeros(2, bool))
    a, b = (w.buffer.state_dict()["arrays"] for w in writers)
    for name, arr in a.items():
        np.testing.assert_array_equal(arr, b[name], err_msg=name)
    assert writers[1].num_steps == 40
    assert set(casts) <= converted & {"obs"}
    # The stored form's, that of gymnasium's float64 rewards (made with the writer), this kind's.
    assert len(writers[1]._write_held.__self__._kernels[1].forms) <= 3


def _pixel_run(spec: Spec, mode: str, num_envs: int, steps: int, seed: int, reward_dtype: type = np.float32):
    """Gym outputs of ``num_envs`` envs of 4-frame stacks (a reset stack repeats its first
    frame; episodes of 1-4 steps, ended by termination or truncation) into a writer's
    buffer of ``spec`` and, through the converter, into a buffer of plain storage."""
    plain = Spec({"obs": Field(spec["obs"].shape, np.uint8), **{k: spec[k] for k in ("action", "reward")}})
    a = ReplayBuffer(spec, num_streams=num_envs, stream_capacity=24, window=2, seed=0)
    b = ReplayBuffer(plain, num_streams=num_envs, stream_capacity=24, window=2, seed=0)
    writer, conv = GymStepWriter(a, autoreset_mode=mode), GymStepConverter(num_envs, autoreset_mode=mode)
    rng = np.random.default_rng(seed)
    frame = spec["obs"].shape[1:]

    def reset_stack() -> np.ndarray:
        return np.repeat(rng.integers(0, 256, (1, *frame), dtype=np.uint8), 4, axis=0)
    obs = np.stack([reset_stack() for _ in range(num_envs)])
    writer.reset(obs)
    conv.reset(obs)
    ended = np.zeros(num_envs, bool)  # NEXT_STEP: the env resets in its next step
    for _ in range(steps):
        obs = obs.copy()
        term, trunc = rng.random(num_envs) < 0.2, rng.random(num_envs) < 0.15
        term[ended], trunc[ended] = False, False
        finals = []
        for e in range(num_envs):
            if ended[e]:
                obs[e] = reset_stack()
            else:
                obs[e] = np.concatenate([obs[e, 1:], rng.integers(0, 256, (1, *frame), dtype=np.uint8)])
            finals.append(obs[e].copy() if term[e] or trunc[e] else None)
            if mode == "same_step" and (term[e] or trunc[e]):
                obs[e] = reset_stack()
        ended = (term | trunc) & (mode == "next_step")
        info = {"final_obs": np.array([*finals, None], dtype=object)[:-1]} if mode == "same_step" else {}
        action, reward = rng.integers(0, 4, num_envs), rng.random(num_envs).astype(reward_dtype)
        writer.step(action, obs, reward, term, trunc, info)
        for step, ids in conv.step(action, obs, reward, term, trunc, info):
            b.add(step, stream_ids=ids)
    return a, b, writer, conv


def test_gymnasium_rewards_keep_one_compiled_form_across_episode_ends(monkeypatch):
    """float64 rewards (gymnasium's) into a frame-stacked writer: the steps at episode ends
    come in the kinds of the others (the padding's zeros too), so the one-step writer takes
    the float64 form once, not again at every episode end (tens of microseconds each)."""
    switches = []
    converted = one_step.OneStepAdd._converted
    monkeypatch.setattr(one_step.OneStepAdd, "_converted",
                        lambda self, *a: switches.append(1) or converted(self, *a))
    spec = Spec({"obs": Field((4, 3, 5), np.uint8, frame_stack=True), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})
    a, b, writer, _conv = _pixel_run(spec, "next_step", 1, steps=90, seed=5, reward_dtype=np.float64)
    sa, sb = a.state_dict()["arrays"], b.state_dict()["arrays"]
    for name, arr in sa.items():
        np.testing.assert_array_equal(arr, sb[name], err_msg=name)
    assert writer.num_episodes > 20 and len(switches) == 1


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
@pytest.mark.parametrize(("num_envs", "patterns"),
                         [(1, steps_module.PATTERNS), (3, steps_module.PATTERNS), (3, 2)])
def test_frame_stacks_across_short_episodes_store_what_the_converter_stores(mode, num_envs, patterns,
                                                                           monkeypatch):
    """Pixels with episodes of 1-4 steps, past the wrap of a 24-step stream: each slot's
    stack rebuilt bit for bit, and the step types, discounts and episode counts of every
    boundary as the converter gives them; also when the writer forgets its remembered
    boundary patterns (``patterns=2``: cleared every few steps)."""
    monkeypatch.setattr(steps_module, "PATTERNS", patterns)
    spec = Spec({"obs": Field((4, 3, 5), np.uint8, frame_stack=True), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})
    a, b, writer, conv = _pixel_run(spec, mode, num_envs, steps=90, seed=num_envs)
    sa, sb = a.state_dict()["arrays"], b.state_dict()["arrays"]
    assert sa.keys() == sb.keys()
    for name, arr in sa.items():
        np.testing.assert_array_equal(arr, sb[name], err_msg=name)
    assert (writer.num_steps, writer.num_episodes) == (conv.num_steps, conv.num_episodes)
    assert writer.num_episodes > 20 * num_envs
    assert len(writer._after) <= patterns
    types = sa["step_type"].numpy()
    assert (types == LAST).sum() >= 3 and (sa["discount"].numpy() == 0).any()
