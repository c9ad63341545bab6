"""The Q-network (torch) and the per-stream exploration rates (Ape-X).

The exploration itself is torch-free (:mod:`shardreplay.runtime.algos.apex`);
:func:`apex_epsilons` is re-exported here for the scripts that import it from this module.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shardreplay.runtime.algos.apex import apex_epsilons, explore

__all__ = ["QNetwork", "apex_epsilons", "epsilon_greedy"]


class QNetwork(nn.Module):
    """An MLP from a flat observation to one Q-value per action.

    Its twin without torch, :class:`~shardreplay.runtime.algos.numpy_policy.NumpyQNetwork`,
    acts from the same weights (``net.<2i>.weight`` / ``net.<2i>.bias``).

    Args:
        obs_size: length of the observation vector.
        num_actions: number of discrete actions.
        hidden: sizes of the hidden layers.
    """

    def __init__(self, obs_size: int, num_actions: int, hidden: tuple[int, ...] = (128, 128)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = obs_size
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_actions))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values ``[B, num_actions]`` for observations ``[B, obs_size]``."""
        return self.net(obs.to(torch.float32))


def epsilon_greedy(q: torch.Tensor, epsilons: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Greedy actions, replaced by uniform random ones with probability ``epsilons[i]``
    (the draws of :func:`~shardreplay.runtime.algos.apex.explore`)."""
    return explore(q.argmax(dim=1).cpu().numpy(), int(q.shape[1]), epsilons, rng)
