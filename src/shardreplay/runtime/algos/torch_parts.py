"""The torch parts the algorithms share: a learner's state of named parts
(:class:`LearnerState`) and the torch actor policies' base with Ape-X exploration
(:class:`ApexActor`). Only learners and the actors whose policy needs torch (SAC, R2D2,
image Q-networks, ``--actor-device cuda``) import this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from shardreplay.errors import ConfigError
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos.apex import ApexExploration

__all__ = ["ApexActor", "LearnerState", "Part", "flat_observations", "unwrap"]

Part = nn.Module | torch.optim.Optimizer | torch.Tensor


def flat_observations(transitions: Any, learner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The observations and next observations of ``transitions`` (``nstep_transitions``'
    result) as float tensors, for a learner that takes one observation tensor.

    Raises:
        ConfigError: the observations are nested (a dict of tensors); ``learner`` names
            the learner in the message.
    """
    obs, next_obs = transitions.observation, transitions.next_observation
    if not isinstance(obs, torch.Tensor) or not isinstance(next_obs, torch.Tensor):
        raise ConfigError(f"{learner} learns from flat observations (one tensor), not nested ones")
    return obs.float(), next_obs.float()


def unwrap(module: nn.Module) -> nn.Module:
    """The bare network inside a ``DistributedDataParallel`` wrapper (``module`` itself
    when it is not wrapped)."""
    return module.module if hasattr(module, "module") and isinstance(module.module, nn.Module) else module


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


class ApexActor:
    """What the torch epsilon-greedy actor policies (DQN's image and CUDA ones, R2D2's)
    share: their network on the actor's device, loaded from published weights (tensors or
    arrays), and Ape-X's exploration (:class:`~.apex.ApexExploration`).

    Args:
        net: the Q-network (weights loaded by :meth:`load`).
        s: the actor's resolved settings.

    Raises:
        ShardReplayError: settings not resolved (see :class:`~.apex.ApexExploration`).
    """

    def __init__(self, net: nn.Module, s: ActorSettings) -> None:
        self.exploration = ApexExploration(s)
        self.device = torch.device(s.device)
        self.net = net.to(self.device)

    def load(self, weights: Mapping[str, Any]) -> None:
        """Take newly published weights (a recurrent state held per env is kept)."""
        self.net.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
