"""The torch parts the algorithms share: a learner's state of named parts
(:class:`LearnerState`), the online/target Q-learner of DQN and R2D2 (:class:`QLearner`),
and the torch actor policies' base (:class:`TorchPolicy`, with Ape-X exploration:
:class:`ApexActor`). Only learners and the actors whose policy needs torch import it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos.base import ActorPolicy, ApexExploration

__all__ = ["ApexActor", "LearnerState", "Part", "QLearner", "TorchPolicy", "flat_observations",
           "soft_update", "unwrap"]

Part = nn.Module | torch.optim.Optimizer | torch.Tensor


def flat_observations(transitions: Any, learner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The observations and next observations of ``transitions`` (``nstep_transitions``'
    result) as float tensors, for a learner that takes one observation tensor.

    Raises:
        ConfigError: the observations are nested (a dict of tensors); ``learner`` names
            the learner in the message.
    """
    obs, next_obs = transitions.obs, transitions.next_obs
    if not isinstance(obs, torch.Tensor) or not isinstance(next_obs, torch.Tensor):
        raise ConfigError(f"{learner} learns from flat observations (one tensor), not nested ones")
    return obs.float(), next_obs.float()


def unwrap(module: nn.Module) -> nn.Module:
    """The bare network inside a ``DistributedDataParallel`` wrapper (``module`` itself
    when it is not wrapped)."""
    return module.module if hasattr(module, "module") and isinstance(module.module, nn.Module) else module


def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """``target <- (1 - tau) target + tau source``, parameter by parameter (1: a copy)."""
    with torch.no_grad():
        for t, o in zip(target.parameters(), source.parameters(), strict=True):
            t.mul_(1.0 - tau).add_(o, alpha=tau)


class LearnerState:
    """``state_dict`` / ``load_state_dict`` of a learner made of named parts (networks,
    optimizers, tensors) and an update count, for the algorithms' :class:`~.base.Agent`.

    A subclass sets ``algo`` (its ``--algo``) and ``state_key`` (an entry that only its
    own state has, so that a checkpoint of another algorithm is refused by name), and
    lists its parts in :meth:`_state_parts`, in the order they are saved (checkpoints
    keep that order: the same learner state, the same bytes).
    """

    algo: ClassVar[str]
    state_key: ClassVar[str]
    updates: int

    def _state_parts(self) -> dict[str, Part]:
        """The parts saved, by entry name."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Every part's state (a tensor: a detached copy), then ``updates``."""
        state: dict[str, Any] = {name: part.detach().clone() if isinstance(part, torch.Tensor)
                                 else part.state_dict() for name, part in self._state_parts().items()}
        state["updates"] = self.updates
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`.

        Raises:
            ConfigError: ``state`` is another algorithm's learner (a checkpoint of another --algo).
        """
        if self.state_key not in state:
            raise ConfigError(f"the checkpoint holds another algorithm's learner (not --algo {self.algo}): "
                              "resume it with the --algo it was trained with")
        for name, part in self._state_parts().items():
            if isinstance(part, torch.Tensor):
                with torch.no_grad():
                    part.copy_(torch.as_tensor(state[name]))
            else:
                part.load_state_dict(state[name])
        self.updates = int(state["updates"])


class QLearner(LearnerState):
    """Online and target Q-networks and Adam (DQN's and R2D2's learners, ``online`` maybe
    in DDP, ``settings`` a :class:`~.dqn_torch.DqnSettings`); its ``state_dict`` holds the
    online network (as ``state_key``), ``target``, ``optimizer`` and ``updates``."""

    def __init__(self, online: nn.Module, settings: Any) -> None:
        self.online = online
        self.target = copy.deepcopy(unwrap(online)).requires_grad_(False)
        self.settings = settings
        self.optimizer = torch.optim.Adam(online.parameters(), lr=settings.lr, eps=settings.adam_eps)
        self.updates = 0

    @property
    def module(self) -> nn.Module:
        """The bare online Q-network (without DDP)."""
        return unwrap(self.online)

    def _step(self, loss: torch.Tensor) -> None:
        """One Adam step on ``loss`` (gradient norm clipped to ``grad_clip``), counted; every
        ``target_update_interval`` updates the target moves by ``tau`` (1: a hard copy)."""
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.online.parameters(), s.grad_clip)
        self.optimizer.step()
        self.updates += 1
        if self.updates % s.target_update_interval == 0:
            soft_update(self.target, self.module, s.tau)

    def _state_parts(self) -> dict[str, Part]:
        """Online, target and optimizer state (then the update count)."""
        return {self.state_key: self.module, "target": self.target, "optimizer": self.optimizer}


class TorchPolicy(ActorPolicy):
    """An actor's torch network on the actor's device (``s.device``, of its resolved
    settings), loaded from published weights (tensors or arrays) by :meth:`load`."""

    def __init__(self, net: nn.Module, s: ActorSettings) -> None:
        self.device = torch.device(s.device)
        self.net = net.to(self.device)

    def load(self, weights: Mapping[str, Any]) -> None:
        """Take newly published weights (a recurrent state held per env is kept)."""
        self.net.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})


class ApexActor(TorchPolicy):
    """A torch epsilon-greedy actor policy (DQN's image and CUDA ones, R2D2's) with
    Ape-X's exploration (:class:`~.base.ApexExploration`).

    Raises:
        ShardReplayError: settings not resolved (see :class:`~.base.ApexExploration`).
    """

    def __init__(self, net: nn.Module, s: ActorSettings) -> None:
        self.exploration = ApexExploration(s)
        super().__init__(net, s)
