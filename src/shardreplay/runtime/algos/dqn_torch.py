"""DQN's torch parts: Double DQN with n-step returns and prioritized replay, on sampled
windows, and the torch actor policy (image Q-networks, ``--actor-device cuda``).

::

    a*     = argmax_a Q_online(o_m, a)
    target = R + gamma_m * Q_target(o_m, a*)         (gamma_m = 0 after a termination)
    td     = target - Q_online(o_0, a_0)
    loss   = mean_b( w_b * huber(td_b) )             (w: importance weights)

New priorities are ``|td| + priority_eps``.

:data:`~.dqn.DQN` (:mod:`.dqn`, torch-free) is the algorithm ``train --algo dqn`` runs: this
learner, and actors that act epsilon-greedily with their streams' Ape-X epsilons (an
MLP on the CPU in NumPy, :mod:`.numpy_policy`; any other with :class:`EpsilonGreedyPolicy`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardreplay.buffer.batch import Batch
from shardreplay.buffer.nstep import nstep_transitions
from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos.base import FeedForward, fits
from shardreplay.runtime.algos.networks import QNetwork, make_q_network
from shardreplay.runtime.algos.numpy_policy import mlp_hidden
from shardreplay.runtime.algos.torch_parts import ApexActor, LearnerState, Part, flat_observations, unwrap
from shardreplay.runtime.envs import EnvInfo

__all__ = ["DoubleDqn", "DqnSettings", "EpsilonGreedyPolicy", "q_network_of"]


@dataclass(frozen=True)
class DqnSettings:
    """Learning settings (documented in ``shardreplay train --help``)."""

    gamma: float = 0.99
    lr: float = 2.3e-3
    grad_clip: float = 10.0
    target_update_interval: int = 10
    tau: float = 1.0
    priority_eps: float = 1e-3


class DoubleDqn(LearnerState):
    """Online and target Q-networks, the optimizer, and one learning step; its
    ``state_dict`` holds ``online``, ``target``, ``optimizer`` and ``updates``.

    Args:
        online: the Q-network that learns (may be wrapped in DDP).
        settings: learning settings.
    """

    algo, state_key = "dqn", "online"

    def __init__(self, online: nn.Module, settings: DqnSettings) -> None:
        self.online = online
        self.target = copy.deepcopy(unwrap(online)).requires_grad_(False)
        self.settings = settings
        self.optimizer = torch.optim.Adam(online.parameters(), lr=settings.lr)
        self.updates = 0

    @property
    def module(self) -> nn.Module:
        """The bare Q-network (without DDP)."""
        return unwrap(self.online)

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
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.online.parameters(), s.grad_clip)
        self.optimizer.step()
        self._after_step()
        return td.detach().abs() + s.priority_eps, float(loss.detach())

    def _after_step(self) -> None:
        """Count the update; move the target network (a copy every
        ``target_update_interval`` updates, blended by ``tau``: 1 is a hard copy)."""
        self.updates += 1
        if self.updates % self.settings.target_update_interval:
            return
        tau = self.settings.tau
        with torch.no_grad():
            for t, o in zip(self.target.parameters(), self.module.parameters(), strict=True):
                t.mul_(1.0 - tau).add_(o, alpha=tau)

    def _state_parts(self) -> dict[str, Part]:
        """Online, target and optimizer state (then the update count)."""
        return {"online": self.module, "target": self.target, "optimizer": self.optimizer}


class EpsilonGreedyPolicy(FeedForward, ApexActor):
    """An actor's torch Q-network with Ape-X exploration (:class:`~.torch_parts.ApexActor`):
    image networks and CUDA actors (an MLP on the CPU acts in NumPy, :mod:`.numpy_policy`).

    Args:
        net: the Q-network (weights loaded by :meth:`load`).
        s: the actor's resolved settings.
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
    if not fits(net, weights):
        raise ConfigError(f"the policy at {s.policy_url} is not a {kind} Q-network for {s.env_id} "
                          f"(observations {list(env.obs_shape)}, {env.num_actions} actions): do the learners "
                          "train the same --env-id and --network?")
    return net
