"""GymStepWriter: a gymnasium vector env's steps straight into a ReplayBuffer, one call each.

It stores exactly what :class:`shardreplay.gym.steps.GymStepConverter` followed by
:meth:`ReplayBuffer.add` stores (the converter's module docstring draws the timelines of
both autoreset modes), without building a step dict per call: the first call with a new
kind of inputs (types, dtypes, dimensions) is checked against the spec in full; later
calls of that kind go straight to one compiled call, which checks shapes and NaN/inf in
finite fields and then writes the held observation, the action, reward, step type and
discount of every env and the buffer's bookkeeping. Inputs whose values need a check on
every call (an int64 action into a uint8 field) take the full check every time.

Differences from the converter: a bad observation raises in the call that hands it over
(the converter raises one call later, when it writes it); nothing is written then.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardreplay.buffer.shard import shard_of_buffer
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.gym.modes import env_autoreset_mode, final_obs, has_final_obs, mode_name
from shardreplay.gym.stacked import StackedSteps
from shardreplay.kernels import gym_step as gk
from shardreplay.kernels.gym_step import allow_inputs, compiled_gym_write
from shardreplay.spec import Field, Spec, StepType

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.distributed.sharded_buffer import ShardedReplayBuffer

__all__ = ["GymStepWriter", "spec_from_env"]

FIRST, MID, LAST = int(StepType.FIRST), int(StepType.MID), int(StepType.LAST)
# What the compiled write returns at most for an input it refuses (kernels/gym_step.py).
_REFUSED = gk.FAILED - 1
# (action, obs, reward, terminated, truncated) as the compiled write takes them.
_Inputs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def spec_from_env(env: Any, *, observation: str = "obs", action: str = "action",
                  reward: str = "reward", frame_stack: bool = False) -> Spec:
    """The Spec of a gymnasium (vector) env's steps: its observation and action spaces
    (``single_*`` of a vector env), and a float32 reward. A Dict observation space gives
    nested fields.

    ``frame_stack=True`` declares the observation a stack of frames on its first axis,
    oldest first (a pixel env wrapped in gymnasium's ``FrameStackObservation``, or
    ``AtariPreprocessing`` + a 4-frame stack: ``(4, 84, 84)`` uint8), so each frame is
    stored once (``Field(..., frame_stack=True)``); :class:`GymStepWriter` writes it.

    Raises:
        ConfigError: a space without a shape and dtype (Text, Graph, Sequence), or
            ``frame_stack`` for an observation that is not one array of at least 2 axes.
    """
    obs_space = getattr(env, "single_observation_space", None)
    act_space = getattr(env, "single_action_space", None)
    if obs_space is None or act_space is None:  # a single env, not a vector env
        obs_space, act_space = env.observation_space, env.action_space
    obs_field = _field_of(obs_space, observation)
    if frame_stack:
        if not isinstance(obs_field, Field) or len(obs_field.shape) < 2:
            raise ConfigError(f"frame_stack=True needs an observation of one array shaped (stack, "
                              f"*frame), got {obs_space!r}; build the Spec by hand otherwise")
        obs_field = Field(obs_field.shape, obs_field.dtype, frame_stack=True)
    return Spec({observation: obs_field, action: _field_of(act_space, action),
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


def _local_buffer(buffer: Any) -> tuple[ReplayBuffer, AbstractContextManager[Any] | None]:
    """The ReplayBuffer a writer fills, and the lock its writes hold: a sharded buffer's
    local shard, with its ``write_lock`` when a background exchange reads the shard
    (``pipeline=True``); a plain buffer itself, with none."""
    module = sys.modules.get("shardreplay.distributed.sharded_buffer")
    # Not imported: then ``buffer`` cannot be a sharded one (nothing to import for a plain buffer).
    if module is None or not isinstance(buffer, module.ShardedReplayBuffer):
        return buffer, None
    return buffer.local, (buffer.write_lock if buffer.pipeline else None)


class GymStepWriter:
    """Writes a gymnasium vector env's outputs into a buffer, one stream per env.

    Usage (a one-env loop as CleanRL's); :meth:`from_env` is the constructor to call, as
    it reads the env's autoreset mode::

        rb = ReplayBuffer(spec_from_env(envs), num_streams=envs.num_envs, stream_capacity=N)
        rb_writer = GymStepWriter.from_env(envs, rb)
        obs, _ = envs.reset(seed=0)
        rb_writer.reset(obs)
        while ...:
            next_obs, reward, terminated, truncated, info = envs.step(action)
            rb_writer.step(action, next_obs, reward, terminated, truncated, info)
            obs = next_obs

    On a :class:`~shardreplay.ShardedReplayBuffer` each rank makes its own writer over its
    own envs (``num_streams`` of its local shard = its ``envs.num_envs``) and writes into
    its shard (holding the buffer's ``write_lock``, so a ``pipeline=True`` exchange never
    reads a step half written); sampling stays global.

    Args:
        buffer: a :class:`ReplayBuffer` (or :class:`~shardreplay.ShardedReplayBuffer`)
            with one stream per env and a flat (not nested) observation field.
        autoreset_mode: the env's mode, required: ``"next_step"`` (gymnasium's default)
            or ``"same_step"``, or a ``gymnasium.vector.AutoresetMode``. A wrong mode
            would store wrong steps at episode ends, so it is never assumed.
        observation, action, reward: the spec's field names.

    Raises:
        ConfigError: no or an unsupported mode (``GymStepWriter.from_env(envs, buffer)``
            reads it), a field name the spec lacks, a spec with other fields or a
            frame-stacked action or reward (or a nested observation: use
            ``GymStepConverter`` with ``ReplayBuffer.add`` for those).

    A frame-stacked observation (``spec_from_env(envs, frame_stack=True)``) is taken:
    its steps go through ``ReplayBuffer.add``, which stores each frame once.
    """

    def __init__(self, buffer: ReplayBuffer | ShardedReplayBuffer, *, autoreset_mode: Any = None,
                 observation: str = "obs", action: str = "action", reward: str = "reward") -> None:
        if autoreset_mode is None:
            raise ConfigError("GymStepWriter needs the env's autoreset mode: build it with "
                              "GymStepWriter.from_env(envs, buffer), which reads it from the env, or pass "
                              "autoreset_mode='next_step' (gymnasium's default) or 'same_step'")
        buffer, self._lock = _local_buffer(buffer)
        for name in (observation, action, reward):
            if name not in buffer.spec:
                raise ConfigError(f"the buffer's spec has no (flat) field {name!r}; it has "
                                  f"{sorted(buffer.spec.fields)}")
        others = sorted(set(buffer.spec.fields) - {observation, action, reward})
        stacked = [name for name in (action, reward) if buffer.spec[name].frame_stack]
        if others or stacked:
            has = f"other fields {others}" if others else f"frame-stacked {stacked}"
            raise ConfigError(f"GymStepWriter writes only the fields {observation!r}, {action!r} and "
                              f"{reward!r} (only the observation frame-stacked); this spec has {has}: "
                              "use GymStepConverter with ReplayBuffer.add for it")
        if buffer.spec[reward].shape != ():
            raise ConfigError(f"reward field {reward!r} must be a scalar, got shape "
                              f"{buffer.spec[reward].shape}")
        self.buffer = buffer
        self.autoreset_mode = mode_name(autoreset_mode)
        # A frame-stacked observation (pixels) is written through ReplayBuffer.add, which
        # alone fills frame rings (gym_stacked.py); plain fields take the compiled write.
        self._stacked = (StackedSteps(buffer, self.autoreset_mode == "same_step",
                                      (observation, action, reward))
                         if buffer.spec[observation].frame_stack else None)
        if self._stacked is not None:
            self.num_envs = buffer.num_streams
            return
        self.num_envs = buffer.num_streams
        self._names = (observation, action, reward)
        self._shard = shard_of_buffer(buffer)
        st = self._shard.storage
        n, s = st.size, self.num_envs
        self._obs_shape = (s, *buffer.spec[observation].shape)
        self._act_shape = (s, *buffer.spec[action].shape)
        self._unit_action = buffer.spec[action].shape[-1:] == (1,)
        self._held_obs = np.zeros((s, *buffer.spec[observation].shape), buffer.spec[observation].dtype)
        self._same_step = self.autoreset_mode == "same_step"
        parts: Mapping[str, Any] = st.records.dtype.fields or {}
        self._state = np.array([st.stream_capacity, st.window, self._same_step,
                                *(buffer.spec[k].checks_finite for k in self._names), 0, 0, 0,
                                *(parts[name][1] for name in gk.RECORD_PARTS)]
                               + [FIRST] * s + list(range(s)) + [0] * (4 * s * st.window), np.int64)
        self._fstate = np.ones(1 + s, np.float64)
        self._out = self._state[gk.HELD + 2 * s:].reshape(4, s * st.window)  # a view, filled by each write
        self._is_uniform = buffer.sampler_name == "uniform"
        # Every array the compiled write takes, bound once: the storage changes them in
        # place (restores included), never replaces them.
        # The records go as plain uint8 rows (a plain ndarray even when memory-mapped).
        self._head = (np.asarray(st.records).view(np.uint8).reshape(n, -1), st.pos_and_counters,
                      self._state, self._fstate,
                      st.fields[observation].reshape(n, *buffer.spec[observation].shape),
                      st.fields[action].reshape(n, *buffer.spec[action].shape),
                      st.fields[reward].reshape(n), self._held_obs)
        # Compiled (or loaded from numba's cache) for inputs in the stored dtypes now, so the
        # one-time cost lands where the writer is made, not in the first step.
        spec = buffer.spec
        canonical = (np.zeros(self._act_shape, spec[action].dtype), self._held_obs.copy(),
                     np.zeros(s, spec[reward].dtype), np.zeros(s, bool), np.zeros(s, bool))
        self._kernel = compiled_gym_write(self._head, canonical)
        self._plain = False  # reset, NEXT_STEP and uniform: step() writes inline
        self._is_reset = False
        self._storage = st

    @property
    def num_steps(self) -> int:
        """Steps written so far (over all envs)."""
        if self._stacked is not None:
            return self._stacked.num_steps
        return int(self._state[gk.STEPS])

    @property
    def num_episodes(self) -> int:
        """Episodes ended so far (over all envs)."""
        if self._stacked is not None:
            return self._stacked.num_episodes
        return int(self._state[gk.EPISODES])

    @classmethod
    def from_env(cls, env: Any, buffer: ReplayBuffer | ShardedReplayBuffer, **kwargs: Any) -> GymStepWriter:
        """A writer for ``env``'s autoreset mode (``autoreset_mode=`` overrides it): the
        documented way to make one. ``buffer`` may be a ShardedReplayBuffer: this rank's
        ``env`` then writes into this rank's shard.

        Raises:
            ConfigError: as the constructor; the env does not say its mode (gymnasium >= 1.0);
                its ``num_envs`` differs from the buffer's (this rank's shard's) ``num_streams``.
        """
        local, _ = _local_buffer(buffer)
        if int(env.num_envs) != local.num_streams:
            shard = " (this rank's shard)" if local is not buffer else ""
            raise ConfigError(f"the env has {env.num_envs} envs but the buffer{shard} {local.num_streams} "
                              "streams: make the buffer with num_streams=env.num_envs")
        if "autoreset_mode" not in kwargs:
            kwargs["autoreset_mode"] = env_autoreset_mode(env)
        return cls(buffer, **kwargs)

    def reset(self, obs: Any) -> None:
        """Start every stream anew at ``obs`` (from ``env.reset()``): the next step is FIRST.

        Raises:
            SpecMismatchError: ``obs`` does not fit the spec's observation field (one row per env).
        """
        if self._stacked is not None:
            self._stacked.reset(obs)
            return
        name = self._names[0]
        arr = self.buffer.spec.validate(self._probe(obs, None, None), (self.num_envs,))[name]
        self._held_obs[...] = arr
        self._state[gk.HELD:gk.HELD + self.num_envs] = FIRST
        self._fstate[1:] = 1.0
        self._is_reset = True
        # The inline path of step() holds no lock: a pipelined sharded buffer's writes take
        # _write_all, which does.
        self._plain = self._is_uniform and not self._same_step and self._lock is None

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
        if self._stacked is not None:
            if self._lock is None:  # no context manager to enter (a pixel step counts microseconds)
                self._stacked.step(action, obs, reward, terminated, truncated, info)
            else:
                with self._lock:
                    self._stacked.step(action, obs, reward, terminated, truncated, info)
            return
        if self._plain and not info:  # never with a lock to hold (reset() says)
            # The common case inline: NEXT_STEP, uniform sampling, no info to look at.
            try:
                delta = self._kernel(*self._head, action, obs, reward, terminated, truncated)
            except TypeError:  # inputs of a kind not accepted yet (or not arrays)
                if self._unit_action and getattr(action, "shape", None) == self._act_shape[:-1]:
                    # A (1,) Box action given as [num_envs] (as SB3 takes it): its unit axis
                    # added here, so the compiled write takes it (checked only on this path).
                    self.step(np.reshape(action, self._act_shape), obs, reward, terminated, truncated, info)
                    return
                self._write_all(*self._accept(action, obs, reward, terminated, truncated), info)
                return
            if delta <= _REFUSED:
                self._raise_for(delta, action, obs, reward, terminated, truncated)
            self._storage.num_valid += delta
            return
        if not all(type(x) is np.ndarray for x in (action, obs, reward, terminated, truncated)):
            action, obs, reward, terminated, truncated = self._accept(action, obs, reward, terminated,
                                                                      truncated)
        self._write_all(action, obs, reward, terminated, truncated, info)

    def _write_all(self, action: np.ndarray, obs: np.ndarray, reward: np.ndarray, terminated: np.ndarray,
                   truncated: np.ndarray, info: Mapping[str, Any] | None) -> None:
        """The compiled write of arrays (shapes checked in it), their kind accepted first."""
        if self._lock is not None:
            with self._lock:
                self._write_unlocked(action, obs, reward, terminated, truncated, info)
        else:
            self._write_unlocked(action, obs, reward, terminated, truncated, info)

    def _write_unlocked(self, action: np.ndarray, obs: np.ndarray, reward: np.ndarray,
                        terminated: np.ndarray, truncated: np.ndarray,
                        info: Mapping[str, Any] | None) -> None:
        if not self._is_reset:
            raise ConfigError("call reset(obs) with the env's reset observation before step()")
        done_ids = None
        if info and has_final_obs(info) and not self._same_step and (terminated.any() or truncated.any()):
            raise SpecMismatchError(
                "the env reset in the same step (info holds final observations) but the writer "
                "expects NEXT_STEP autoreset: build it with autoreset_mode='same_step'")
        if self._same_step and (terminated.any() or truncated.any()):
            done_ids = np.flatnonzero(terminated | truncated)
            last_obs = final_obs(info, done_ids)  # raises before anything is written
        if not self._is_uniform:
            self._fstate[0] = self._shard.sampler.default_priority()
        try:
            delta = self._kernel(*self._head, action, obs, reward, terminated, truncated)
        except TypeError:  # inputs of a kind not accepted yet
            action, obs, reward, terminated, truncated = self._accept(action, obs, reward, terminated,
                                                                      truncated)
            delta = self._kernel(*self._head, action, obs, reward, terminated, truncated)
        if delta <= _REFUSED:
            self._raise_for(delta, action, obs, reward, terminated, truncated)
        self._storage.num_valid += delta
        if not self._is_uniform:  # as ReplayBuffer._write tells its sampler (same layer)
            out, n_out = self._out, int(self._state[gk.N_OUT])
            self._shard.sampler.on_write(out[1, :n_out], out[2, :n_out].astype(bool),
                                          out[3, :n_out].astype(bool))
        if done_ids is not None:
            self._write_last(done_ids, last_obs, terminated, action)

    def _raise_for(self, result: int, *inputs: np.ndarray) -> None:
        """Raise the error the compiled write's refusal ``result`` stands for."""
        code = gk.FAILED - result  # 1 .. 3: NaN or inf in obs, action, reward; 4: a shape
        if code == 4:
            self._accept(*inputs)  # raises, naming the input of the wrong shape
        raise SpecMismatchError(f"field {self._names[code - 1]!r} holds NaN or inf; the spec's "
                                "Field(finite=True) rejects them")

    def _write_last(self, ids: np.ndarray, last_obs: Any, terminated: np.ndarray, action: np.ndarray) -> None:
        """SAME_STEP: the LAST steps of the envs that ended (action, reward: padding)."""
        obs_name, action_name, reward_name = self._names
        step = {obs_name: last_obs, action_name: np.zeros_like(action[ids]),
                reward_name: np.zeros(len(ids), np.float32),
                "step_type": np.full(len(ids), LAST, np.uint8),
                "discount": np.where(terminated[ids], 0.0, 1.0).astype(np.float32)}
        self.buffer.add(step, stream_ids=ids)
        self._state[gk.STEPS] += len(ids)

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
                truncated: Any) -> _Inputs:
        """Check inputs of a new kind against the spec once; arrays the fast path takes.

        Raises:
            ConfigError: called before :meth:`reset`.
            SpecMismatchError: as :meth:`step`.
        """
        if not self._is_reset:
            raise ConfigError("call reset(obs) with the env's reset observation before step()")
        action, obs, reward = np.asarray(action), np.asarray(obs), np.asarray(reward)
        if self._unit_action and action.shape == self._act_shape[:-1]:
            action = action.reshape(self._act_shape)
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
        inputs: _Inputs = (action, obs, reward, flags[0], flags[1])
        # An integer narrowing (int64 -> uint8) is checked for its values on every call:
        # such inputs go on as copies in the stored dtypes, whose kind is compiled instead.
        if not all(np.can_cast(arr.dtype, spec[name].dtype, casting="same_kind")
                   and not (arr.dtype.kind in "iub" and not np.can_cast(arr.dtype, spec[name].dtype, "safe"))
                   for name, arr in zip(self._names, (obs, action, reward), strict=True)):
            inputs = (action.astype(spec[self._names[1]].dtype), obs.astype(spec[self._names[0]].dtype),
                      reward.astype(spec[self._names[2]].dtype), flags[0], flags[1])
        self._compile_for(inputs)
        return inputs

    def _compile_for(self, inputs: tuple[np.ndarray, ...]) -> None:
        """Let the compiled write take inputs of these types from now on."""
        allow_inputs(self._kernel, (*self._head, *inputs))

