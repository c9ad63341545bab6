"""R2D2 (runtime/algos/r2d2.py): burn-in outside the loss, the stored start state used,
sequence priorities, the actor's LSTM state (reset where an episode starts, stored with
each step), checkpoint state and the sequence settings. In-process and small.

Cost: about 3 CPU-s.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

from shardreplay import ReplayBuffer
from shardreplay.buffer.batch import Batch
from shardreplay.buffer.sequences import sequence_batch
from shardreplay.errors import ConfigError
from shardreplay.gym.steps import GymStepConverter
from shardreplay.runtime.actor.loop import play_step
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos import algorithm
from shardreplay.runtime.algos.r2d2 import R2d2, R2d2Settings, RecurrentPolicy, RecurrentQ, sequence_loss
from shardreplay.runtime.envs import EnvInfo, env_source, make_vector_env
from shardreplay.runtime.settings import TrainSettings
from tests.support.in_step import assert_ranks_in_step, checksum, learn_on_own_data

ENV = EnvInfo((2,), np.dtype(np.float32), 2)
FIRST, MID, LAST = 0, 1, 2
H = 8


def _buffer(seed: int = 0, steps: int = 60) -> ReplayBuffer:
    """Masked-CartPole-shaped steps with random stored states (2 streams, episodes of 20)."""
    rng = np.random.default_rng(seed)
    buf = ReplayBuffer(algorithm("r2d2").transition_spec(ENV, (H,)), num_streams=2, stream_capacity=128,
                       window=10, period=5, sampler="prioritized", alpha=0.9, seed=seed)
    for t in range(steps):
        kind = FIRST if t % 20 == 0 else LAST if t % 20 == 19 else MID
        buf.add({"obs": rng.normal(size=(2, 2)).astype(np.float32),
                 "action": rng.integers(0, 2, size=2), "reward": rng.normal(size=2).astype(np.float32),
                 "h": rng.normal(size=(2, H)).astype(np.float32),
                 "c": rng.normal(size=(2, H)).astype(np.float32),
                 "step_type": np.full(2, kind), "discount": np.full(2, 0.0 if kind == LAST else 1.0)})
    return buf


def _agent(burn_in: int = 3, n_step: int = 2) -> R2d2:
    torch.manual_seed(0)
    return R2d2(RecurrentQ(2, 2, H), R2d2Settings(n_step=n_step, burn_in=burn_in, target_update_interval=2))


def _loss(agent: R2d2, batch: Batch) -> float:
    s = agent.settings
    seq = sequence_batch(batch, burn_in=s.burn_in, state=("h", "c"))
    return float(sequence_loss(agent.online, agent.target, seq, s.n_step, s.gamma)[0].detach())


def _edited(batch: Batch, field: str, positions: slice, value: float | None = None) -> Batch:
    out = copy.deepcopy(batch)
    data = out.data[field]
    data[:, positions] = (1 - data[:, positions]) if value is None else value
    return out


def test_burn_in_is_unrolled_but_not_learned_from() -> None:
    agent, batch = _agent(burn_in=3), _buffer().sample(16)
    seq = sequence_batch(batch, burn_in=3, state=("h", "c"))
    *_, learn_here = sequence_loss(agent.online, agent.target, seq, 2, 0.99)
    assert not learn_here[:, :3].any() and learn_here[:, 3:].any()
    base = _loss(agent, batch)
    # The actions of burn-in steps choose no Q-value the loss looks at ...
    assert _loss(agent, _edited(batch, "action", slice(0, 3))) == pytest.approx(base, abs=0)
    # ... those of the learning part do, and the burn-in's observations move the state.
    assert _loss(agent, _edited(batch, "action", slice(3, 8))) != pytest.approx(base)
    assert _loss(agent, _edited(batch, "obs", slice(0, 3), 5.0)) != pytest.approx(base)
    # The learner starts from the stored state at the first step, not from zeros.
    assert _loss(agent, _edited(batch, "h", slice(0, 1), 0.0)) != pytest.approx(base)
    assert _loss(agent, _edited(batch, "h", slice(1, 10), 0.0)) == pytest.approx(base, abs=0)


def test_priorities_mix_max_and_mean_of_the_learned_td_errors() -> None:
    agent, batch = _agent(burn_in=3), _buffer().sample(16)
    seq = sequence_batch(batch, burn_in=3, state=("h", "c"))
    _l, td, learn_here = sequence_loss(agent.online, agent.target, seq, 2, 0.99)
    priorities, loss = agent.learn(batch)  # the step's TD errors are those before it
    delta, keep = td.abs().numpy(), learn_here.numpy()
    expected = [0.9 * d[k].max() + 0.1 * d[k].mean() + 1e-3 for d, k in zip(delta, keep, strict=True)]
    assert priorities.shape == (16,) and np.isfinite(loss)
    np.testing.assert_allclose(priorities.numpy(), expected, rtol=1e-5)


def test_learning_updates_the_network_and_copies_the_target_every_interval() -> None:
    agent, buf = _agent(), _buffer()
    before = copy.deepcopy(agent.module.state_dict())
    agent.learn(buf.sample(8))
    assert agent.updates == 1
    assert not torch.equal(before["head.weight"], agent.module.state_dict()["head.weight"])
    assert torch.equal(agent.target.state_dict()["head.weight"], before["head.weight"])
    agent.learn(buf.sample(8))  # interval 2: a hard copy
    assert all(torch.equal(v, agent.target.state_dict()[k]) for k, v in agent.module.state_dict().items())
    state = agent.state_dict()
    other = _agent()
    other.load_state_dict(state)
    assert other.updates == 2
    assert torch.equal(other.module.state_dict()["head.weight"], agent.module.state_dict()["head.weight"])
    with pytest.raises(ConfigError, match="not --algo r2d2"):
        other.load_state_dict({"online": {}, "target": {}})


def _actor(weights: Mapping[str, Any], envs: int = 3) -> RecurrentPolicy:
    s = ActorSettings(actor_id=0, algo="r2d2", num_actors=1, envs_per_actor=envs, policy_url="file:///x",
                      epsilon_warmup_steps=0, seed=5, env_id="shardreplay/MaskedCartPole-v1")
    policy = algorithm("r2d2").make_policy(weights, ENV, s)
    assert isinstance(policy, RecurrentPolicy)
    return policy


def test_actor_stores_the_state_it_acted_from_and_restarts_it_with_each_episode() -> None:
    torch.manual_seed(1)
    net = RecurrentQ(2, 2, H)
    policy = _actor({k: v.numpy() for k, v in net.state_dict().items()})  # as actors get them
    env, obs = make_vector_env(env_source("shardreplay/MaskedCartPole-v1"), 3, seed=0)
    converter = GymStepConverter.from_env(env)
    converter.reset(obs)
    state = policy.initial_state(3)
    written = []
    try:
        for t in range(120):
            obs, state, steps = play_step(policy, env, converter, obs, state, t)
            written += steps
    finally:
        env.close()
    kinds = np.stack([s["step_type"] for s in written], axis=1)
    assert (kinds == LAST).sum() >= 3  # episodes ended (random actions end CartPole fast)
    for i in range(3):  # each env: the stored state is the LSTM unrolled over its episode so far
        h, c = net.initial_state(1)
        for step in written:
            if step["step_type"][i] == FIRST:
                h, c = net.initial_state(1)
            np.testing.assert_allclose(step["h"][i], h[0].numpy(), atol=1e-5)
            np.testing.assert_allclose(step["c"][i], c[0].numpy(), atol=1e-5)
            with torch.no_grad():
                _q, (h, c) = net(torch.as_tensor(step["obs"][i:i + 1])[:, None], (h, c))
    first = kinds == FIRST
    assert first[:, 1:].any() and all(np.abs(s["h"][s["step_type"] == FIRST]).max(initial=0) == 0
                                      for s in written)


def test_greedy_keeps_its_state_between_calls() -> None:
    torch.manual_seed(2)
    net = RecurrentQ(2, 2, H)
    act = algorithm("r2d2").greedy(net)
    obs = torch.randn(6, 5, 2)
    got = np.stack([act(obs[:, t]) for t in range(5)], axis=1)
    with torch.no_grad():
        want = net(obs, net.initial_state(6))[0].argmax(-1).numpy()
    np.testing.assert_array_equal(got, want)


def test_spec_settings_and_published_weights() -> None:
    spec = algorithm("r2d2").transition_spec(ENV, (32, 16))
    assert spec.fields["h"].shape == (16,) and spec.fields["c"].shape == (16,)
    s = TrainSettings.from_dict({"algo": "r2d2", "seq_len": 20, "seq_period": 10, "burn_in": 5, "n_step": 5})
    assert (s.window, s.period) == (20, 10)
    assert (TrainSettings().window, TrainSettings().period) == (4, 1)  # dqn: n + 1, every step
    with pytest.raises(ConfigError, match="burn_in \\+ n_step < seq_len"):
        TrainSettings.from_dict({"algo": "r2d2", "seq_len": 8, "burn_in": 4, "n_step": 4})
    with pytest.raises(ConfigError, match="seq_period"):
        TrainSettings.from_dict({"algo": "r2d2", "seq_len": 8, "seq_period": 9, "burn_in": 1})
    with pytest.raises(ConfigError, match="not an R2D2 network"):
        _actor({"net.0.weight": torch.zeros(4, 2)})


def _checksum(agent: R2d2) -> str:
    return checksum([*agent.module.state_dict().values(), *agent.target.state_dict().values()])


def _ddp_updates(rank: int, world: int, updates: int) -> dict[str, object]:
    torch.manual_seed(100 + rank)  # different starting networks: DDP must unify them
    settings = TrainSettings.from_dict({"algo": "r2d2", "hidden": [H], "n_step": 2, "seq_len": 10,
                                        "seq_period": 5, "burn_in": 3, "target_update_interval": 4})
    agent = algorithm("r2d2").make_agent(ENV, settings, world=world)
    assert isinstance(agent, R2d2)
    return learn_on_own_data(agent, _buffer(10 + rank), 8, updates, _checksum)  # its own data: its shard


@pytest.mark.distributed
def test_two_ranks_keep_equal_networks_and_targets() -> None:
    """DDP over 2 gloo ranks learning from different sequences: online and target
    networks bitwise equal after 10 updates (two target copies), and moved."""
    assert_ranks_in_step(_ddp_updates, 10)
