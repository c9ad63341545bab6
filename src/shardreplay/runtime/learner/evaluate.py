"""Greedy evaluation of a policy on fresh environments."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from shardreplay.runtime.envs import EnvSource, make_vector_env


def evaluate(policy: nn.Module | Callable[[torch.Tensor], np.ndarray], source: EnvSource | str, episodes: int,
             seed: int, device: torch.device | None = None) -> list[float]:
    """Returns of ``episodes`` episodes, run side by side (one env each), of the environment
    ``source`` makes (a bare id: as registered). ``policy``: a function from observations
    to deterministic actions (an algorithm's ``greedy``), or a Q-network (argmax), on
    ``device`` (None: the CPU)."""
    act = (lambda obs: policy(obs).argmax(dim=1).cpu().numpy()) if isinstance(policy, nn.Module) else policy
    env, obs = make_vector_env(EnvSource(source) if isinstance(source, str) else source, episodes, seed)
    returns = np.zeros(episodes)
    done = np.zeros(episodes, bool)
    try:
        while not done.all():
            with torch.no_grad():
                actions = act(torch.as_tensor(obs, device=device))
            obs, reward, terminated, truncated, _info = env.step(actions)
            returns += np.where(done, 0.0, reward)
            done |= np.asarray(terminated) | np.asarray(truncated)
    finally:
        env.close()
    return returns.tolist()
