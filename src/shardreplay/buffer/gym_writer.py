"""GymStepWriter: a gymnasium vector env's steps straight into a ReplayBuffer, one call each.

It stores exactly what :class:`shardreplay.runtime.gym_steps.GymStepConverter` followed by
:meth:`ReplayBuffer.add` stores (the converter's module docstring draws the timelines of
both autoreset modes), without building a step dict per call: the first call with a new
combination of input dtypes and shapes is checked against the spec, later ones only for
their dtypes and shapes (and NaN/inf in finite fields, inside the compiled write). One
compiled call then writes the held observation, the action, reward, step type and
discount of every env and the buffer's bookkeeping.

Differences from the converter: a bad observation raises in the call that hands it over
(the converter raises one call later, when it writes it); nothing is written then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numba
import numpy as np

from shardreplay.buffer.gym_modes import env_autoreset_mode, final_obs, has_final_obs, mode_name
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.spec import Field, Spec, StepType
from shardreplay.storage.kernels import write_steps

if TYPE_CHECKING:
    from shardreplay.buffer.replay_buffer import ReplayBuffer

__all__ = ["GymStepWriter", "spec_from_env"]

FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
_NO_PRIORITIES = np.zeros((1, 1), np.float32)


def spec_from_env(env: Any, *, observation: str = "obs", action: str = "action",
                  reward: str = "reward") -> Spec:
    """The Spec of a gymnasium (vector) env's steps: its observation and action spaces
    (``single_*`` of a vector env), and a float32 reward. A Dict observation space gives
    nested fields.

    Raises:
        ConfigError: a space without a shape and dtype (Text, Graph, Sequence).
    """
    obs_space = getattr(env, "single_observation_space", None) or env.observation_space
    act_space = getattr(env, "single_action_space", None) or env.action_space
    return Spec({observation: _field_of(obs_space, observation), action: _field_of(act_space, action),
                 reward: Field((), np.float32)})


def _field_of(space: Any, name: str) -> Any:
    spaces = getattr(space, "spaces", None)
    if isinstance(spaces, Mapping):
        return {k: _field_of(v, f"{name}.{k}") for k, v in spaces.items()}
    shape, dtype = getattr(space, "shape", None), getattr(space, "dtype", None)
    if shape is None or dtype is None:
        raise ConfigError(f"space {space!r} of {name!r} has no fixed shape and dtype; build the "
                          "Spec by hand")
    return Field(tuple(shape), np.dtype(dtype))


@numba.njit(cache=True, nogil=True)
def _all_finite(values):  # pragma: no cover - compiled
    for v in values.ravel():  # noqa: SIM110 - a loop numba compiles (no generators)
        if not np.isfinite(v):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _write(step_type, episode_id, generation, priority, valid, pos, counters, held_types,
           out_slots, out_flags, obs_store, act_store, rew_store, disc_store, held_obs, held_disc,
           params, default_prio, action, obs, reward, terminated, truncated):  # pragma: no cover
    """Write every env's held step, then hold the new observation, step type and discount.

    ``params`` is ``[stream_capacity, window, same_step, finite obs, finite action,
    finite reward]``; ``default_prio[0]`` the priority of new steps. Returns
    ``(n_out, delta, n_done)``, or ``(-1 - k, 0, 0)`` with nothing changed when input
    ``k`` (0 obs, 1 action, 2 reward) of a finite field holds NaN or inf."""
    if params[3] and not _all_finite(obs):
        return -1, 0, 0
    if params[4] and not _all_finite(action):
        return -2, 0, 0
    if params[5] and not _all_finite(reward):
        return -3, 0, 0
    num_envs = held_types.shape[0]
    n_out, delta = write_steps(step_type, episode_id, generation, priority, valid, pos, counters,
                               np.arange(num_envs), held_types, _NO_PRIORITIES, False, default_prio[0],
                               params[0], params[1], out_slots, out_flags)
    same_step = params[2] != 0
    n_done = 0
    for i in range(num_envs):
        slot = out_slots[0, i]
        was_last = held_types[i, 0] == LAST
        obs_store[slot] = held_obs[i]
        if was_last:  # the env ignored this action (NEXT_STEP reset): padding
            act_store[slot] = 0
            rew_store[slot] = 0
        else:
            act_store[slot] = action[i]
            rew_store[slot] = reward[i]
        disc_store[slot] = held_disc[i]
        done = terminated[i] or truncated[i]
        n_done += done
        if same_step:
            held_types[i, 0] = FIRST if done else MID
            held_disc[i] = 1.0
        elif done:
            held_types[i, 0] = LAST
            held_disc[i] = 0.0 if terminated[i] else 1.0
        else:
            held_types[i, 0] = FIRST if was_last else MID
            held_disc[i] = 1.0
        held_obs[i] = obs[i]
    return n_out, delta, n_done


class GymStepWriter:
    """Writes a gymnasium vector env's outputs into a buffer, one stream per env.

    Usage (a one-env loop as CleanRL's)::

        rb = ReplayBuffer(spec_from_env(envs), num_streams=envs.num_envs, stream_capacity=N)
        writer = GymStepWriter.from_env(envs, rb)
        obs, _ = envs.reset(seed=0)
        writer.reset(obs)
        while ...:
            next_obs, reward, terminated, truncated, info = envs.step(action)
            writer.step(action, next_obs, reward, terminated, truncated, info)
            obs = next_obs

    Args:
        buffer: a :class:`ReplayBuffer` with one stream per env and a flat (not nested)
            observation field.
        autoreset_mode: ``"next_step"`` (gymnasium's default) or ``"same_step"``, or a
            ``gymnasium.vector.AutoresetMode``.
        observation, action, reward: the spec's field names.

    Raises:
        ConfigError: an unsupported mode, or a field name the spec lacks (or a nested
            observation: use ``GymStepConverter`` with ``ReplayBuffer.add`` for those).
    """

    def __init__(self, buffer: ReplayBuffer, *, autoreset_mode: Any = "next_step", observation: str = "obs",
                 action: str = "action", reward: str = "reward") -> None:
        for name in (observation, action, reward):
            if name not in buffer.spec:
                raise ConfigError(f"the buffer's spec has no (flat) field {name!r}; it has "
                                  f"{sorted(buffer.spec.fields)}")
        if buffer.spec[reward].shape != ():
            raise ConfigError(f"reward field {reward!r} must be a scalar, got shape "
                              f"{buffer.spec[reward].shape}")
        self.buffer = buffer
        self.autoreset_mode = mode_name(autoreset_mode)
        self.num_envs = buffer.num_streams
        self._names = (observation, action, reward)
        st = buffer.storage
        n, s = st.size, self.num_envs
        self._obs_shape = (s, *buffer.spec[observation].shape)
        self._act_shape = (s, *buffer.spec[action].shape)
        self._held_obs = np.zeros((s, *buffer.spec[observation].shape), buffer.spec[observation].dtype)
        self._held_types = np.full((s, 1), FIRST, np.uint8)
        self._held_disc = np.ones(s, np.float32)
        self._out_slots = np.empty((2, s * buffer.window), np.int64)
        self._out_flags = np.empty((2, s * buffer.window), np.bool_)
        same_step = self.autoreset_mode == "same_step"
        self._params = np.array([st.stream_capacity, st.window, same_step,
                                 *(buffer.spec[k].checks_finite for k in self._names)], np.int64)
        self._default_prio = np.ones(1, np.float64)
        self._is_uniform = buffer.sampler_name == "uniform"
        # Every array the compiled write takes, bound once: the storage changes them in
        # place (restores included), never replaces them.
        self._head = (st.step_type, st.episode_id, st.generation, st.priority, st.valid, st.pos,
                      st.counters, self._held_types, self._out_slots, self._out_flags,
                      st.fields[observation].reshape(n, *buffer.spec[observation].shape),
                      st.fields[action].reshape(n, *buffer.spec[action].shape),
                      st.fields[reward].reshape(n), st.discount, self._held_obs, self._held_disc,
                      self._params, self._default_prio)
        self._last_kind: tuple[Any, ...] = ()
        self._is_reset = False
        self.num_episodes = 0
        self.num_steps = 0

    @classmethod
    def from_env(cls, env: Any, buffer: ReplayBuffer, **kwargs: Any) -> GymStepWriter:
        """A writer for ``env``'s autoreset mode (``autoreset_mode=`` overrides it).

        Raises:
            ConfigError: as the constructor; the env does not say its mode (gymnasium >= 1.0);
                its ``num_envs`` differs from the buffer's ``num_streams``.
        """
        if int(env.num_envs) != buffer.num_streams:
            raise ConfigError(f"the env has {env.num_envs} envs but the buffer {buffer.num_streams} "
                              "streams: make the buffer with num_streams=env.num_envs")
        if "autoreset_mode" not in kwargs:
            kwargs["autoreset_mode"] = env_autoreset_mode(env)
        return cls(buffer, **kwargs)

    def reset(self, obs: Any) -> None:
        """Start every stream anew at ``obs`` (from ``env.reset()``): the next step is FIRST.

        Raises:
            SpecMismatchError: ``obs`` does not fit the spec's observation field (one row per env).
        """
        name = self._names[0]
        arr = self.buffer.spec.validate(self._probe(obs, None, None), (self.num_envs,))[name]
        self._held_obs[...] = arr
        self._held_types[:] = FIRST
        self._held_disc[:] = 1.0
        self._is_reset = True

    def step(self, action: Any, obs: Any, reward: Any, terminated: Any, truncated: Any,
             info: Mapping[str, Any] | None = None) -> None:
        """Record one vector-env step (what ``env.step(action)`` returned) in the buffer.

        Raises:
            ConfigError: called before :meth:`reset`.
            SpecMismatchError: an input that does not fit the spec (wrong rows, shape,
                unsafe dtype, NaN/inf in a finite field), or a NEXT_STEP writer handed
                final observations (a SAME_STEP env), or a SAME_STEP env's done without
                ``info["final_obs"]``. Nothing is written then.
        """
        kind = self._last_kind
        if (kind and type(obs) is np.ndarray and type(action) is np.ndarray and type(reward) is np.ndarray
                and type(terminated) is np.ndarray and type(truncated) is np.ndarray
                and obs.dtype is kind[0] and action.dtype is kind[1] and reward.dtype is kind[2]
                and terminated.dtype is kind[3] and truncated.dtype is kind[3]
                and obs.shape == kind[4] and action.shape == kind[5] and reward.shape == kind[6]
                and terminated.shape == kind[6] and truncated.shape == kind[6]):
            self._write_all(action, obs, reward, terminated, truncated, info)
            return
        self._write_all(*self._accept(action, obs, reward, terminated, truncated), info)

    def _write_all(self, action: np.ndarray, obs: np.ndarray, reward: np.ndarray, terminated: np.ndarray,
                   truncated: np.ndarray, info: Mapping[str, Any] | None) -> None:
        if not self._is_reset:
            raise ConfigError("call reset(obs) with the env's reset observation before step()")
        done_ids = None
        if info and has_final_obs(info) and self.autoreset_mode == "next_step" \
                and (terminated.any() or truncated.any()):
            raise SpecMismatchError(
                "the env reset in the same step (info holds final observations) but the writer "
                "expects NEXT_STEP autoreset: build it with autoreset_mode='same_step'")
        if self._params[2] and (terminated.any() or truncated.any()):
            done_ids = np.flatnonzero(terminated | truncated)
            last_obs = final_obs(info, done_ids)  # raises before anything is written
        if not self._is_uniform:
            self._default_prio[0] = self.buffer.max_priority()
        n_out, delta, n_done = _write(*self._head, action, obs, reward, terminated, truncated)
        if n_out < 0:
            field = self._names[-1 - n_out]
            raise SpecMismatchError(f"field {field!r} holds NaN or inf; the spec's Field(finite=True) "
                                    "rejects them")
        self.buffer.storage.num_valid += delta
        self.num_steps += self.num_envs
        self.num_episodes += n_done
        if not self._is_uniform:
            self.buffer._sampler.on_write(self._out_slots[1, :n_out], self._out_flags[0, :n_out],
                                          self._out_flags[1, :n_out])
        if done_ids is not None:
            self._write_last(done_ids, last_obs, terminated, action)

    def _write_last(self, ids: np.ndarray, last_obs: Any, terminated: np.ndarray, action: np.ndarray) -> None:
        """SAME_STEP: the LAST steps of the envs that ended (action, reward: padding)."""
        obs_name, action_name, reward_name = self._names
        step = {obs_name: last_obs, action_name: np.zeros_like(action[ids]),
                reward_name: np.zeros(len(ids), np.float32),
                "step_type": np.full(len(ids), LAST, np.uint8),
                "discount": np.where(terminated[ids], 0.0, 1.0).astype(np.float32)}
        self.buffer.add(step, stream_ids=ids)
        self.num_steps += len(ids)

    def _probe(self, obs: Any, action: Any, reward: Any) -> dict[str, Any]:
        """A step dict for the spec's full check (missing parts as zeros of the stored dtype)."""
        spec, s = self.buffer.spec, self.num_envs
        obs_name, action_name, reward_name = self._names
        step = {name: np.zeros((s, *spec[name].shape), spec[name].dtype) for name in spec.fields}
        step[obs_name] = obs
        if action is not None:
            step[action_name] = action
        if reward is not None:
            step[reward_name] = reward
        step["step_type"] = np.zeros(s, np.uint8)
        return step

    def _accept(self, action: Any, obs: Any, reward: Any, terminated: Any,
                truncated: Any) -> tuple[np.ndarray, ...]:
        """Check inputs of a new kind against the spec once; arrays the fast path takes."""
        action, obs, reward = np.asarray(action), np.asarray(obs), np.asarray(reward)
        flags = []
        for name, value in (("terminated", terminated), ("truncated", truncated)):
            arr = np.asarray(value, dtype=bool)
            if arr.shape != (self.num_envs,):
                raise SpecMismatchError(f"{name} must have shape ({self.num_envs},), got {arr.shape}")
            flags.append(arr)
        self.buffer.spec.validate(self._probe(obs, action, reward), (self.num_envs,))
        if obs.shape != self._obs_shape or action.shape != self._act_shape:
            raise SpecMismatchError(f"obs {obs.shape} and action {action.shape} must be shaped "
                                    f"{self._obs_shape} and {self._act_shape}")
        spec = self.buffer.spec
        # An integer narrowing (int64 -> uint8) is checked for its values on every call.
        if all(np.can_cast(arr.dtype, spec[name].dtype, casting="same_kind")
               and not (arr.dtype.kind in "iub" and not np.can_cast(arr.dtype, spec[name].dtype, "safe"))
               for name, arr in zip(self._names, (obs, action, reward), strict=True)):
            self._last_kind = (obs.dtype, action.dtype, reward.dtype, flags[0].dtype, obs.shape,
                               action.shape, reward.shape)
        return action, obs, reward, flags[0], flags[1]

