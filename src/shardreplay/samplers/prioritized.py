"""Prioritized sampling (Schaul et al. 2016) over valid window starts: the rules in
docs/semantics.md (sampling rule 3, "Priorities and weights"); ``w_i = (P(i) / P_min)^-beta``
with ``P_min`` over the starts that can be drawn. The draws come from :class:`SumMinTree`,
the compiled 8-ary sum and min tree of kernels/sum_tree.py (docs/internals.md, "The sum tree").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from shardreplay.kernels.codes import ARITY
from shardreplay.kernels.lazy import lazy
from shardreplay.samplers.base import Draw, check_state_keys, state_error
from shardreplay.samplers.schedules import Schedule, is_real
from shardreplay.storage import StreamStorage

if TYPE_CHECKING:
    from shardreplay.kernels import sum_tree as tree_kernels
else:  # numba loads on the first compiled call, not on import (kernels/lazy.py)
    tree_kernels = lazy("shardreplay.kernels.sum_tree")


_NONE = np.zeros(0, np.float32)  # set_from_priorities without new priorities


def _aligned_zeros(n: int, fill: float = 0.0) -> np.ndarray:
    """A float64 array of ``n`` values starting on a 64-byte boundary (a group of 8
    children is then one cache line)."""
    raw = np.zeros(n + 8) if fill == 0.0 else np.full(n + 8, fill)  # zeros: pages untouched until written
    skip = (-raw.ctypes.data % 64) // 8
    return raw[skip:skip + n]


def _levels(n_leaves: int) -> tuple[np.ndarray, np.ndarray]:
    """Sizes and offsets (multiples of 8, for alignment) of the levels, root first."""
    sizes = [max(n_leaves, 1)]
    while sizes[-1] > 1 or len(sizes) == 1:
        sizes.append(-(-sizes[-1] // ARITY))
    sizes.reverse()
    offsets, at = [], 0
    for s in sizes:
        offsets.append(at)
        at += -(-s // ARITY) * ARITY
    offsets.append(at)
    return np.array(sizes, np.int64), np.array(offsets, np.int64)


class SumMinTree:
    """Sum of leaves, prefix search, and the minimum positive leaf.

    Args:
        n_leaves: number of leaves (slots); all start at 0.
    """

    def __init__(self, n_leaves: int) -> None:
        self.n_leaves = n_leaves
        self.sizes, self.offsets = _levels(n_leaves)
        self.levels = int(self.sizes.shape[0])
        self.sums = _aligned_zeros(int(self.offsets[-1]))
        self.leaf_offset = int(self.offsets[-2])
        self.mins = _aligned_zeros(self.leaf_offset, np.inf)  # the levels above the leaves

    @property
    def total(self) -> float:
        """Sum of all leaves."""
        return float(self.sums[0])

    @property
    def min_positive(self) -> float:
        """Smallest positive leaf (inf when every leaf is 0)."""
        return float(self.mins[0])

    def leaves(self, idx: np.ndarray) -> np.ndarray:
        """Values of leaves ``idx``."""
        return self.sums[self.leaf_offset + idx]

    def rebuild(self, values: np.ndarray) -> None:
        """Set every leaf at once from ``values`` (length ``n_leaves``), bottom up."""
        self.sums[:] = 0.0
        self.sums[self.leaf_offset:self.leaf_offset + self.n_leaves] = values
        self.mins[:] = np.inf
        tree_kernels.rebuild(self.sums, self.mins, self.sizes, self.offsets)


class PrioritizedSampler:
    """Proportional prioritized sampling with a sum tree over every slot.

    A slot's leaf is ``p^alpha`` while a window starting there is valid, else 0.
    """

    name = "prioritized"

    def __init__(self, storage: StreamStorage, alpha: float, beta: Schedule) -> None:
        self.storage = storage
        self.alpha = float(alpha)
        self.beta = beta
        self.tree = t = SumMinTree(storage.size)
        self._set_args = (t.sums, t.mins, t.sizes, t.offsets)  # the kernels' tree arguments
        self._draw_args = (t.sums, t.mins, t.offsets, t.levels)
        self.max_priority = 1.0
        self.draws = 0  # position on the beta schedule

    def default_priority(self) -> float:
        """The largest priority seen so far."""
        return self.max_priority

    def note_priorities(self, priorities: np.ndarray) -> None:
        """Raise the running maximum with written or updated priorities."""
        if priorities.size:
            self.max_priority = max(self.max_priority, float(priorities.max()))

    def on_write(self, slots: np.ndarray, valid: np.ndarray, newly: np.ndarray) -> None:
        """Set the leaves of recomputed slots from their stored priority and validity."""
        self.update(slots, _NONE)

    def num_samplable(self) -> int:
        """Valid starts, or 0 when their total priority is 0 (nothing can be drawn)."""
        return self.storage.num_valid if self.tree.total > 0 else 0

    def mass(self) -> float:
        """Sum of ``p^alpha`` over valid starts."""
        return self.tree.total

    def current_beta(self) -> float:
        """Beta at the current position of its schedule."""
        return float(self.beta(self.draws))

    def min_leaf(self) -> float:
        """Smallest positive ``p^alpha`` among valid starts (inf when none)."""
        return self.tree.min_positive

    def draw(self, n: int, rng: np.random.Generator, advance: bool = True) -> Draw:
        """``n`` i.i.d. starts with ``P(i)`` proportional to ``p_i^alpha``.

        ``advance`` moves the beta schedule one call forward.
        """
        beta = self.current_beta()
        self.draws += int(advance)
        rows = self.storage.sample_rows  # the drawn windows' storage, prefetched for the gather
        return Draw(*tree_kernels.draw_weighted(*self._draw_args, rng.random(n), beta, rows))

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Store new raw priorities (float32) and refresh the leaves of valid slots."""
        st = self.storage  # the kernel stores the priorities too
        top = tree_kernels.set_from_priorities(*self._set_args, slots, st.valid, st.priority, self.alpha,
                                               priorities)
        self.max_priority = max(self.max_priority, top)

    def update_keys(self, keys: np.ndarray, priorities: np.ndarray, marks: np.ndarray,
                    applied: int) -> tuple[int, int, int]:
        """:meth:`update` of the slots of ``keys`` (int64 keys of shard 0; float32
        ``priorities``) that are not stale, stamping their blocks in ``marks`` (see
        ``kernels/sum_tree.set_from_keys``). Returns ``(status, bad, n)``: a
        ``kernels/keys`` status, the first bad entry and the number applied; nothing
        changes unless the status is ``OK``."""
        st = self.storage
        status, bad, n, top = tree_kernels.set_from_keys(
            *self._set_args, keys, priorities, st.generation, st.key_epoch, st.key_tag, st.valid, st.priority,
            self.alpha, marks, applied)
        self.max_priority = max(self.max_priority, top)
        return status, bad, n

    def rebuild(self) -> None:
        """Recompute every leaf from stored priorities and validity."""
        # p > 0 as in the write path: with alpha = 0, 0**0 = 1 would make priority 0 drawable.
        leaves = tree_kernels.leaves_from_priorities(self.storage.valid, self.storage.priority, self.alpha)
        self.tree.rebuild(leaves)

    def state_dict(self) -> dict[str, Any]:
        """Max priority, schedule position, alpha and beta schedule."""
        return {"max_priority": self.max_priority, "draws": self.draws, "alpha": self.alpha,
                "beta": self.beta.to_dict()}

    def check_state(self, state: Mapping[str, Any], steps: Mapping[str, np.ndarray]) -> None:
        """Check a state of :meth:`state_dict` completely, changing nothing.

        Raises:
            ConfigError: ``max_priority`` not a finite number > 0, ``draws`` (the beta
                schedule position) not an integer >= 0, ``alpha`` or ``beta`` (when
                present) not what ``state_dict`` writes, or entries missing or unknown.
        """
        check_state_keys(self.name, state, ("max_priority", "draws"), ("alpha", "beta"))
        mp = state["max_priority"]
        if not is_real(mp) or not 0.0 < float(mp) < np.inf:
            raise state_error(self.name, "max_priority", "a finite number > 0", mp)
        draws = state["draws"]
        if not isinstance(draws, int | np.integer) or isinstance(draws, bool) or draws < 0:
            raise state_error(self.name, "draws", "an integer >= 0 (beta schedule position)", draws)
        alpha = state.get("alpha", 0.0)
        if not is_real(alpha) or not 0.0 <= float(alpha) <= 10.0:
            raise state_error(self.name, "alpha", "a number in [0, 10]", alpha)
        if "beta" in state and not _is_beta_dict(state["beta"]):
            raise state_error(self.name, "beta", "a schedule dict of values in [0, 1] "
                              "(from LinearSchedule/ConstantSchedule.to_dict())", state["beta"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore max priority and schedule position; alpha and beta stay as constructed.

        Raw priorities are stored per step, so a buffer built with another alpha or beta
        schedule restores correctly under its own settings.
        """
        self.max_priority = float(state["max_priority"])
        self.draws = int(state["draws"])


def _is_beta_dict(d: Any) -> bool:
    """A ``to_dict()`` of a beta schedule whose values lie in ``[0, 1]``."""
    if not isinstance(d, Mapping):
        return False
    ends: tuple[Any, ...]
    if d.get("kind") == "linear" and d.keys() == {"kind", "start", "end", "steps"}:
        ends, steps = (d["start"], d["end"]), d["steps"]
        if not isinstance(steps, int | np.integer) or isinstance(steps, bool) or steps < 1:
            return False
    elif d.get("kind") == "constant" and d.keys() == {"kind", "value"}:
        ends = (d["value"],)
    else:
        return False
    return all(is_real(v) and 0.0 <= float(v) <= 1.0 for v in ends)
