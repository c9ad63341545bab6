"""The Q-network and the per-stream exploration rates (Ape-X)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class QNetwork(nn.Module):
    """An MLP from a flat observation to one Q-value per action.

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


def apex_epsilons(num_streams: int, first: int, total: int, base: float = 0.4,
                  exponent: float = 7.0) -> np.ndarray:
    """Ape-X exploration rates ``base^(1 + exponent * i / (total - 1))`` for global
    streams ``first .. first + num_streams - 1`` of ``total`` (one stream: ``base``)."""
    i = np.arange(first, first + num_streams, dtype=np.float64)
    frac = i / (total - 1) if total > 1 else np.zeros_like(i)
    return base ** (1.0 + exponent * frac)


def epsilon_greedy(q: torch.Tensor, epsilons: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Greedy actions, replaced by uniform random ones with probability ``epsilons[i]``."""
    actions = q.argmax(dim=1).cpu().numpy()
    explore = rng.random(actions.shape[0]) < epsilons
    actions[explore] = rng.integers(0, q.shape[1], size=int(explore.sum()))
    return actions
