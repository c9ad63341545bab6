"""The algorithms of ``shardreplay train`` (:func:`algorithm`: the one ``--algo`` names; one
module each behind :mod:`.base`'s interface, its ``Algorithm`` named as the module in
capitals), and what is decided about them without torch: the action space
(:data:`ACTIONS`), the Spec actors write (:func:`spec_of`), the Q-network (:func:`choose_network`)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import cast

from shardreplay.errors import ConfigError
from shardreplay.runtime.algos.base import ACTIONS, Algorithm, known_algo, spec_of
from shardreplay.runtime.settings import NETWORKS

__all__ = ["ACTIONS", "NATURE_MIN_SIDE", "algorithm", "choose_network", "spec_of"]

NATURE_MIN_SIDE = 36  # the smallest side the Nature network's three convolutions accept


def algorithm(name: str) -> Algorithm:
    """The algorithm ``--algo name`` runs (its module is imported now: torch for most).

    Raises:
        ConfigError: an unknown name.
    """
    known_algo(name)
    return cast(Algorithm, getattr(importlib.import_module(f"{__name__}.{name}"), name.upper()))


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
