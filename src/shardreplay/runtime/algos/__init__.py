"""The algorithms of ``shardreplay train``, one module each behind :mod:`.base`'s interface.

:func:`algorithm` gives the one ``--algo`` names (``dqn``, ``sac``); :data:`ACTIONS` the
action space each takes (read without importing torch). A new algorithm (R2D2) is one
module with an :class:`~.base.Algorithm`, its name in ``settings.ALGOS`` and here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from shardreplay.errors import ConfigError
from shardreplay.runtime.envs import EnvInfo, transition_spec
from shardreplay.runtime.settings import ALGOS
from shardreplay.spec import Spec

if TYPE_CHECKING:
    from shardreplay.runtime.algos.base import Algorithm

__all__ = ["ACTIONS", "algorithm", "spec_of"]

# --algo name -> the action space it takes (describe_env's ``actions``)
ACTIONS = {"dqn": "discrete", "sac": "box"}
# --algo name -> the Spec its actors write (its Algorithm.transition_spec), built without
# torch: the launcher sizes the local rings with it and imports no torch itself.
SPECS: dict[str, Callable[[EnvInfo], Spec]] = {"dqn": transition_spec, "sac": transition_spec}


def spec_of(name: str, env: EnvInfo) -> Spec:
    """The transition Spec of ``--algo name`` for ``env``, without importing torch.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in SPECS:
        raise ConfigError(f"--algo must be one of {', '.join(ALGOS)}, got {name!r}")
    return SPECS[name](env)


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
    raise ConfigError(f"--algo must be one of {', '.join(ALGOS)}, got {name!r}")
