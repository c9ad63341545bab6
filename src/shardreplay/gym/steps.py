"""Turn a gymnasium vector env's steps into shardreplay steps (dm_env step types): one
step per stream per vector step, each stream's latest observation held until its action
was taken. How gymnasium's ``(obs, reward, terminated, truncated)`` map onto stored steps
in each autoreset mode, with a timeline: docs/semantics.md, "Gymnasium autoreset".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.gym.modes import done_flags, env_autoreset_mode, final_obs, has_final_obs, mode_name
from shardreplay.spec.fields import StepType

__all__ = ["GymStepConverter", "StepWrite"]

# One write for ReplayBuffer.add: the step (nested dict of arrays [S', ...]) and the
# stream ids it goes to (None: all streams, in order).
StepWrite = tuple[dict[str, Any], np.ndarray | None]

class GymStepConverter:
    """Converts a gymnasium vector env's outputs into shardreplay steps, one stream per env.

    Usage::

        conv = GymStepConverter.from_env(envs)
        obs, _ = envs.reset(seed=0)
        conv.reset(obs)
        while ...:
            action = policy(obs)
            obs, reward, terminated, truncated, info = envs.step(action)
            for step, stream_ids in conv.step(action, obs, reward, terminated, truncated, info):
                buffer.add(step, stream_ids=stream_ids)

    Args:
        num_envs: number of envs in the vector env (= streams).
        autoreset_mode: the env's autoreset mode: a ``gymnasium.vector.AutoresetMode`` or
            ``"next_step"`` / ``"same_step"``.
        observation: step field name for observations (a gymnasium Dict observation
            becomes nested fields under it).
        action: step field name for actions.
        reward: step field name for rewards.

    Raises:
        ConfigError: ``num_envs < 1``, an unsupported autoreset mode, or empty names.
    """

    def __init__(self, num_envs: int, *, autoreset_mode: Any = "next_step", observation: str = "obs",
                 action: str = "action", reward: str = "reward") -> None:
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ConfigError(f"num_envs must be an int >= 1, got {num_envs!r}")
        if not all(isinstance(n, str) and n for n in (observation, action, reward)):
            raise ConfigError("field names must be non-empty strings")
        self.num_envs = num_envs
        self.autoreset_mode = mode_name(autoreset_mode)
        self._names = (observation, action, reward)
        self._obs: Any = None
        self._types = np.full(num_envs, StepType.FIRST, np.uint8)
        self._discounts = np.ones(num_envs, np.float32)
        self.num_episodes = 0
        self.num_steps = 0

    @classmethod
    def from_env(cls, env: Any, **kwargs: Any) -> GymStepConverter:
        """A converter for a gymnasium vector env (reads ``num_envs`` and its autoreset mode).

        Pass ``autoreset_mode=`` to override what the env says (e.g. a vector env of another
        library that has no ``metadata["autoreset_mode"]``).

        Raises:
            ConfigError: as the constructor, or the env does not say its autoreset mode and
                gymnasium >= 1.0 is installed (so the mode cannot be known).
        """
        if "autoreset_mode" not in kwargs:
            kwargs["autoreset_mode"] = env_autoreset_mode(env)
        return cls(int(env.num_envs), **kwargs)

    @property
    def next_step_types(self) -> np.ndarray:
        """The step type (``StepType``) each stream's next written step will have: FIRST
        where the observation just returned starts an episode (where a recurrent policy
        starts from its initial state). A copy."""
        return self._types.copy()

    def reset(self, obs: Any) -> None:
        """Start every stream anew at ``obs`` (from ``env.reset()``): the next step is FIRST.

        Raises:
            SpecMismatchError: ``obs`` does not have ``num_envs`` rows.
        """
        self._obs = _copy(obs, self.num_envs, "obs")
        self._types[:] = StepType.FIRST
        self._discounts[:] = 1.0

    def step(self, action: Any, obs: Any, reward: Any, terminated: Any, truncated: Any,
             info: Mapping[str, Any] | None = None) -> list[StepWrite]:
        """Record one vector-env step and return the completed shardreplay steps.

        Args:
            action: the actions passed to ``env.step`` ``[num_envs, ...]``.
            obs, reward, terminated, truncated, info: what ``env.step`` returned.

        Returns:
            Writes for ``ReplayBuffer.add(step, stream_ids=ids)``, in order: first one step
            of every stream (``ids`` None), then, in ``SAME_STEP`` mode, the LAST steps of
            the streams that ended (``ids`` those streams).

        Raises:
            ConfigError: called before :meth:`reset`.
            SpecMismatchError: an input without ``num_envs`` rows, or ``SAME_STEP`` mode
                with a done env that has no ``info["final_obs"]``.
        """
        if self._obs is None:
            raise ConfigError("call reset(obs) with the env's reset observation before step()")
        n = self.num_envs
        action = np.asarray(action)
        reward = np.asarray(reward, dtype=np.float32)
        done_term = done_flags(terminated, n, "terminated")
        done_trunc = done_flags(truncated, n, "truncated")
        for name, arr in (("action", action), ("reward", reward)):
            if arr.shape[:1] != (n,):
                raise SpecMismatchError(f"{name} must have {n} rows (one per env), got {arr.shape}")
        is_last = self._types == StepType.LAST
        # At LAST the env (NEXT_STEP) ignored the action and returned reward 0: padding.
        padded_action = np.where(is_last.reshape((n,) + (1,) * (action.ndim - 1)), 0, action)
        writes = [self._write(self._obs, padded_action.astype(action.dtype),
                              np.where(is_last, 0.0, reward).astype(np.float32),
                              self._types.copy(), self._discounts.copy(), None)]
        self.num_steps += n
        done = done_term | done_trunc
        if self.autoreset_mode == "next_step" and done.any() and has_final_obs(info):
            raise SpecMismatchError(
                "the env reset in the same step (info holds final observations) but the converter "
                "expects NEXT_STEP autoreset: build it with autoreset_mode='same_step' (gymnasium 0.x "
                "vector envs always reset in the same step)")
        discount = np.where(done_term, 0.0, 1.0).astype(np.float32)
        new_obs = _copy(obs, n, "obs")
        if self.autoreset_mode == "same_step" and done.any():
            ids = np.flatnonzero(done)
            final = final_obs(info, ids)
            writes.append(self._write(final, np.zeros_like(action[ids]), np.zeros(len(ids), np.float32),
                                      np.full(len(ids), StepType.LAST, np.uint8), discount[ids], ids))
            self.num_steps += len(ids)
            self.num_episodes += len(ids)
            self._types = np.where(done, StepType.FIRST, StepType.MID).astype(np.uint8)
            self._discounts[:] = 1.0
        else:
            self.num_episodes += int(done.sum())
            self._types = np.select([done, is_last], [StepType.LAST, StepType.FIRST],
                                    StepType.MID).astype(np.uint8)
            self._discounts = np.where(done, discount, 1.0).astype(np.float32)
        self._obs = new_obs
        return writes

    def _write(self, obs: Any, action: np.ndarray, reward: np.ndarray, types: np.ndarray,
               discounts: np.ndarray, ids: np.ndarray | None) -> StepWrite:
        obs_name, action_name, reward_name = self._names
        step = {obs_name: obs, action_name: action, reward_name: reward,
                "step_type": types, "discount": discounts}
        return step, ids


def _copy(obs: Any, n: int, name: str) -> Any:
    """A private copy (vector envs may reuse their output buffers), checked for n rows."""
    if isinstance(obs, Mapping):
        return {k: _copy(v, n, f"{name}.{k}") for k, v in obs.items()}
    arr = np.array(obs, copy=True)
    if arr.shape[:1] != (n,):
        raise SpecMismatchError(f"{name} must have {n} rows (one per env), got shape {arr.shape}")
    return arr
