"""spec_from_env: the Spec of a gymnasium env's observation and action spaces, read
without importing gymnasium."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardreplay.errors import ConfigError
from shardreplay.spec import Field, Spec

__all__ = ["spec_from_env"]


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
