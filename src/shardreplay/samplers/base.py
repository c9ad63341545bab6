"""What every sampler provides to the buffer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shardreplay.errors import ConfigError


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
        """Slots whose validity was recomputed after a write (views of the storage's
        scratch arrays: read them now, copy what must be kept)."""

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

    def check_state(self, state: Mapping[str, Any], steps: Mapping[str, np.ndarray]) -> None:
        """Check a state from :meth:`state_dict` completely, changing nothing.

        ``steps`` are the step arrays of the buffer state it comes with (already checked
        for shapes and dtypes): the storage those arrays will become.

        Raises:
            ConfigError: an entry is missing, unknown, of the wrong type or out of range.
        """

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (the caller ran :meth:`check_state` first)."""


class Unweighted:
    """What a sampler that ignores priorities does for them: steps record 1.0, every
    drawable start weighs 1, weights are 1 (no importance weighting), updates change
    nothing."""

    def default_priority(self) -> float:
        """Priorities are ignored; steps record 1.0."""
        return 1.0

    def min_leaf(self) -> float:
        """Every drawable start weighs 1."""
        return 1.0

    def current_beta(self) -> float:
        """No importance weighting: weights are 1."""
        return 0.0

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Priorities do not change the draws (they are still stored per step)."""


def check_state_keys(name: str, state: Mapping[str, Any], required: tuple[str, ...],
                     optional: tuple[str, ...] = ()) -> None:
    """Raise unless ``state`` has every ``required`` key and no key outside both tuples.

    Raises:
        ConfigError: naming the missing or unknown entries of the ``name`` sampler state.
    """
    missing = [k for k in required if k not in state]
    unknown = sorted(str(k) for k in state if k not in required and k not in optional)
    if missing or unknown:
        wrong = "; ".join(f"{what} entries {keys}" for what, keys in
                          (("missing", missing), ("unknown", unknown)) if keys)
        raise ConfigError(f"{name} sampler state: {wrong}; pass a state from "
                          f"ReplayBuffer.state_dict() of a {name} buffer")


def state_error(name: str, key: str, expected: str, value: Any) -> ConfigError:
    """The error for a sampler-state entry that is not what ``state_dict`` writes."""
    shown = repr(value) if np.ndim(value) == 0 else f"array {np.shape(value)} {np.asarray(value).dtype}"
    return ConfigError(f"{name} sampler state: {key!r} must be {expected}, got {shown[:80]}; "
                       "pass a state from ReplayBuffer.state_dict()")
