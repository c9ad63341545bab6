"""The algorithm interface (runtime/algos): the registry, what each algorithm takes, and
DQN behind it unchanged (its learner state, its actors' epsilon-greedy draws).

Cost: about 2 s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import AGREED, ActorSettings, resolve
from shardreplay.runtime.algos import ACTIONS, algorithm
from shardreplay.runtime.algos.base import apex_epsilons
from shardreplay.runtime.algos.base import explore as apex_explore
from shardreplay.runtime.algos.dqn_torch import DoubleDqn, DqnSettings
from shardreplay.runtime.algos.networks import QNetwork
from shardreplay.runtime.envs import EnvSource, describe_env
from shardreplay.runtime.learner.sync import agreed_settings
from shardreplay.runtime.settings import ALGOS, TrainSettings


def test_every_algo_name_has_a_module_and_an_action_space() -> None:
    assert set(ACTIONS) == set(ALGOS) == {"dqn", "sac", "r2d2"}
    for name in ALGOS:
        algo = algorithm(name)
        assert algo.name == name and algo.actions == ACTIONS[name]
    with pytest.raises(ConfigError, match="--algo must be one of"):
        algorithm("ppo")
    with pytest.raises(ConfigError, match="algo must be one of"):
        TrainSettings.from_dict({"algo": "ppo"})
    for name in ("sac", "r2d2"):  # vectors only: refused with the settings, before any network is built
        with pytest.raises(ConfigError, match=f"--algo {name} takes flat vector .*--network nature"):
            TrainSettings.from_dict({"algo": name, "network": "nature"})


def test_box_actions_are_described_for_sac_and_refused_for_dqn_with_a_hint() -> None:
    info = describe_env(EnvSource("Pendulum-v1"), "box")
    assert (info.obs_shape, info.action_shape) == ((3,), (1,))
    assert (info.action_low, info.action_high) == ((-2.0,), (2.0,))
    with pytest.raises(ConfigError, match=r"needs a Discrete one \(--algo sac takes Box actions\)"):
        describe_env(EnvSource("Pendulum-v1"))
    with pytest.raises(ConfigError, match="--algo sac needs a flat Box"):
        describe_env(EnvSource("CartPole-v1"), "box")


def test_algo_is_agreed_with_actors_and_a_contradiction_is_refused() -> None:
    settings = TrainSettings.from_dict({"algo": "sac", "env_id": "Pendulum-v1"})
    agreed = agreed_settings(settings, world=1)
    assert "algo" in AGREED and agreed["algo"] == "sac"
    from shardreplay.policy.broadcast import RunInfo

    info = RunInfo("r", 0, 0, 0, "local", agreed)
    assert resolve(ActorSettings(actor_id=0, policy_url="file:///p"), info).algo == "sac"
    with pytest.raises(ConfigError, match="--algo dqn contradicts the learner's sac"):
        resolve(ActorSettings(actor_id=0, algo="dqn", policy_url="file:///p"), info)
    unnamed = ActorSettings(actor_id=0, num_actors=1, num_shards=1, transport="file:///t", policy_url="file:///p")
    assert resolve(unnamed, None).algo == "dqn"  # a policy that names no run: DQN, as before


def test_dqn_learner_state_keeps_its_keys() -> None:
    agent = algorithm("dqn").make_agent(describe_env(EnvSource("CartPole-v1")), TrainSettings(), world=1)
    assert isinstance(agent, DoubleDqn) and agent.settings == DqnSettings()
    assert set(agent.state_dict()) == {"online", "target", "optimizer", "updates"}
    with pytest.raises(ConfigError, match="--algo"):  # a SAC learner's state
        agent.load_state_dict({"actor": {}, "critic": {}, "critic_target": {}, "updates": 0})


def test_dqn_policy_acts_as_the_actor_loop_did() -> None:
    """The same actions, draw for draw, as the loop's former epsilon_greedy over the Ape-X
    epsilons with the warm-up, from the same seed."""
    env = describe_env(EnvSource("CartPole-v1"))
    torch.manual_seed(0)
    weights = QNetwork(4, 2, (8,)).state_dict()
    s = ActorSettings(actor_id=1, algo="dqn", num_actors=2, envs_per_actor=64, policy_url="file:///p",
                      network="auto", epsilon_base=0.4, epsilon_exponent=7.0, epsilon_warmup_steps=100,
                      seed=11, env_id="CartPole-v1")
    policy = algorithm("dqn").make_policy(weights, env, s)
    old_net = QNetwork(4, 2, (8,))
    old_net.load_state_dict(weights)
    rng = np.random.default_rng(11)
    eps = apex_epsilons(64, 64, 128, 0.4, 7.0)
    obs = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    for run_steps in (0, 50, 100, 400):
        explore = eps if run_steps >= 100 else np.maximum(eps, 1.0 - run_steps / 100)
        with torch.no_grad():
            expected = apex_explore(old_net(torch.as_tensor(obs)).argmax(dim=1).numpy(), 2, explore, rng)
        actions, state = policy.act(obs, None, run_steps)
        assert state is None and np.array_equal(actions, expected)


def test_learners_of_one_observation_tensor_refuse_nested_observations_by_name() -> None:
    from types import SimpleNamespace

    from shardreplay.runtime.algos.torch_parts import flat_observations

    flat = SimpleNamespace(obs=torch.zeros(2, 3, dtype=torch.float64),
                           next_obs=torch.ones(2, 3, dtype=torch.uint8))
    obs, next_obs = flat_observations(flat, "Sac")
    assert obs.dtype == next_obs.dtype == torch.float32 and torch.equal(next_obs, torch.ones(2, 3))
    nested = SimpleNamespace(obs={"pixels": torch.zeros(2, 3)}, next_obs=torch.zeros(2, 3))
    with pytest.raises(ConfigError, match="DoubleDqn learns from flat observations"):
        flat_observations(nested, "DoubleDqn")
