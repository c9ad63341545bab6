"""What the samplers share.

A sampler chooses valid window starts of a ``StreamStorage``; the buffer tells it about
every validity change (``on_write``: views of the storage's scratch arrays, read at once)
and asks it for draws; it never touches stored steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from shardreplay.errors import ConfigError


class Draw(NamedTuple):
    """Window starts drawn by a sampler, with their probabilities and weights.

    ``starts`` are flat slots; ``probabilities`` float64 and ``weights`` float32,
    both ``[B]``. A named tuple, not a frozen dataclass: one is made on every sample
    call, and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``.
    """

    starts: np.ndarray
    probabilities: np.ndarray
    weights: np.ndarray


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
