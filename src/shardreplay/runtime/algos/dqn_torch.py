"""DQN's torch parts: Double DQN with n-step returns and prioritized replay, on sampled
windows, and the torch actor policy (image Q-networks, ``--actor-device cuda``).

::

    a*     = argmax_a Q_online(o_m, a)
    target = R + gamma_m * Q_target(o_m, a*)         (gamma_m = 0 after a termination)
    td     = target - Q_online(o_0, a_0)
    loss   = mean_b( w_b * huber(td_b) )             (w: importance weights)

New priorities are ``|td| + priority_eps``. :data:`~.dqn.DQN` (torch-free) is the algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.nstep import nstep_transitions
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos.base import check_fits, mlp_hidden
from shardreplay.runtime.algos.networks import QNetwork, make_q_network
from shardreplay.runtime.algos.torch_parts import ApexActor, QLearner, flat_observations
from shardreplay.runtime.envs import EnvInfo

__all__ = ["DoubleDqn", "DqnSettings", "EpsilonGreedyPolicy", "q_network_of"]


@dataclass(frozen=True)
class DqnSettings:
    """Learning settings (documented in ``shardreplay train --help``; ``tau`` 1: the target
    is a hard copy every ``target_update_interval`` updates)."""

    gamma: float = 0.99
    lr: float = 2.3e-3
    grad_clip: float = 10.0
    target_update_interval: int = 10
    tau: float = 1.0
    priority_eps: float = 1e-3
    adam_eps: float = 1e-8


class DoubleDqn(QLearner):
    """Double DQN's learning step on online and target Q-networks
    (:class:`~.torch_parts.QLearner`; ``state_dict``: ``online``, ``target``,
    ``optimizer``, ``updates``)."""

    algo, state_key = "dqn", "online"

    def learn(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """One gradient step on ``batch``; returns (new priorities ``[B]``, loss).

        A padding batch (an empty shard in local mode: weights 0, well-formed windows)
        takes the normal path, so DDP sees the same forward and backward on every rank.

        Raises:
            ConfigError: the batch's observations are nested (a dict), not one tensor.
        """
        s = self.settings
        tr = nstep_transitions(batch, s.gamma, validate=False)
        obs, next_obs = flat_observations(tr, "DoubleDqn")
        q = self.online(obs).gather(1, tr.action.long().reshape(-1, 1)).squeeze(1)
        with torch.no_grad():
            best = self.online(next_obs).argmax(dim=1, keepdim=True)
            bootstrap = self.target(next_obs).gather(1, best).squeeze(1)
            target = tr.reward.float() + tr.bootstrap_discount.float() * bootstrap
        td = target - q
        loss = (batch.weights.float() * F.smooth_l1_loss(q, target, reduction="none")).mean()
        self._step(loss)
        return td.detach().abs() + s.priority_eps, float(loss.detach())


class EpsilonGreedyPolicy(ApexActor):
    """An actor's torch Q-network with Ape-X exploration (:class:`~.torch_parts.ApexActor`):
    image networks and CUDA actors (an MLP on the CPU acts in NumPy, :class:`~.dqn.NumpyEpsilonGreedyPolicy`).
    """

    def act(self, obs: np.ndarray, state: None, run_steps: int) -> tuple[np.ndarray, None]:
        """Epsilon-greedy actions."""
        with torch.no_grad():
            q = self.net(torch.as_tensor(obs, device=self.device))
        return self.exploration.actions(q.argmax(dim=1).cpu().numpy(), int(q.shape[1]), run_steps), None


def q_network_of(weights: Mapping[str, Any], env: EnvInfo, s: ActorSettings, kind: str) -> nn.Module:
    """The torch Q-network of ``kind`` (``--network`` as ``choose_network`` resolved it)
    that the published ``weights`` fit (an MLP's hidden sizes read from them).

    Raises:
        ConfigError: the weights are not such a network for this environment.
    """
    if kind == "mlp":
        size = env.obs_shape[0]
        return QNetwork(size, env.num_actions, mlp_hidden(weights, size, env.num_actions, s))
    net = make_q_network(env.obs_shape, env.num_actions, kind)
    check_fits(net, weights, s, env, f"a {kind} Q-network", "and --network")
    return net
