"""Deterministic shard contents and a brute-force single-buffer reference for them.

Every rank writes streams whose step types come from a seeded episode-length
generator; each step's ``obs`` is a unique item id ``rank * 1000 + stream * 100 + t``.
The parent process rebuilds the same histories here, without shardreplay, and computes
the valid window starts of the union of all shards (docs/semantics.md, sampling rule 1) and the
single-buffer probabilities and importance weights (rule 3), to compare with what the
sharded buffer sampled.
"""

from __future__ import annotations

import numpy as np

FIRST, MID, LAST = 0, 1, 2
STREAMS = 3
CAPACITY = 16
WINDOW = 3
ALPHA = 0.7
BETA = 0.5

# Steps written per (rank, stream); a stream of more than CAPACITY steps wraps its ring.
# Every world with K >= 2 has an empty shard (rank 1).
AMOUNTS = {
    1: [[30, 9, 4]],
    2: [[20, 7, 12], [0, 0, 0]],
    4: [[11, 6, 0], [0, 0, 0], [3, 0, 5], [34, 16, 21]],
}


def item_id(rank: int, stream: int, t: int) -> int:
    """The unique id of step ``t`` of ``stream`` on ``rank`` (stored as its ``obs``)."""
    return rank * 1000 + stream * 100 + t


def step_types(rank: int, stream: int, n: int) -> np.ndarray:
    """Step types of the first ``n`` steps written to a stream: whole episodes of 2..6 steps."""
    rng = np.random.default_rng([rank, stream, 7])
    types: list[int] = []
    while len(types) < n:
        length = int(rng.integers(2, 7))
        types += [FIRST] + [MID] * (length - 2) + [LAST]
    return np.array(types[:n], np.uint8)


def written_priority(i: np.ndarray | int) -> np.ndarray:
    """The priority a step is written with (varied, all > 0)."""
    return np.float32(0.2 + ((np.asarray(i) * 37) % 23) / 8)


def updated_priority(i: np.ndarray | int) -> np.ndarray:
    """The priority ``update_priorities`` gives a sampled item (a function of its id only,
    so several ranks updating the same item agree)."""
    return np.float32(0.1 + ((np.asarray(i) * 13) % 29) / 5)


def valid_windows(rank: int, stream: int, n: int) -> dict[int, int]:
    """``{item id: bootstrap position m}`` of every valid start among the stored steps.

    Rule 1, brute force: the start is stored and not LAST, and the next ``WINDOW - 1``
    steps are written, unless a LAST ends the episode earlier (then ``m`` is that LAST).
    """
    types = step_types(rank, stream, n)
    out = {}
    for t in range(max(0, n - CAPACITY), n):
        if types[t] == LAST:
            continue
        for j in range(1, WINDOW):
            if t + j >= n:
                break
            if types[t + j] == LAST or j == WINDOW - 1:
                out[item_id(rank, stream, t)] = j
                break
    return out


class Reference:
    """The single buffer holding the union of all shards of one world.

    Args:
        world: number of ranks K (a key of :data:`AMOUNTS`).
        updated: ids whose priority was set by ``update_priorities`` (else as written).
    """

    def __init__(self, world: int, updated: set[int]) -> None:
        self.world = world
        self.bootstrap: dict[int, int] = {}
        for rank, amounts in enumerate(AMOUNTS[world]):
            for stream, n in enumerate(amounts):
                self.bootstrap.update(valid_windows(rank, stream, n))
        self.ids = np.array(sorted(self.bootstrap), np.int64)
        self.owner = self.ids // 1000
        self.priority = np.where(np.isin(self.ids, list(updated)), updated_priority(self.ids),
                                 written_priority(self.ids)).astype(np.float32)

    def probabilities(self, prioritized: bool) -> np.ndarray:
        """``P(i)`` over :attr:`ids`: uniform, or ``p^alpha / sum p^alpha``."""
        leaf = self.priority.astype(np.float64) ** ALPHA if prioritized else np.ones(len(self.ids))
        return leaf / leaf.sum()

    def weights(self, prioritized: bool) -> np.ndarray:
        """``(N P(i))^-beta / max_j (N P(j))^-beta`` over all valid starts (1 for uniform)."""
        if not prioritized:
            return np.ones(len(self.ids))
        w = (len(self.ids) * self.probabilities(True)) ** -BETA
        return w / w.max()

    def shard_mass_fraction(self, prioritized: bool) -> np.ndarray:
        """``mass_k / sum(mass)`` per rank."""
        p = self.probabilities(prioritized)
        return np.array([p[self.owner == k].sum() for k in range(self.world)])

    def index(self, ids: np.ndarray) -> np.ndarray:
        """Positions of ``ids`` in :attr:`ids` (every id must be a valid start)."""
        pos = np.searchsorted(self.ids, ids)
        assert (pos < len(self.ids)).all() and (self.ids[np.minimum(pos, len(self.ids) - 1)] == ids).all(), \
            "a sampled id is not a valid window start of the reference"
        return pos


def chi_square_pvalue(ids: np.ndarray, support: np.ndarray, prob: np.ndarray) -> float:
    """p-value of drawn ``ids`` against ``prob`` over ``support``; cells with an
    expected count below 5 are pooled into one, ids outside the support fail outright."""
    from scipy import stats  # here, not at the top: the rank processes never need scipy
    pos = np.searchsorted(support, ids)
    assert (pos < len(support)).all() and (support[np.minimum(pos, len(support) - 1)] == ids).all(), \
        "drawn ids outside the support"
    observed = np.bincount(pos, minlength=len(support)).astype(np.float64)
    expected = prob * len(ids)
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(expected) < 2:
        return 1.0
    return float(stats.chisquare(observed, expected).pvalue)
