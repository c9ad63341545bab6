"""The algorithms of ``shardreplay train``, one module each behind :mod:`.base`'s interface.

:func:`algorithm` gives the one ``--algo`` names (``dqn``, ``sac``, ``r2d2``); :data:`ACTIONS`
the action space each takes (read without importing torch). A new algorithm is one
module with an :class:`~.base.Algorithm`, its name in ``settings.ALGOS`` and here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardreplay.errors import ConfigError
from shardreplay.runtime.algos.specs import spec_of
from shardreplay.runtime.settings import ALGOS

if TYPE_CHECKING:
    from shardreplay.runtime.algos.base import Algorithm

__all__ = ["ACTIONS", "algorithm", "spec_of"]

# --algo name -> the action space it takes (describe_env's ``actions``)
ACTIONS = {"dqn": "discrete", "sac": "box", "r2d2": "discrete"}


def algorithm(name: str) -> Algorithm:
    """The algorithm ``--algo name`` runs.

    Raises:
        ConfigError: an unknown name.
    """
    if name == "dqn":
        from shardreplay.runtime.algos.dqn import DQN

        return DQN
    if name == "sac":
        from shardreplay.runtime.algos.sac import SAC

        return SAC
    if name == "r2d2":
        from shardreplay.runtime.algos.r2d2 import R2D2

        return R2D2
    raise ConfigError(f"--algo must be one of {', '.join(ALGOS)}, got {name!r}")
