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
from shardreplay.spec.coerce import to_numpy
from shardreplay.spec.fields import StepType

__all__ = ["GymStepConverter", "StepWrite"]

# One write for ReplayBuffer.add: the step (nested dict of arrays [S', ...]) and the
# stream ids it goes to (None: all streams, in order).
StepWrite = tuple[dict[str, Any], np.ndarray | None]
FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
_BOOL = np.dtype(np.bool_)
PATTERNS = 4096  # episode-boundary patterns a converter remembers (see Autoreset._boundary)


class Autoreset:
    """The held step of each stream of a vector env, and how gymnasium's outputs complete
    them in its autoreset mode (docs/semantics.md, "Gymnasium autoreset"): what
    :class:`GymStepConverter` and :class:`~shardreplay.gym.writer.GymStepWriter` share."""

    def __init__(self, num_envs: int, autoreset_mode: Any, names: tuple[str, str, str]) -> None:
        self.num_envs = num_envs
        self.autoreset_mode = mode_name(autoreset_mode)
        self._same_step = self.autoreset_mode == "same_step"
        self._names = names
        self._obs: Any = None
        self._spare: Any = None  # the observation held before: the next _hold may reuse it
        self._rows = (num_envs,)
        # Step types and discounts of the held steps: replaced (never changed in place)
        # after each step, so that the arrays handed to a write are never changed later.
        self._types = np.full(num_envs, FIRST, np.uint8)
        self._all_mid = np.full(num_envs, MID, np.uint8)
        self._all_ones = np.ones(num_envs, np.float32)
        self._discounts = self._all_ones
        self._any_last = False  # some held step is LAST
        self._none_done, self._all_last = bytes(num_envs), bytes([LAST]) * num_envs
        # The held steps' types and discounts after a step at an episode boundary, by the
        # bytes of what decides them (few patterns recur: one env has six), so that such a
        # step costs a dict lookup, not six numpy calls (most of such a step's cost).
        self._after: dict[tuple[bytes, bytes, bytes], tuple[np.ndarray, np.ndarray, int]] = {}
        self.num_episodes = 0
        self.num_steps = 0

    def reset(self, obs: Any) -> None:
        """Start every stream anew at ``obs`` (from ``env.reset()``): the next step is FIRST.

        Raises:
            SpecMismatchError: ``obs`` does not have ``num_envs`` rows (a writer's: does not
                fit the spec's observation field).
        """
        self._obs = self._hold(obs)
        self._types = np.full(self.num_envs, FIRST, np.uint8)
        self._discounts, self._any_last = self._all_ones, False

    def _write(self, step: dict[str, Any], ids: np.ndarray | None) -> None:
        raise NotImplementedError  # the converter hands the step out, the writer writes it

    def _hold(self, obs: Any) -> Any:
        """A private copy of ``obs`` (vector envs may reuse their output buffers), checked for
        ``num_envs`` rows."""
        return _copy(obs, self.num_envs, "obs")

    def _advance(self, action: Any, obs: Any, reward: Any, terminated: Any, truncated: Any,
                 info: Mapping[str, Any] | None) -> None:
        """:meth:`step`'s steps handed to ``_write(step, ids)`` in order, then the held steps
        moved on (nothing changed when a check or the first write raises)."""
        held = self._obs
        if held is None:
            raise ConfigError("call reset(obs) with the env's reset observation before step()")
        n = self.num_envs
        action = to_numpy(action)  # a list, a tensor as numpy (its dtype: converted by the write)
        # ``dtype is _BOOL``: comparing with ``np.bool_`` builds a dtype in every call.
        term = terminated if type(terminated) is np.ndarray and terminated.dtype is _BOOL \
            and terminated.shape == self._rows else done_flags(terminated, n, "terminated")
        trunc = truncated if type(truncated) is np.ndarray and truncated.dtype is _BOOL \
            and truncated.shape == self._rows else done_flags(truncated, n, "truncated")
        # Any env done: the bool arrays' bytes not all zero (ndarray.any goes through a
        # Python wrapper, most of a step's Python: RESULTS-single-env.md).
        any_done = term.tobytes() != self._none_done or trunc.tobytes() != self._none_done
        if not self._same_step and any_done and info and has_final_obs(info):
            raise SpecMismatchError(
                "the env reset in the same step (info holds final observations) but NEXT_STEP "
                "autoreset was given: use autoreset_mode='same_step' (gymnasium 0.x vector envs always "
                "reset in the same step)")
        done = term | trunc if self._same_step and any_done else None
        last_obs = None if done is None else final_obs(info, np.flatnonzero(done))
        next_held = self._hold(obs)
        any_last = self._any_last
        obs_name, action_name, reward_name = self._names
        step = {obs_name: held, action_name: action, reward_name: reward, "step_type": self._types}
        if any_last and self._types.tobytes() == self._all_last:  # padding, see below
            # Zeros of the given kinds: a write in the kinds of the other steps (one compiled form).
            zeros = np.zeros(n, reward.dtype if type(reward) is np.ndarray else np.float32)
            step[action_name], step[reward_name] = np.zeros_like(action), zeros
        elif any_last:  # at LAST (NEXT_STEP) the env ignored the action and returned reward 0: padding
            is_last = self._types == LAST
            step[action_name] = np.where(is_last.reshape((n,) + (1,) * (action.ndim - 1)), 0,
                                         action).astype(action.dtype)
            step[reward_name] = np.where(is_last, np.float32(0), reward)
        if self._discounts is not self._all_ones:  # a step without a discount has 1.0
            step["discount"] = self._discounts
        self._write(step, None)
        self.num_steps += n
        if done is not None:
            ids = np.flatnonzero(done)
            k = len(ids)
            self._write({obs_name: last_obs, action_name: np.zeros_like(step[action_name][ids]),
                   reward_name: np.zeros(k, np.float32), "step_type": np.full(k, LAST, np.uint8),
                   "discount": np.where(term[ids], np.float32(0), np.float32(1))}, ids)
            self.num_steps += k
            self.num_episodes += k
            self._types = np.where(done, np.uint8(FIRST), np.uint8(MID))
            self._discounts, self._any_last = self._all_ones, False
        elif not (any_last or any_done):  # the common step: every stream goes on
            self._types, self._discounts = self._all_mid, self._all_ones
        else:
            self._boundary(term, trunc)
            self._any_last = any_done
        self._spare, self._obs = held, next_held

    def _boundary(self, term: np.ndarray, trunc: np.ndarray) -> None:
        """Set the held steps' types and discounts after a step of the held ``_types`` whose
        envs were done as ``term`` / ``trunc``, and count the episodes it ended (NEXT_STEP)."""
        key = (self._types.tobytes(), term.tobytes(), trunc.tobytes())
        after = self._after.get(key)
        if after is None:
            if len(self._after) >= PATTERNS:  # many envs: most patterns never recur
                self._after.clear()
            done = term | trunc
            later = np.where(self._types == LAST, np.uint8(FIRST), np.uint8(MID))
            discounts = np.where(term, np.float32(0), np.float32(1)) if term.any() else self._all_ones
            after = self._after[key] = (np.where(done, np.uint8(LAST), later), discounts, int(done.sum()))
        self._types, self._discounts, ended = after
        self.num_episodes += ended


class GymStepConverter(Autoreset):
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
        super().__init__(num_envs, autoreset_mode, (observation, action, reward))

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
        action, reward = np.array(to_numpy(action)), np.array(reward, dtype=np.float32)
        for name, arr in (("action", action), ("reward", reward)):
            if arr.shape[:1] != self._rows:
                raise SpecMismatchError(f"{name} must have {self.num_envs} rows (one per env), got "
                                        f"{arr.shape}")
        self._writes: list[StepWrite] = []
        self._advance(action, obs, reward, terminated, truncated, info)
        return self._writes

    def _write(self, step: dict[str, Any], ids: np.ndarray | None) -> None:
        discount = step.get("discount", self._all_ones)  # copies: later steps share these two arrays
        step["step_type"], step["discount"] = step["step_type"].copy(), discount.copy()
        self._writes.append((step, ids))


def _copy(obs: Any, n: int, name: str) -> Any:
    """A private copy (vector envs may reuse their output buffers), checked for n rows."""
    if isinstance(obs, Mapping):
        return {k: _copy(v, n, f"{name}.{k}") for k, v in obs.items()}
    arr = np.array(obs, copy=True)
    if arr.shape[:1] != (n,):
        raise SpecMismatchError(f"{name} must have {n} rows (one per env), got shape {arr.shape}")
    return arr
