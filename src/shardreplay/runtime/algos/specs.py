"""The Spec each ``--algo`` writes, built without torch (numpy and the env description
only): the launcher sizes its local rings with it and never imports torch itself.
Each algorithm's ``transition_spec`` returns the same (a test compares them)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shardreplay.errors import ConfigError
from shardreplay.runtime.envs import EnvInfo, transition_spec
from shardreplay.runtime.settings import ALGOS
from shardreplay.spec import Field, Spec

__all__ = ["SPECS", "recurrent_spec", "spec_of"]


def recurrent_spec(env: EnvInfo, hidden: tuple[int, ...]) -> Spec:
    """R2D2's Spec: obs, int64 action, reward, and the actor's LSTM state ``h``, ``c``
    (float32 ``[hidden[-1]]``), written at each step and kept by the buffer at the
    sequence starts only (``at_starts``: docs/semantics.md, "Start-state fields").

    Raises:
        ConfigError: no ``hidden`` size, or images (the LSTM takes flat vectors).
    """
    if not hidden:
        raise ConfigError("--algo r2d2 needs --hidden (its last size is the LSTM's)")
    if len(env.obs_shape) != 1:
        raise ConfigError(f"--algo r2d2 takes flat vector observations, got shape {list(env.obs_shape)}")
    state = Field((int(hidden[-1]),), np.float32, at_starts=True)
    return Spec({**transition_spec(env).fields, "h": state, "c": state})


# --algo name -> the Spec its actors write (its Algorithm.transition_spec), built without
# torch: the launcher sizes the local rings with it and imports no torch itself.
SPECS: dict[str, Callable[[EnvInfo, tuple[int, ...]], Spec]] = {
    "dqn": lambda env, _hidden: transition_spec(env),
    "sac": lambda env, _hidden: transition_spec(env),
    "r2d2": recurrent_spec,
}


def spec_of(name: str, env: EnvInfo, hidden: tuple[int, ...] = ()) -> Spec:
    """The transition Spec of ``--algo name`` for ``env`` (and ``--hidden``), without
    importing torch.

    Raises:
        ConfigError: an unknown name, or a Spec the algorithm refuses for ``env``.
    """
    if name not in SPECS:
        raise ConfigError(f"--algo must be one of {', '.join(ALGOS)}, got {name!r}")
    return SPECS[name](env, tuple(hidden))
