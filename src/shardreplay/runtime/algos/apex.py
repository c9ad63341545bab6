"""Ape-X exploration (Horgan et al. 2018) without torch: each stream's epsilon and the
epsilon-greedy draw of the discrete actor policies (DQN's NumPy and torch ones, R2D2's).

Every such policy draws through :func:`explore` with the same generator calls, so one
seed gives the same actions whichever library computed the Q-values.
"""

from __future__ import annotations

import numpy as np

from shardreplay.errors import ShardReplayError
from shardreplay.runtime.actor.settings import ActorSettings
from shardreplay.runtime.algos.base import warmup

__all__ = ["ApexExploration", "apex_epsilons", "explore"]


def apex_epsilons(num_streams: int, first: int, total: int, base: float = 0.4,
                  exponent: float = 7.0) -> np.ndarray:
    """Ape-X exploration rates ``base^(1 + exponent * i / (total - 1))`` for global
    streams ``first .. first + num_streams - 1`` of ``total`` (one stream: ``base``)."""
    i = np.arange(first, first + num_streams, dtype=np.float64)
    frac = i / (total - 1) if total > 1 else np.zeros_like(i)
    return base ** (1.0 + exponent * frac)


def explore(greedy: np.ndarray, num_actions: int, epsilons: np.ndarray,
            rng: np.random.Generator) -> np.ndarray:
    """``greedy`` actions (int ``[B]``, replaced in place and returned), each replaced by a
    uniform random one of ``num_actions`` with probability ``epsilons[i]``: one
    ``rng.random(B)``, then one ``rng.integers`` for the replaced ones."""
    chosen = rng.random(greedy.shape[0]) < epsilons
    greedy[chosen] = rng.integers(0, num_actions, size=int(chosen.sum()))
    return greedy


class ApexExploration:
    """The epsilon-greedy exploration of one actor's streams: stream ``i`` of ``N`` acts
    greedily except with probability ``base^(1 + exponent i/(N-1))`` (from 1 during the
    warm-up), drawn from a generator seeded by the actor's seed.

    Args:
        s: the actor's resolved settings (``envs_per_actor`` and ``num_actors`` set).

    Raises:
        ShardReplayError: settings not resolved (no ``envs_per_actor`` or ``num_actors``).
    """

    def __init__(self, s: ActorSettings) -> None:
        if s.envs_per_actor is None or s.num_actors is None:
            raise ShardReplayError(f"actor {s.actor_id}: envs_per_actor and num_actors must be resolved "
                              "before a policy is made (a bug in the caller)")
        self.rng = np.random.default_rng(s.seed)
        self.eps = apex_epsilons(s.envs_per_actor, s.actor_id * s.envs_per_actor,
                                 s.num_actors * s.envs_per_actor, s.epsilon_base or 0.4,
                                 s.epsilon_exponent if s.epsilon_exponent is not None else 7.0)
        self.warmup_steps = s.epsilon_warmup_steps or 0

    def actions(self, greedy: np.ndarray, num_actions: int, run_steps: int) -> np.ndarray:
        """``greedy`` (replaced in place) explored with each stream's epsilon at ``run_steps``
        (the run's environment steps so far)."""
        return explore(greedy, num_actions, warmup(self.eps, run_steps, self.warmup_steps), self.rng)
