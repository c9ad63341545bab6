"""SAC (runtime/algos/sac.py): one learning step on synthetic batches, the actor's policy,
checkpoint state, and data-parallel learners that stay bitwise equal (2 gloo ranks).

Cost: about 5 s (the two-rank test spawns two interpreters).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardreplay import ReplayBuffer
from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos import algorithm
from shardreplay.runtime.algos.sac import Sac, SacSettings, SquashedGaussianActor, TwinQ
from shardreplay.runtime.envs import EnvInfo
from shardreplay.runtime.settings import TrainSettings
from tests.support.in_step import assert_ranks_in_step, checksum, learn_on_own_data

ENV = EnvInfo((3,), np.dtype(np.float32), 0, action_shape=(1,), action_low=(-2.0,), action_high=(2.0,))
FIRST, MID, LAST = 0, 1, 2


def _buffer(seed: int, steps: int = 40) -> ReplayBuffer:
    """A buffer of random Pendulum-shaped steps (2 streams, episodes of 10 steps)."""
    rng = np.random.default_rng(seed)
    buf = ReplayBuffer(algorithm("sac").transition_spec(ENV), num_streams=2, stream_capacity=64, window=2,
                       sampler="prioritized", seed=seed)
    for t in range(steps):
        kind = FIRST if t % 10 == 0 else LAST if t % 10 == 9 else MID
        buf.add({"obs": rng.normal(size=(2, 3)).astype(np.float32),
                 "action": rng.uniform(-2, 2, size=(2, 1)).astype(np.float32),
                 "reward": rng.normal(size=2).astype(np.float32),
                 "step_type": np.full(2, kind), "discount": np.full(2, 0.0 if kind == LAST else 1.0)})
    return buf


def _agent(world: int = 1, tau: float = 0.005) -> Sac:
    torch.manual_seed(0)
    return Sac(SquashedGaussianActor(3, (-2.0,), (2.0,), (16, 16)), TwinQ(3, 1, (16, 16)),
               SacSettings(tau=tau), world=world)


def test_spec_stores_float_actions_of_the_box() -> None:
    spec = algorithm("sac").transition_spec(ENV)
    assert spec.fields["action"].shape == (1,) and spec.fields["action"].dtype == np.float32


def test_policy_samples_inside_the_bounds_with_finite_log_probs() -> None:
    actor = SquashedGaussianActor(3, (-2.0, 0.0), (2.0, 1.0), (16,))
    actions, logp = actor.sample(torch.randn(500, 3), torch.Generator().manual_seed(0))
    assert actions.shape == (500, 2) and logp.shape == (500,) and torch.isfinite(logp).all()
    assert (actions[:, 0].abs() <= 2).all() and ((actions[:, 1] >= 0) & (actions[:, 1] <= 1)).all()
    assert actions[:, 0].std() > 0.3  # a wide Gaussian at the start, not a point
    mean = actor.deterministic(torch.zeros(1, 3))
    assert (mean[0, 0].abs() <= 2) and (0 <= mean[0, 1] <= 1)


def test_learn_step_moves_the_networks_soft_target_and_temperature() -> None:
    agent, buf = _agent(tau=0.1), _buffer(1)
    target0 = [p.clone() for p in agent.critic_target.parameters()]
    critic0 = [p.clone() for p in agent.critic.parameters()]
    actor0 = [p.clone() for p in agent.actor.parameters()]
    alpha0 = agent.alpha
    batch = buf.sample(32)
    priorities, loss = agent.learn(batch)
    assert priorities.shape == (32,) and (priorities >= 1e-3).all() and np.isfinite(loss)
    assert agent.updates == 1 and agent.alpha != alpha0
    assert all(not torch.equal(a, b) for a, b in zip(actor0, agent.actor.parameters(), strict=True))
    # the soft update: target = 0.9 target + 0.1 critic (after the critic's step)
    for t0, c0, t, c in zip(target0, critic0, agent.critic_target.parameters(), agent.critic.parameters(),
                            strict=True):
        assert torch.equal(t0, c0)  # the target started as a copy
        assert torch.allclose(t, 0.9 * t0 + 0.1 * c, atol=1e-6)


def test_priorities_are_the_mean_of_the_twin_critics_abs_td_errors() -> None:
    agent, buf = _agent(), _buffer(2)
    batch = buf.sample(16)
    from shardreplay.buffer.nstep import nstep_transitions

    tr = nstep_transitions(batch, 0.99, validate=False)
    torch.manual_seed(5)
    with torch.no_grad():
        next_a, next_logp = agent.actor.sample(tr.next_obs.float())
        tq1, tq2 = agent.critic_target(tr.next_obs.float(), next_a)
        target = tr.reward + tr.bootstrap_discount * (torch.min(tq1, tq2) - agent.alpha * next_logp)
        q1, q2 = agent.critic(tr.obs.float(), tr.action.float())
    torch.manual_seed(5)  # the same draw of a'
    priorities, _ = agent.learn(batch)
    expected = ((target - q1).abs() + (target - q2).abs()) / 2 + 1e-3
    assert torch.allclose(priorities, expected, atol=1e-5)


def test_padding_batch_changes_nothing_but_the_adam_state() -> None:
    agent, buf = _agent(), _buffer(3)
    batch = buf.sample(8)
    batch.weights.zero_()  # what an empty shard sends in local mode
    before = [p.clone() for p in agent.actor.parameters()] + [p.clone() for p in agent.critic.parameters()]
    agent.learn(batch)
    after = [*agent.actor.parameters(), *agent.critic.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_state_dict_round_trip_and_other_algorithms_checkpoint_is_refused() -> None:
    agent, buf = _agent(), _buffer(4)
    agent.learn(buf.sample(8))
    state = agent.state_dict()
    other = _agent()
    other.load_state_dict(state)
    assert other.updates == 1 and other.alpha == agent.alpha
    assert _checksum(other) == _checksum(agent)
    with pytest.raises(ConfigError, match="--algo"):
        other.load_state_dict({"online": {}, "target": {}, "optimizer": {}, "updates": 0})


def test_actor_policy_from_published_weights_explores_uniformly_in_warmup() -> None:
    settings = TrainSettings.from_dict({"algo": "sac", "env_id": "Pendulum-v1", "hidden": [16, 16]})
    torch.manual_seed(0)  # the initial networks, whatever ran before
    agent = algorithm("sac").make_agent(ENV, settings, world=1)
    weights = {k: v.numpy().copy() for k, v in agent.module.state_dict().items()}  # as actors get them
    s = ActorSettings(actor_id=0, algo="sac", num_actors=1, envs_per_actor=4000, policy_url="file:///x",
                      epsilon_warmup_steps=1000, seed=3, env_id="Pendulum-v1")
    policy = algorithm("sac").make_policy(weights, ENV, s)
    obs = np.zeros((4000, 3), np.float32)
    warm, _ = policy.act(obs, None, 0)  # all random: uniform on [-2, 2]
    counts, _ = np.histogram(warm[:, 0], bins=8, range=(-2, 2))
    assert warm.dtype == np.float32 and warm.shape == (4000, 1)
    assert ((counts - 500) ** 2 / 500).sum() < 24.3  # chi-square, 7 dof, p = 0.001
    late, _ = policy.act(obs, None, 1000)  # the policy's own samples: around its squashed mean
    with torch.no_grad():
        mean = float(agent.module.deterministic(torch.zeros(1, 3))[0, 0])
    counts, _ = np.histogram(late[:, 0], bins=8, range=(-2, 2))
    assert ((counts - 500) ** 2 / 500).sum() > 1000  # far from uniform
    assert abs(float(np.median(late[:, 0])) - mean) < 0.2
    with pytest.raises(ConfigError, match="not a SAC policy"):
        algorithm("sac").make_policy({"net.0.weight": torch.zeros(4, 4)}, ENV, s)


def _checksum(agent: Sac) -> str:
    return checksum([*agent.actor.state_dict().values(), *agent.critic.state_dict().values(),
                     *agent.critic_target.state_dict().values(), agent.log_alpha])


def _ddp_updates(rank: int, world: int, updates: int) -> dict[str, object]:
    torch.manual_seed(100 + rank)  # different starting networks: the broadcast must unify them
    agent = Sac(SquashedGaussianActor(3, (-2.0,), (2.0,), (16, 16)), TwinQ(3, 1, (16, 16)), SacSettings(),
                world=world)
    state = learn_on_own_data(agent, _buffer(10 + rank), 16, updates, _checksum)
    return {**state, "alpha": agent.alpha}


@pytest.mark.distributed
def test_two_ranks_stay_bitwise_equal_after_soft_target_updates() -> None:
    """Networks, target critics and temperature: equal checksums on both gloo ranks after
    20 updates on different batches (and different from where they started)."""
    assert_ranks_in_step(_ddp_updates, 20)  # rank 0's networks everywhere, then in step
