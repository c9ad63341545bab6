"""gymnasium's autoreset modes and final observations, read without importing gymnasium.

Shared by :class:`shardreplay.gym.steps.GymStepConverter` and
:class:`shardreplay.gym.writer.GymStepWriter` (see the converter's module
docstring for the timelines of ``NEXT_STEP`` and ``SAME_STEP``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardreplay.errors import ConfigError, SpecMismatchError

__all__ = ["FINAL_OBS_KEYS", "done_flags", "env_autoreset_mode", "final_obs", "has_final_obs", "mode_name"]

_MODES = {"nextstep": "next_step", "samestep": "same_step"}
FINAL_OBS_KEYS = ("final_obs", "final_observation")  # gymnasium >= 1.0, 0.x


def mode_name(mode: Any) -> str:
    """``"next_step"`` or ``"same_step"`` for a ``gymnasium.vector.AutoresetMode`` or a string.

    Raises:
        ConfigError: another mode (``DISABLED``) or an unknown value.
    """
    text = str(getattr(mode, "value", mode)).lower().replace("_", "")
    if text not in _MODES:
        raise ConfigError(f"autoreset mode {mode!r} is not supported: use NEXT_STEP (gymnasium's "
                          "default) or SAME_STEP")
    return _MODES[text]


def env_autoreset_mode(env: Any) -> Any:
    """The autoreset mode ``env`` declares, or gymnasium 0.x's only mode (SAME_STEP).

    Raises:
        ConfigError: the env does not say its mode and gymnasium >= 1.0 is installed.
    """
    mode = getattr(env, "metadata", {}).get("autoreset_mode")
    if mode is not None:
        return mode
    if _gymnasium_major() == 0:
        return "same_step"
    raise ConfigError(f"{type(env).__name__} does not say its autoreset mode (no "
                      "metadata['autoreset_mode']): pass autoreset_mode='next_step' or 'same_step'")


def _gymnasium_major() -> int | None:
    """The installed gymnasium's major version, None when it is not installed."""
    from importlib import metadata

    try:
        return int(metadata.version("gymnasium").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None


def done_flags(value: Any, n: int, name: str) -> np.ndarray:
    """``terminated`` or ``truncated`` (``name``) as one bool per env (SpecMismatchError:
    not ``n`` of them)."""
    arr = np.asarray(value, dtype=bool)
    if arr.shape != (n,):
        raise SpecMismatchError(f"{name} must have shape ({n},), got {arr.shape}")
    return arr


def has_final_obs(info: Mapping[str, Any] | None) -> bool:
    """Whether ``info`` carries final observations (the mark of a SAME_STEP env)."""
    return info is not None and any(info.get(k) is not None for k in FINAL_OBS_KEYS)


def final_obs(info: Mapping[str, Any] | None, ids: np.ndarray) -> Any:
    """The final observations of the envs ``ids`` (SAME_STEP mode), stacked.

    Raises:
        SpecMismatchError: ``info`` lacks the final observation of one of them.
    """
    final = next((info[k] for k in FINAL_OBS_KEYS if info is not None and info.get(k) is not None), None)
    if final is None or any(final[i] is None for i in ids):
        raise SpecMismatchError("SAME_STEP mode: an env ended but info['final_obs'] lacks its final "
                                "observation; pass the info dict env.step returned")
    return _stack([final[i] for i in ids])


def _stack(items: list[Any]) -> Any:
    if isinstance(items[0], Mapping):
        return {k: _stack([it[k] for it in items]) for k in items[0]}
    return np.stack([np.asarray(it) for it in items])
