"""GymStepWriter: a gymnasium vector env's steps straight into a ReplayBuffer, one call each.

It stores exactly what :class:`shardreplay.gym.steps.GymStepConverter` followed by
:meth:`ReplayBuffer.add` stores (docs/semantics.md, "Gymnasium autoreset"), through the
buffer's one write path, built when the writer is made (docs/internals.md, "One-step
writes"); an observation that does not fit raises when it is handed over, not a step later.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardreplay.buffer.shard import shard_of_buffer
from shardreplay.errors import ConfigError, SpecMismatchError
from shardreplay.gym.modes import done_flags, env_autoreset_mode
from shardreplay.gym.steps import Autoreset
from shardreplay.spec.coerce import as_stored

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from shardreplay.buffer.replay_buffer import ReplayBuffer
    from shardreplay.distributed.sharded_buffer import ShardedReplayBuffer

__all__ = ["GymStepWriter"]


def _local_buffer(buffer: Any) -> tuple[ReplayBuffer, AbstractContextManager[Any] | None]:
    """The ReplayBuffer a writer fills, and the lock its writes hold: a sharded buffer's
    local shard, with its ``write_lock`` when a background exchange reads the shard
    (``pipeline=True``); a plain buffer itself, with none."""
    module = sys.modules.get("shardreplay.distributed.sharded_buffer")
    # Not imported: then ``buffer`` cannot be a sharded one (nothing to import for a plain buffer).
    if module is None or not isinstance(buffer, module.ShardedReplayBuffer):
        return buffer, None
    return buffer.local, (buffer.write_lock if buffer.pipeline else None)


class GymStepWriter(Autoreset):
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
    each frame is stored once.
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
        super().__init__(buffer.num_streams, autoreset_mode, (observation, action, reward))
        self.buffer = buffer
        self._shard = shard_of_buffer(buffer)
        # The common step's write (storage/one_step.py; it takes values of any kind), built
        # now (compiled, or loaded from numba's cache), not in the first step; none: every
        # step takes Shard.write.
        self._write_held: Any = self._shard.held_writer(self._names)  # called only when _ready
        self._can_hold = self._write_held is not None and self._lock is None  # no lock to hold around it
        self._ready = False  # the next step may take _write_held (see _set_ready)
        self._obs_field = buffer.spec[observation]
        self._check_finite = self._obs_field.checks_finite and self._obs_field.dtype.kind == "f"
        # vdot with zeros is NaN exactly when a value is NaN or inf (0 * inf is NaN).
        self._zeros = np.zeros((self.num_envs, *self._obs_field.shape), self._obs_field.dtype)

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
        self._spare = np.empty_like(self._zeros)  # the observation field's shape and dtype, a row per env
        super().reset(obs)
        self._spare = np.empty_like(self._obs)
        self._set_ready()

    def _set_ready(self) -> None:
        # The compiled write takes a step when no held step is LAST and none has a discount
        # (NEXT_STEP mode; SAME_STEP writes final observations in the same call).
        self._ready = (self._can_hold and not self._same_step and not self._any_last
                       and self._discounts is self._all_ones)

    def _hold(self, obs: Any) -> np.ndarray:
        """A copy of ``obs`` in the stored form to hold until the next step (the env may
        reuse its array), in the spare array (no allocation); any other dtype, a list or
        a tensor converted first (``spec/coerce.py``).

        Raises:
            SpecMismatchError: ``obs`` does not fit the observation field, or holds NaN or
                inf where the field is finite.
        """
        spare = self._spare
        # ``is``: a dtype of the stored kind is numpy's one object for it (else: converted).
        if type(obs) is not np.ndarray or obs.dtype is not spare.dtype or obs.shape != spare.shape:
            obs = as_stored(self._names[0], obs, spare.dtype, spare.shape, len(self._obs_field.shape))
        if self._check_finite and not math.isfinite(np.vdot(obs, self._zeros)):
            raise SpecMismatchError(f"field {self._names[0]!r} holds NaN or inf; the spec's "
                                    "Field(finite=True) rejects them")
        np.copyto(spare, obs)
        return spare

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
        if self._ready and not info:
            # The common step: checked and written, the next observation checked and held, in
            # one compiled call.
            got = self._write_held(self._types, self._obs, action, reward, obs, self._spare, terminated,
                                   truncated)
            if got:
                self._obs, self._spare = self._spare, self._obs
                self.num_steps += self.num_envs
                if got == 2:  # some env's episode ended: the held steps' types and discounts
                    self._boundary(done_flags(terminated, self.num_envs, "terminated"),
                                   done_flags(truncated, self.num_envs, "truncated"))
                    self._any_last, self._ready = True, False
                else:
                    self._types = self._all_mid
                return
        if self._lock is None:  # no context manager to enter (a step counts microseconds)
            self._advance(action, obs, reward, terminated, truncated, info)
        else:
            with self._lock:
                self._advance(action, obs, reward, terminated, truncated, info)
        self._set_ready()

    def _write(self, step: dict[str, Any], ids: np.ndarray | None) -> None:
        self._shard.write(step, ids, None, None)
