"""Greedy evaluation of a Q-network on fresh environments."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shardreplay.runtime.envs import EnvSource, make_vector_env


def evaluate(net: nn.Module, source: EnvSource | str, episodes: int, seed: int,
             device: torch.device | None = None) -> list[float]:
    """Returns of ``episodes`` greedy episodes, run side by side (one env each), of the
    environment ``source`` makes (a bare id: as registered); ``net`` runs on ``device``
    (None: the CPU)."""
    env, obs = make_vector_env(EnvSource(source) if isinstance(source, str) else source, episodes, seed)
    returns = np.zeros(episodes)
    done = np.zeros(episodes, bool)
    try:
        while not done.all():
            with torch.no_grad():
                actions = net(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()
            obs, reward, terminated, truncated, _info = env.step(actions)
            returns += np.where(done, 0.0, reward)
            done |= np.asarray(terminated) | np.asarray(truncated)
    finally:
        env.close()
    return returns.tolist()
