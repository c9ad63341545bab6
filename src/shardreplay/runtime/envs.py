"""Gymnasium environments for actors: checked, vectorised, and the matching Spec.

gymnasium is imported here only, when an environment is made.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardreplay.errors import ConfigError
from shardreplay.spec import Field, Spec


def _gym() -> Any:
    try:
        import gymnasium
    except ImportError as exc:  # pragma: no cover - gymnasium is a dependency of [train]
        raise ConfigError("environments need gymnasium: pip install 'shardreplay[train]'") from exc
    return gymnasium


def env_spaces(env_id: str) -> tuple[int, int]:
    """``(observation size, number of actions)`` of a gymnasium environment id.

    Raises:
        ConfigError: an unknown id, a non-discrete action space, or an observation that
            is not a flat vector.
    """
    gym = _gym()
    try:
        env = gym.make(env_id)
    except gym.error.Error as exc:
        raise ConfigError(f"unknown gymnasium environment {env_id!r}: {exc}") from exc
    try:
        obs, act = env.observation_space, env.action_space
    finally:
        env.close()
    if not isinstance(act, gym.spaces.Discrete):
        raise ConfigError(f"{env_id}: the action space is {act}; shardreplay train needs a Discrete one")
    if not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
        raise ConfigError(f"{env_id}: the observation space is {obs}; a flat vector Box is needed")
    return int(obs.shape[0]), int(act.n)


def transition_spec(obs_size: int) -> Spec:
    """The Spec actors write: ``obs`` float32[obs_size], ``action`` int64, ``reward`` float32."""
    return Spec({"obs": Field((obs_size,), np.float32), "action": Field((), np.int64),
                 "reward": Field((), np.float32)})


def make_vector_env(env_id: str, num_envs: int, seed: int | None) -> Any:
    """A synchronous vector env (autoreset NEXT_STEP), reset with ``seed``.

    Returns the env and its first observations.
    """
    gym = _gym()
    env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync")
    obs, _info = env.reset(seed=seed)
    return env, obs
