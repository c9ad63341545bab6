"""Uniform sampling: every valid window start equally likely."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardreplay.kernels.lazy import lazy
from shardreplay.samplers.base import Draw, Unweighted, check_state_keys
from shardreplay.storage import StreamStorage

if TYPE_CHECKING:
    from shardreplay.kernels import sampling as kernels
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    kernels = lazy("shardreplay.kernels.sampling")

# Below this fraction of valid slots, rejection sampling would waste draws: list them.
_MIN_ACCEPTANCE = 0.05


class UniformSampler(Unweighted):
    """``P(i) = 1 / N`` over the ``N`` valid starts; weights are all 1.

    Draws slots uniformly over the whole ring and rejects invalid ones, which keeps the
    distribution exact and needs no index; when few slots are valid it lists the valid
    slots instead.
    """

    name = "uniform"

    def __init__(self, storage: StreamStorage) -> None:
        self.storage = storage

    def on_write(self, slots: np.ndarray, valid: np.ndarray, newly: np.ndarray) -> None:
        """Nothing to maintain: the storage keeps the valid flags."""

    def num_samplable(self) -> int:
        """Number of valid starts."""
        return self.storage.num_valid

    def mass(self) -> float:
        """The valid count."""
        return float(self.storage.num_valid)

    def draw(self, n: int, rng: np.random.Generator, advance: bool = True) -> Draw:
        """``n`` i.i.d. uniform valid starts."""
        starts = self.draw_starts(n, rng)
        prob = np.empty(n)
        prob.fill(1.0 / self.storage.num_valid)  # fill: np.full's argument handling costs more
        weights = np.empty(n, np.float32)
        weights.fill(1.0)
        return Draw(starts, prob, weights)

    def draw_starts(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """The starts of :meth:`draw` alone (the same draws from ``rng``), for a caller
        that needs no probabilities (every weight is 1). ``n`` >= 1 and a valid start
        exist (the caller checks)."""
        storage = self.storage
        count, cap = storage.num_valid, storage.stream_capacity
        # Only written slots can be valid: each row's first min(pos, C) slots. Drawing
        # over those (not the whole ring) keeps the cost independent of the capacity
        # while the buffer fills; the rejection of invalid ones keeps it exact.
        total = kernels.written_total(storage.pos, cap)
        # Sequence windows start at most every ``period`` steps: an acceptance near
        # 1 / period is their normal, and rejection still costs O(n * period) draws,
        # where listing the valid slots would cost O(capacity).
        if count * storage.period < total * _MIN_ACCEPTANCE:
            return rng.choice(_written_valid(storage.valid, np.minimum(storage.pos, cap), cap), size=n)
        # The kernel maps raw 64-bit words of the generator to slots (numpy's
        # ``integers`` costs more in argument handling than the draws themselves). Words
        # per accepted start: past the written count (the count rounded up to a power of
        # two), then invalid; a function of the state alone, so that a restored buffer
        # draws as the saved one.
        per_start = 1.1 * (1 << (total - 1).bit_length()) / count
        out = np.empty(n, np.int64)
        got = 0
        while got < n:
            raw = rng.bit_generator.random_raw(int((n - got) * per_start) + 8)
            got = kernels.draw_written(raw, storage.pos, cap, storage.valid, out, got, storage.sample_rows)
        return out

    def rebuild(self) -> None:
        """Nothing derived to rebuild."""

    def state_dict(self) -> dict[str, Any]:
        """No state of its own."""
        return {}

    def check_state(self, state: Mapping[str, Any], steps: Mapping[str, np.ndarray]) -> None:
        """A uniform sampler's state is empty.

        Raises:
            ConfigError: the state has entries.
        """
        check_state_keys(self.name, state, ())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state of its own."""


def _written_valid(valid: np.ndarray, written: np.ndarray, cap: int) -> np.ndarray:
    """Flat slots of the valid starts, reading only the ``written[r]`` first slots of each
    row ``r`` (a row's written slots are its first)."""
    parts = [r * cap + np.flatnonzero(valid[r * cap:r * cap + int(w)]) for r, w in enumerate(written) if w]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)
