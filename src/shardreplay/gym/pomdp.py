"""Partially observable CartPole: the velocities hidden, for recurrent agents (R2D2).

CartPole's observation is ``[x, x_dot, theta, theta_dot]``. Keeping only ``[x, theta]``
makes it a POMDP: one observation says where the pole is, not where it is going, so a
policy must remember earlier observations (the classic test of DRQN and R2D2).

``gymnasium`` is imported when an env is made, never on import (``shardreplay.gym`` is
numpy only). ``make_masked_cartpole()`` builds one env; ``register_masked_cartpole()``
registers it as ``shardreplay/MaskedCartPole-v1`` for ``gymnasium.make`` and
``gymnasium.make_vec``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardreplay.errors import ConfigError

__all__ = ["ENV_ID", "KEPT", "make_masked_cartpole", "mask_velocities", "register_masked_cartpole"]

ENV_ID = "shardreplay/MaskedCartPole-v1"
KEPT = (0, 2)  # cart position and pole angle; the two velocities (1, 3) are hidden


def mask_velocities(env: Any) -> Any:
    """``env`` (a CartPole, possibly wrapped) with observations ``[x, theta]`` only.

    Raises:
        ConfigError: the env's observation space is not CartPole's 4-vector box.
    """
    import gymnasium as gym

    space = env.observation_space
    if not isinstance(space, gym.spaces.Box) or space.shape != (4,):
        raise ConfigError(f"mask_velocities takes CartPole (a Box of shape (4,)), got {space}")
    kept = np.array(KEPT)
    box = gym.spaces.Box(space.low[kept], space.high[kept], dtype=np.float32)
    return gym.wrappers.TransformObservation(env, lambda obs: np.asarray(obs, np.float32)[kept], box)


def make_masked_cartpole(**kwargs: Any) -> Any:
    """A ``CartPole-v1`` (500 steps, keyword arguments as ``gymnasium.make``'s) whose
    observations hide both velocities."""
    import gymnasium as gym

    return mask_velocities(gym.make("CartPole-v1", **kwargs))


def register_masked_cartpole() -> str:
    """Register :data:`ENV_ID` with gymnasium (idempotent); returns the id."""
    import gymnasium as gym

    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point=make_masked_cartpole, max_episode_steps=None)
    return ENV_ID
