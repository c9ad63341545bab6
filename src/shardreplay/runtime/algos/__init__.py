"""The algorithms of ``shardreplay train`` (:func:`algorithm`: the one ``--algo`` names; one
module each behind :mod:`.base`'s interface, its ``Algorithm`` named as the module in
capitals), and what is decided about them without torch: the action space
(:data:`ACTIONS`), the Spec actors write (:func:`spec_of`), the Q-network (:func:`choose_network`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from shardreplay.errors import ConfigError
from shardreplay.runtime.envs import EnvInfo, transition_spec
from shardreplay.runtime.settings import ALGOS, NETWORKS
from shardreplay.spec import Field, Spec

if TYPE_CHECKING:
    from shardreplay.runtime.algos.base import Algorithm

__all__ = ["ACTIONS", "NATURE_MIN_SIDE", "SPECS", "algorithm", "choose_network", "recurrent_spec", "spec_of"]

# --algo name -> the action space it takes (describe_env's ``actions``)
ACTIONS = {"dqn": "discrete", "sac": "box", "r2d2": "discrete"}
NATURE_MIN_SIDE = 36  # the smallest side the Nature network's three convolutions accept


def _known(name: str) -> None:
    if name not in ACTIONS:
        raise ConfigError(f"--algo must be one of {', '.join(ALGOS)}, got {name!r}")


def algorithm(name: str) -> Algorithm:
    """The algorithm ``--algo name`` runs (its module is imported now: torch for most).

    Raises:
        ConfigError: an unknown name.
    """
    _known(name)
    found: Algorithm = getattr(importlib.import_module(f"{__name__}.{name}"), name.upper())
    return found


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


# --algo name -> the Spec its actors write (its Algorithm.transition_spec returns the same:
# a test compares them), built without torch: the launcher sizes the local rings with it.
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
    _known(name)
    return SPECS[name](env, tuple(hidden))


def choose_network(obs_shape: Sequence[int], network: str = "auto") -> str:
    """The network for observations of ``obs_shape``: ``network`` itself when it is not
    ``auto``, else ``mlp`` for vectors, ``nature`` for images of 36x36 or more and
    ``minatar`` for smaller ones (decided before an actor builds its policy: a NumPy one
    for an MLP on the CPU, torch only for the networks that need it).

    Raises:
        ConfigError: an unknown name, or a network that cannot take these observations.
    """
    if network not in NETWORKS:
        raise ConfigError(f"--network must be one of {', '.join(NETWORKS)}, got {network!r}")
    shape = tuple(int(d) for d in obs_shape)
    if network == "auto":
        if len(shape) == 1:
            return "mlp"
        if len(shape) == 3:
            return "nature" if min(shape[1:]) >= NATURE_MIN_SIDE else "minatar"
        raise ConfigError(f"observations shaped {list(shape)}: train takes flat vectors or images "
                          "[C, H, W]; wrap the env to produce one of them")
    need = 1 if network == "mlp" else 3
    if len(shape) != need or (network == "nature" and min(shape[1:]) < NATURE_MIN_SIDE) \
            or (network == "minatar" and min(shape[1:]) < 3):
        raise ConfigError(f"--network {network} cannot take observations shaped {list(shape)}"
                          + (" (it needs images of 36x36 or more)" if network == "nature" else ""))
    return network
