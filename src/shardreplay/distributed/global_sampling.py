"""The arithmetic of sampling K shards as one buffer (docs/semantics.md, sampling rule 5).

Each rank reports ``(mass_k, N_k, min_leaf_k)``: its sampling mass (valid count for
uniform, ``sum p^alpha`` for prioritized), its valid count and its smallest positive
leaf. Then, for an item drawn from shard ``k`` with local probability ``q``::

    P(i)  = q * mass_k / sum(mass)                    (global probability)
    w_i   = (P(i) / P_min)^-beta,  P_min = min_k(min_leaf_k) / sum(mass)
    local mode:  w_i *= K * mass_k / sum(mass)        (shard factor)

``(N P(i))^-beta / max_j (N P(j))^-beta`` reduces to the first weight line: ``N``
cancels.
"""

from __future__ import annotations

import numpy as np


def shard_counts(rng: np.random.Generator, masses: np.ndarray, batch_size: int,
                 batches: int = 1) -> np.ndarray:
    """How many of ``batch_size`` items come from each shard, for each of ``batches``
    independent batches: ``[batches, K]`` rows of Multinomial(batch_size, mass / total)."""
    total = masses.sum()
    return rng.multinomial(batch_size, masses / total, size=batches).astype(np.int64)


def global_probabilities(local_prob: np.ndarray, owner_mass: np.ndarray, total: float) -> np.ndarray:
    """``P(i) = q_i * mass_owner / total``."""
    return local_prob * owner_mass / total
