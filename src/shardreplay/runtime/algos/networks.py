"""Q-networks for ``shardreplay train``, chosen by the observation's shape
(:func:`choose_network`): an MLP for vectors, the Nature-DQN network for images of 36x36
or more, the MinAtar network for smaller ones. Each takes observations ``[B, *obs_shape]``
(channels first) of any dtype and returns Q-values ``[B, num_actions]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardreplay.runtime.algos import choose_network
from shardreplay.runtime.settings import NETWORKS

__all__ = ["NETWORKS", "MinAtarQNetwork", "NatureQNetwork", "QNetwork", "choose_network", "make_q_network",
           "mlp"]


def mlp(width: int, hidden: Sequence[int]) -> tuple[nn.Sequential, int]:
    """Linear + ReLU layers of ``hidden`` sizes from ``width`` inputs, and their output width."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers), width


class QNetwork(nn.Module):
    """An MLP from a flat observation to one Q-value per action (``hidden``: its hidden
    layers' sizes). Its twin without torch, :class:`~shardreplay.runtime.algos.dqn.NumpyQNetwork`,
    acts from the same weights (``net.<2i>.weight`` / ``net.<2i>.bias``)."""

    def __init__(self, obs_size: int, num_actions: int, hidden: tuple[int, ...] = (128, 128)) -> None:
        super().__init__()
        trunk, width = mlp(obs_size, hidden)
        self.net = nn.Sequential(*trunk, nn.Linear(width, num_actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values ``[B, num_actions]`` for observations ``[B, obs_size]``."""
        return self.net(obs.to(torch.float32))


class NatureQNetwork(nn.Module):
    """The Nature-DQN network on ``[B, C, H, W]`` uint8 images (H, W >= 36), the pixels
    multiplied by ``scale`` first (1/255 for 8-bit frames)."""

    def __init__(self, obs_shape: Sequence[int], num_actions: int, scale: float = 1 / 255) -> None:
        super().__init__()
        c, h, w = obs_shape
        self.scale = scale
        self.conv = nn.Sequential(nn.Conv2d(c, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2),
                                  nn.ReLU(), nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            flat = int(self.conv(torch.zeros(1, c, h, w)).shape[1])
        self.head = nn.Sequential(nn.Linear(flat, 512), nn.ReLU(), nn.Linear(512, num_actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values ``[B, num_actions]``."""
        return self.head(self.conv(obs.to(torch.float32) * self.scale))


class MinAtarQNetwork(nn.Module):
    """The MinAtar paper's network (Young & Tian 2019) on ``[B, C, H, W]`` 0/1 images."""

    def __init__(self, obs_shape: Sequence[int], num_actions: int) -> None:
        super().__init__()
        c, h, w = obs_shape
        self.conv = nn.Sequential(nn.Conv2d(c, 16, 3, stride=1), nn.ReLU(), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(16 * (h - 2) * (w - 2), 128), nn.ReLU(),
                                  nn.Linear(128, num_actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values ``[B, num_actions]``."""
        return self.head(self.conv(obs.to(torch.float32)))


def make_q_network(obs_shape: Sequence[int], num_actions: int, network: str = "auto",
                   hidden: Sequence[int] = (256, 256)) -> nn.Module:
    """The Q-network :func:`choose_network` picks (``hidden``: the MLP's layer sizes).

    Raises:
        ConfigError: as :func:`choose_network`.
    """
    kind = choose_network(obs_shape, network)
    if kind == "mlp":
        return QNetwork(int(obs_shape[0]), num_actions, tuple(hidden))
    if kind == "nature":
        return NatureQNetwork(obs_shape, num_actions)
    return MinAtarQNetwork(obs_shape, num_actions)
