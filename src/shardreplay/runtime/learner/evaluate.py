"""Greedy evaluation of a Q-network on fresh environments."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shardreplay.runtime.envs import make_vector_env


def evaluate(net: nn.Module, env_id: str, episodes: int, seed: int) -> list[float]:
    """Returns of ``episodes`` greedy episodes, run side by side (one env each)."""
    env, obs = make_vector_env(env_id, episodes, seed)
    returns = np.zeros(episodes)
    done = np.zeros(episodes, bool)
    try:
        while not done.all():
            with torch.no_grad():
                actions = net(torch.as_tensor(obs, dtype=torch.float32)).argmax(dim=1).numpy()
            obs, reward, terminated, truncated, _info = env.step(actions)
            returns += np.where(done, 0.0, reward)
            done |= np.asarray(terminated) | np.asarray(truncated)
    finally:
        env.close()
    return returns.tolist()
