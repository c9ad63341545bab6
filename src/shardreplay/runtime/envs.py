"""Gymnasium environments for actors and evaluation, and the matching Spec: ``ALE/...``
ids get the standard DQN preprocessing and 4-frame stacks (docs/atari.md), ``MinAtar/...``
ids channels-first uint8 images; any other id is made as registered (after
``--env-import``, with ``--env-kwargs``), images ``[H, W, C]`` turned channels first.
gymnasium (and ale-py, minatar) are imported only when an environment is made.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardreplay.errors import ConfigError
from shardreplay.gym.pomdp import ENV_ID as MASKED_CARTPOLE
from shardreplay.gym.pomdp import register_masked_cartpole
from shardreplay.spec import Field, Spec

__all__ = ["EnvInfo", "EnvSource", "describe_env", "env_source", "make_env", "make_vector_env",
           "reward_threshold", "transition_spec"]

ATARI_STACK = 4


@dataclass(frozen=True)
class EnvSource:
    """How to make an environment: its id, the modules that register it, ``make`` kwargs."""

    env_id: str
    imports: tuple[str, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvInfo:
    """What the spec, the network and the actors need to know of an environment.

    Attributes:
        obs_shape: one observation's shape (channels first for images).
        obs_dtype: float32 for vectors, uint8 for images.
        num_actions: size of the Discrete action space (0 for a Box).
        frame_stack: frames per observation stack (0: not a stack of frames).
        action_shape: a Box's action shape ``(d,)`` (``()``: Discrete actions).
        action_low: a Box's lower bounds, one per dimension.
        action_high: a Box's upper bounds, one per dimension.
    """

    obs_shape: tuple[int, ...]
    obs_dtype: np.dtype
    num_actions: int
    frame_stack: int = 0
    action_shape: tuple[int, ...] = ()
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()

    @property
    def continuous(self) -> bool:
        """True for Box (real-valued) actions."""
        return bool(self.action_shape)


def env_source(env_id: str, env_import: str = "", env_kwargs: str = "") -> EnvSource:
    """The :class:`EnvSource` of ``--env-id``, ``--env-import`` (comma-separated module
    names) and ``--env-kwargs`` (a JSON object; ``''``: none).

    Raises:
        ConfigError: ``env_kwargs`` is not a JSON object.
    """
    modules = tuple(m.strip() for m in env_import.split(",") if m.strip())
    try:
        kwargs = json.loads(env_kwargs) if env_kwargs else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--env-kwargs must be a JSON object, e.g. '{{\"max_episode_steps\": 500}}': {exc}"
                          ) from exc
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--env-kwargs must be a JSON object, got {env_kwargs!r}")
    return EnvSource(env_id, modules, kwargs)


def _gym() -> Any:
    try:
        import gymnasium
    except ImportError as exc:  # pragma: no cover - gymnasium is a dependency of [train]
        raise ConfigError("environments need gymnasium: pip install 'shardreplay[train]'") from exc
    return gymnasium


def _import(module: str, extra: str = "") -> Any:
    """``module``; an ``--env-import`` module not on ``sys.path`` is also looked for in the
    current directory (as ``python -m`` would), appended to the path (it shadows nothing).

    Raises:
        ConfigError: it cannot be imported (saying where it was looked for, or what to install).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        here, top = os.getcwd(), module.split(".")[0]
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == top and not extra
        if missing and here not in sys.path and (os.path.isfile(os.path.join(here, f"{top}.py"))
                                                 or os.path.isdir(os.path.join(here, top))):
            sys.path.append(here)
            return _import(module, extra)
        hint = f": pip install 'shardreplay[{extra}]'" if extra else " (--env-import names it)"
        if missing:
            hint = f" (--env-import names it; not on sys.path nor in the current directory {here}: put " \
                   "the directory that holds it on PYTHONPATH)"
        raise ConfigError(f"cannot import {module}{hint}: {exc}") from exc


def _register(source: EnvSource) -> Any:
    """Import what registers ``source``'s id; returns gymnasium."""
    gym = _gym()
    for module in source.imports:
        _import(module)
    if source.env_id.startswith("ALE/"):
        gym.register_envs(_import("ale_py", "atari"))
    elif source.env_id.startswith("MinAtar/") and source.env_id not in gym.registry:
        _import("minatar.gym", "minatar").register_envs()
    elif source.env_id == MASKED_CARTPOLE:
        register_masked_cartpole()
    return gym


def reward_threshold(source: EnvSource) -> float | None:
    """The ``reward_threshold`` the env's gymnasium registration gives (None: none).

    Raises:
        ConfigError: as :func:`make_env` (a module that is missing, an unknown id).
    """
    gym = _register(source)
    try:
        threshold = gym.spec(source.env_id).reward_threshold
    except gym.error.Error as exc:
        raise ConfigError(f"unknown gymnasium environment {source.env_id!r}: {exc}") from exc
    return None if threshold is None else float(threshold)


def make_env(source: EnvSource) -> Any:
    """One environment, wrapped as the module docstring says.

    Raises:
        ConfigError: an unknown id, a package that is missing, bad kwargs.
    """
    gym = _register(source)
    kwargs = dict(source.kwargs)
    atari = source.env_id.startswith("ALE/")
    if atari:
        kwargs.setdefault("frameskip", 1)  # AtariPreprocessing skips frames itself
    try:
        env = gym.make(source.env_id, **kwargs)
    except gym.error.Error as exc:
        raise ConfigError(f"unknown gymnasium environment {source.env_id!r}: {exc}") from exc
    except TypeError as exc:
        raise ConfigError(f"{source.env_id}: bad --env-kwargs {json.dumps(source.kwargs)}: {exc}") from exc
    if atari:
        from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

        try:
            env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)
        except gym.error.DependencyNotInstalled as exc:
            raise ConfigError(f"Atari preprocessing needs opencv: pip install 'shardreplay[atari]' ({exc})"
                              ) from exc
        return FrameStackObservation(env, ATARI_STACK)
    return _channels_first(env)


def _channels_first(env: Any) -> Any:
    """Images ``[H, W, C]`` (C in 1, 3, 4; MinAtar's any C on 10x10) become uint8 ``[C, H, W]``."""
    gym = _gym()
    space = env.observation_space
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 3:
        return env
    h, w, c = space.shape
    minatar = env.spec is not None and env.spec.id.startswith("MinAtar/")
    if not (minatar or (c in (1, 3, 4) and h > 4 and w > 4)):
        return env  # already channels first
    high = 1 if space.dtype == np.bool_ else 255
    new = gym.spaces.Box(0, high, (c, h, w), np.uint8)
    return gym.wrappers.TransformObservation(
        env, lambda o: np.ascontiguousarray(np.moveaxis(np.asarray(o, np.uint8), -1, 0)), new)


def describe_env(source: EnvSource, actions: str = "discrete") -> EnvInfo:
    """The :class:`EnvInfo` of the environment ``source`` makes, for an algorithm taking
    ``actions``: ``discrete`` or ``box`` (a flat, bounded Box; vector observations only).

    Raises:
        ConfigError: as :func:`make_env`; an action space of another kind than
            ``actions``; an observation that is neither a flat vector nor an image.
    """
    gym = _gym()
    env = make_env(source)
    try:
        obs, act = env.observation_space, env.action_space
    finally:
        env.close()
    name = source.env_id
    if actions == "box":
        return _describe_box(name, obs, act)
    if not isinstance(act, gym.spaces.Discrete):
        hint = " (--algo sac takes Box actions)" if isinstance(act, gym.spaces.Box) else ""
        raise ConfigError(f"{name}: the action space is {act}; shardreplay train needs a Discrete one{hint}")
    if not isinstance(obs, gym.spaces.Box) or len(obs.shape) not in (1, 3):
        raise ConfigError(f"{name}: the observation space is {obs}; a flat vector Box or an image "
                          "[C, H, W] is needed")
    if len(obs.shape) == 1:
        return EnvInfo((int(obs.shape[0]),), np.dtype(np.float32), int(act.n))
    if obs.dtype not in (np.uint8, np.bool_):
        raise ConfigError(f"{name}: image observations of {obs.dtype}; uint8 (or bool) pixels are needed")
    stack = ATARI_STACK if name.startswith("ALE/") else 0
    return EnvInfo(tuple(int(d) for d in obs.shape), np.dtype(np.uint8), int(act.n), stack)


def _describe_box(name: str, obs: Any, act: Any) -> EnvInfo:
    """The :class:`EnvInfo` of an env with flat Box actions and flat vector observations.

    Raises:
        ConfigError: other spaces, or unbounded actions (a tanh policy needs bounds).
    """
    gym = _gym()
    if not isinstance(act, gym.spaces.Box) or len(act.shape) != 1:
        raise ConfigError(f"{name}: the action space is {act}; --algo sac needs a flat Box "
                          "(use --algo dqn for Discrete actions)")
    low, high = np.asarray(act.low, np.float64), np.asarray(act.high, np.float64)
    if not (np.isfinite(low).all() and np.isfinite(high).all()):
        raise ConfigError(f"{name}: the action space {act} is unbounded; --algo sac needs finite bounds "
                          "(wrap the env in gymnasium.wrappers.RescaleAction)")
    if not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
        raise ConfigError(f"{name}: the observation space is {obs}; --algo sac needs a flat vector Box")
    return EnvInfo((int(obs.shape[0]),), np.dtype(np.float32), 0,
                   action_shape=(int(act.shape[0]),), action_low=tuple(float(v) for v in low),
                   action_high=tuple(float(v) for v in high))


def make_vector_env(source: EnvSource, num_envs: int, seed: int | None) -> tuple[Any, np.ndarray]:
    """A synchronous vector env of :func:`make_env` envs (autoreset NEXT_STEP), reset
    with ``seed``; returns the env and its first observations."""
    gym = _gym()
    env = gym.vector.SyncVectorEnv([lambda: make_env(source) for _ in range(num_envs)])
    obs, _info = env.reset(seed=seed)
    return env, obs


def transition_spec(obs: int | EnvInfo) -> Spec:
    """The Spec actors write: ``obs`` (float32[obs] for a vector size; for an
    :class:`EnvInfo`, its shape and dtype, ``frame_stack`` for Atari's stacks), ``action``
    (int64; float32 ``[d]`` for Box actions), ``reward`` float32."""
    action = Field((), np.int64)
    if isinstance(obs, EnvInfo):
        obs_field = Field(obs.obs_shape, obs.obs_dtype, frame_stack=obs.frame_stack > 0)
        if obs.continuous:
            action = Field(obs.action_shape, np.float32)
    else:
        obs_field = Field((int(obs),), np.float32)
    return Spec({"obs": obs_field, "action": action, "reward": Field((), np.float32)})
