"""GymStepWriter's path for a frame-stacked observation (pixels with a frame stack).

The compiled write of :mod:`shardreplay.gym.writer` copies plain fields; a
frame-stacked field keeps one ring of frames per stream (``storage/frames.py``), which
only :meth:`ReplayBuffer.add` fills. This path therefore turns each gym step into
dm_env steps exactly as :class:`shardreplay.GymStepConverter` does (its module docstring
draws the timelines of both autoreset modes) and hands them to ``ReplayBuffer.add``.
A pixel step's cost is its frame copies (the observation held until the next step is
copied into a spare array, not a new one); the Python here is a few microseconds.

Internal: used by :class:`~shardreplay.GymStepWriter` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.gym.modes import final_obs, has_final_obs
from shardreplay.spec import StepType

if TYPE_CHECKING:
    from shardreplay.buffer.replay_buffer import ReplayBuffer

FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)


class StackedSteps:
    """Gym steps of ``buffer.num_streams`` envs into ``buffer`` through ``add``.

    Args:
        buffer: the buffer (its observation field frame-stacked).
        same_step: the env resets in the done step (``info["final_obs"]``).
        names: the observation, action and reward field names.
    """

    def __init__(self, buffer: ReplayBuffer, same_step: bool, names: tuple[str, str, str]) -> None:
        self.buffer = buffer
        self.same_step = same_step
        self.names = names
        n = buffer.num_streams
        self.num_envs = n
        self.act_shape = (n, *buffer.spec[names[1]].shape)
        self.held: np.ndarray | None = None
        self._spare = np.empty(0)  # the next held copy goes here (reset() shapes it)
        self._any_last = False  # some held step is LAST
        # Step types and discounts of the held steps: replaced (never changed in place)
        # after each write, so that the arrays handed to add are never changed later
        # (``_all_ones``: no discount is handed to add, which then takes 1.0).
        self.types = np.full(n, FIRST, np.uint8)
        self._all_mid = np.full(n, MID, np.uint8)
        self._all_ones = np.ones(n, np.float32)
        self.discounts = self._all_ones
        self._none_done = bytes(n)
        self._none = np.zeros(n, np.bool_)  # done when no env is (never changed)
        self._unit_action = self.act_shape[-1:] == (1,)  # a (1,) action may come as [n]
        self._act_lead = self.act_shape[:-1]
        self.num_steps = 0
        self.num_episodes = 0

    def reset(self, obs: Any) -> None:
        """Hold ``obs`` (checked against the spec); the next step of every stream is FIRST.

        Raises:
            SpecMismatchError: ``obs`` does not fit the observation field, one row per env.
        """
        name = self.names[0]
        field = self.buffer.spec[name]
        arr = np.array(obs, dtype=field.dtype, copy=True)
        if arr.shape != (self.num_envs, *field.shape):
            raise SpecMismatchError(f"obs must be shaped {(self.num_envs, *field.shape)}, got {arr.shape}")
        self.held = arr
        self._spare = np.empty_like(arr)
        self.types = np.full(self.num_envs, FIRST, np.uint8)
        self.discounts = self._all_ones
        self._any_last = False

    def _hold(self, held: np.ndarray, obs: Any) -> np.ndarray:
        """A copy of ``obs`` to hold until the next step (the env may reuse its array):
        into the spare array when ``obs`` is one of the stored dtype and shape (no
        allocation), else converted as ``np.array`` converts.

        Raises:
            SpecMismatchError: ``obs`` is not shaped as the held observation.
        """
        spare = self._spare
        if type(obs) is np.ndarray and obs.dtype == spare.dtype and obs.shape == spare.shape:
            np.copyto(spare, obs)
            return spare
        arr = np.array(obs, dtype=held.dtype, copy=True)
        if arr.shape != held.shape:
            raise SpecMismatchError(f"obs must be shaped {held.shape}, got {arr.shape}")
        return arr

    def step(self, action: Any, obs: Any, reward: Any, terminated: Any, truncated: Any,
             info: Mapping[str, Any] | None) -> None:
        """Write the held observation's step and hold ``obs`` (see the module docstring).

        Raises:
            ConfigError: called before :meth:`reset`.
            SpecMismatchError: as ``GymStepWriter.step``; nothing is written then.
        """
        if self.held is None:
            raise ConfigError("call reset(obs) with the env's reset observation before step()")
        n = self.num_envs
        action = np.asarray(action)
        if self._unit_action and action.shape == self._act_lead:
            action = action.reshape(self.act_shape)
        reward = np.asarray(reward, dtype=np.float32)
        term, trunc = _flags(terminated, n, "terminated"), _flags(truncated, n, "truncated")
        # Any env done: the bool arrays' bytes not all zero (ndarray.any goes through a
        # Python wrapper, most of a pixel step's Python: RESULTS-single-env.md).
        none = self._none_done
        any_done = term.tobytes() != none or trunc.tobytes() != none
        done = term | trunc if any_done else self._none
        if not self.same_step and any_done and info and has_final_obs(info):
            raise SpecMismatchError(
                "the env reset in the same step (info holds final observations) but the writer "
                "expects NEXT_STEP autoreset: build it with autoreset_mode='same_step'")
        last_obs = final_obs(info, np.flatnonzero(done)) if self.same_step and any_done else None
        next_held = self._hold(self.held, obs)
        any_last = self._any_last
        obs_name, action_name, reward_name = self.names
        step = {obs_name: self.held, action_name: action, reward_name: reward, "step_type": self.types}
        if any_last:  # at LAST (NEXT_STEP) the env ignored the action and returned reward 0: padding
            is_last = self.types == LAST
            step[action_name] = np.where(is_last.reshape((n,) + (1,) * (action.ndim - 1)), 0,
                                         action).astype(action.dtype)
            step[reward_name] = np.where(is_last, np.float32(0), reward)
        if self.discounts is not self._all_ones:  # a step without a discount has 1.0
            step["discount"] = self.discounts
        self.buffer.add(step)
        self.num_steps += n
        if last_obs is not None:
            ids = np.flatnonzero(done)
            discount = np.where(term, 0.0, 1.0).astype(np.float32)
            self.buffer.add({obs_name: last_obs, action_name: np.zeros_like(step[action_name][ids]),
                             reward_name: np.zeros(len(ids), np.float32),
                             "step_type": np.full(len(ids), LAST, np.uint8), "discount": discount[ids]},
                            stream_ids=ids)
            self.num_steps += len(ids)
            self.num_episodes += len(ids)
            self.types = np.where(done, np.uint8(FIRST), np.uint8(MID))
            self.discounts = self._all_ones
            self._any_last = False
        elif not (any_last or any_done):  # the common step: every stream goes on
            if self.types is not self._all_mid:
                self.types, self.discounts = self._all_mid, self._all_ones
        else:
            is_last = self.types == LAST
            self.num_episodes += int(done.sum())
            discount = np.where(term, 0.0, 1.0).astype(np.float32)
            self.types = np.where(done, np.uint8(LAST), np.where(is_last, np.uint8(FIRST), np.uint8(MID)))
            self.discounts = np.where(done, discount, np.float32(1.0))
            self._any_last = any_done
        # The array held so far was copied into the buffer: the next step's copy reuses it.
        self._spare, self.held = self.held, next_held


def _flags(value: Any, n: int, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype=bool)
    if arr.shape != (n,):
        raise SpecMismatchError(f"{name} must have shape ({n},), got {arr.shape}")
    return arr
