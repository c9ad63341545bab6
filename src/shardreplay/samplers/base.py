"""What every sampler provides to the buffer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class Draw:
    """Window starts drawn by a sampler, with their probabilities and weights.

    ``starts`` are flat slots; ``probabilities`` float64 and ``weights`` float32,
    both ``[B]``.
    """

    starts: np.ndarray
    probabilities: np.ndarray
    weights: np.ndarray


class Sampler(Protocol):
    """Chooses valid window starts of a :class:`StreamStorage`.

    The buffer tells the sampler about every validity change (``on_write``) and asks it
    for draws; the sampler never touches stored steps.
    """

    name: str

    def default_priority(self) -> float:
        """Priority recorded for steps written without one."""

    def on_write(self, slots: np.ndarray, valid: np.ndarray, newly: np.ndarray) -> None:
        """Slots whose validity was recomputed after a write."""

    def num_samplable(self) -> int:
        """Number of windows that can be drawn now."""

    def mass(self) -> float:
        """Sampling mass: valid count (uniform) or sum of ``p^alpha`` (prioritized)."""

    def min_leaf(self) -> float:
        """Smallest positive per-start mass (1 for uniform; min ``p^alpha`` prioritized)."""

    def current_beta(self) -> float:
        """Importance-weight exponent now (0 where weights are all 1)."""

    def draw(self, n: int, rng: np.random.Generator, advance: bool = True) -> Draw:
        """Draw ``n`` window starts (the caller checked that something is samplable);
        ``advance`` moves schedules (beta) one call forward."""

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Set new priorities for valid, current slots (validated by the caller)."""

    def rebuild(self) -> None:
        """Rebuild derived structures from storage (after a load)."""

    def state_dict(self) -> dict[str, Any]:
        """Counters and settings needed for an exact restore."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
