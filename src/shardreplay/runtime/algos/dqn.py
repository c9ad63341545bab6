"""``--algo dqn``: Double DQN with n-step returns and prioritized replay (the learner is
:mod:`.dqn_torch`), Ape-X epsilon-greedy actors. No torch here: the default actor acts in
NumPy (:class:`NumpyEpsilonGreedyPolicy`; why, and how close: docs/train.md, "Algorithms")."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos import choose_network
from shardreplay.runtime.algos.base import (
    ActorPolicy,
    Algorithm,
    ApexExploration,
    mlp_hidden,
    network_weights,
)
from shardreplay.runtime.envs import EnvInfo
from shardreplay.runtime.settings import TrainSettings

if TYPE_CHECKING:
    from torch import nn

    from shardreplay.runtime.algos.dqn_torch import DoubleDqn
    from shardreplay.runtime.devices import Placement

__all__ = ["DQN", "DqnAlgorithm", "NumpyEpsilonGreedyPolicy", "NumpyQNetwork"]

log = logging.getLogger("shardreplay.actor")


class NumpyQNetwork:
    """:class:`~shardreplay.runtime.algos.networks.QNetwork`'s forward pass in NumPy:
    ``x -> relu(x W_i^T + b_i) -> ... -> x W_n^T + b_n`` in float32 (arguments as ``QNetwork``'s).
    """

    def __init__(self, obs_size: int, num_actions: int, hidden: tuple[int, ...]) -> None:
        # QNetwork's tensor names and shapes: Linear layer i is net.<2i> (a ReLU sits between two).
        self.shapes: dict[str, tuple[int, ...]] = {}
        for i, (width_in, width_out) in enumerate(itertools.pairwise((obs_size, *hidden, num_actions))):
            self.shapes[f"net.{2 * i}.weight"] = (width_out, width_in)
            self.shapes[f"net.{2 * i}.bias"] = (width_out,)
        self.num_actions = num_actions
        self._layers: list[tuple[np.ndarray, np.ndarray]] = []

    def load(self, weights: Mapping[str, Any]) -> None:
        """Take published weights (arrays or tensors, by ``QNetwork``'s names; copied).

        Raises:
            ConfigError: other names or shapes than this network's.
        """
        # float32 copies; a CPU torch tensor read without importing torch
        arrays = {k: np.array(v.detach().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float32)
                  for k, v in network_weights(weights).items()}
        got = {k: tuple(a.shape) for k, a in arrays.items()}
        if got != self.shapes:
            raise ConfigError(f"the published weights {got} are not this actor's Q-network {self.shapes}: "
                              "did the learners change --hidden or --env-id? restart the actor")
        # W^T, contiguous: x @ W^T is one float32 matrix product per layer
        self._layers = [(np.ascontiguousarray(arrays[f"net.{2 * i}.weight"].T), arrays[f"net.{2 * i}.bias"])
                        for i in range(len(self.shapes) // 2)]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Q-values float32 ``[B, num_actions]`` for observations ``[B, obs_size]`` (any
        numeric dtype: converted to float32 first, as ``QNetwork`` does).

        Raises:
            ConfigError: no weights loaded yet.
        """
        if not self._layers:
            raise ConfigError("the NumPy Q-network has no weights yet: load() the published ones first")
        x = np.asarray(obs).astype(np.float32, copy=False)
        last = len(self._layers) - 1
        for i, (weight_t, bias) in enumerate(self._layers):
            x = x @ weight_t  # a new array: the caller's observations are never written
            x += bias
            if i < last:
                np.maximum(x, 0.0, out=x)
        return x


class NumpyEpsilonGreedyPolicy(ActorPolicy):
    """An actor's MLP Q-network in NumPy with Ape-X exploration: the
    :class:`~shardreplay.runtime.algos.base.ActorPolicy` of ``--algo dqn`` on the CPU.

    Raises:
        ShardReplayError: settings not resolved (see :class:`~.base.ApexExploration`).
    """

    def __init__(self, net: NumpyQNetwork, s: ActorSettings) -> None:
        self.net = net
        self.exploration = ApexExploration(s)

    def load(self, weights: Mapping[str, Any]) -> None:
        """Take newly published weights.

        Raises:
            ConfigError: they are not this network's (see :meth:`NumpyQNetwork.load`).
        """
        self.net.load(weights)

    def act(self, obs: np.ndarray, state: None, run_steps: int) -> tuple[np.ndarray, None]:
        """Epsilon-greedy actions (int64 ``[num_envs]``)."""
        greedy = self.net(obs).argmax(axis=1).astype(np.int64, copy=False)
        return self.exploration.actions(greedy, self.net.num_actions, run_steps), None


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
