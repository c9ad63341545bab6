"""``--algo dqn``: Double DQN with n-step returns and prioritized replay (the learner is
:mod:`.dqn_torch`), actors acting epsilon-greedily with Ape-X epsilons. No torch here: the
default actor (an MLP on the CPU) acts in NumPy (:mod:`.numpy_policy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos import choose_network
from shardreplay.runtime.algos.base import ActorPolicy, Algorithm, network_weights
from shardreplay.runtime.algos.numpy_policy import NumpyEpsilonGreedyPolicy, NumpyQNetwork, mlp_hidden
from shardreplay.runtime.envs import EnvInfo
from shardreplay.runtime.settings import TrainSettings

if TYPE_CHECKING:
    from torch import nn

    from shardreplay.runtime.algos.dqn_torch import DoubleDqn
    from shardreplay.runtime.devices import Placement

__all__ = ["DQN", "DqnAlgorithm"]


class DqnAlgorithm(Algorithm):
    """``--algo dqn``: Double DQN with n-step returns (see :mod:`.dqn_torch`)."""

    name = "dqn"
    actions = "discrete"
    policy_key = "online"

    def policy_network(self, env: EnvInfo, network: str, hidden: tuple[int, ...]) -> nn.Module:
        """The Q-network of ``network`` (``auto``: by the observations) and ``hidden``.

        Raises:
            ConfigError: a network that cannot take these observations.
        """
        from shardreplay.runtime.algos.networks import make_q_network

        return make_q_network(env.obs_shape, env.num_actions, network, hidden)

    def make_agent(self, env: EnvInfo, settings: TrainSettings, world: int,
                   placement: Placement | None = None) -> DoubleDqn:
        """The Q-network of ``--network`` on the placement's device (in DDP over its group
        on several ranks) and its learner."""
        from shardreplay.runtime.algos.dqn_torch import DoubleDqn, DqnSettings
        from shardreplay.runtime.devices import CPU, wrap

        ls = settings.learners
        net = wrap(self.policy_network(env, ls.network, ls.hidden), placement or CPU, world)
        return DoubleDqn(net, DqnSettings(gamma=ls.gamma, lr=ls.lr,
                                          target_update_interval=ls.target_update_interval))

    def make_policy(self, weights: Mapping[str, Any], env: EnvInfo, s: ActorSettings) -> ActorPolicy:
        """The Q-network the weights fit, acting epsilon-greedily: an MLP on the CPU in
        NumPy (no torch in the actor), any other network or device with torch.

        Raises:
            ConfigError: the weights are not such a network for this environment.
        """
        kind = choose_network(env.obs_shape, s.network or "auto")
        policy: ActorPolicy
        if kind == "mlp" and s.device == "cpu":
            size = env.obs_shape[0]
            net = NumpyQNetwork(size, env.num_actions, mlp_hidden(weights, size, env.num_actions, s))
            policy = NumpyEpsilonGreedyPolicy(net, s)
        else:
            from shardreplay.runtime.algos.dqn_torch import EpsilonGreedyPolicy, q_network_of

            policy = EpsilonGreedyPolicy(q_network_of(weights, env, s, kind), s)
        policy.load(network_weights(weights))
        return policy

    def greedy(self, module: nn.Module) -> Any:
        """argmax_a Q(o, a)."""
        return lambda obs: module(obs).argmax(dim=1).cpu().numpy()


DQN = DqnAlgorithm()
