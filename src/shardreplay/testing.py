"""Read-only inspection of a buffer's inner state, for tests (instead of private
attributes). Every function takes a :class:`~shardreplay.ReplayBuffer` or a
:class:`~shardreplay.ShardedReplayBuffer` (then this rank's shard, no collective) and
returns copies. Slots are flat: ``row * stream_capacity + position % stream_capacity``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardreplay.buffer.replay_buffer import ReplayBuffer
from shardreplay.buffer.shard import Shard, shard_of_buffer

__all__ = ["leaf_masses", "positions", "rng_state", "sampler_counters", "shard", "stored",
           "stored_steps", "tree_sums", "valid"]


def shard(buffer: Any) -> Shard:
    """The internal shard of ``buffer`` (for tests of the sharded buffer's and the
    checkpoints' building blocks; its interface is internal and may change).

    Raises:
        TypeError: ``buffer`` is neither a ReplayBuffer nor a ShardedReplayBuffer.
    """
    local = getattr(buffer, "local", buffer)
    if not isinstance(local, ReplayBuffer):
        raise TypeError(f"expected a ReplayBuffer or ShardedReplayBuffer, got {type(buffer).__name__}")
    return shard_of_buffer(local)


def valid(buffer: Any) -> np.ndarray:
    """Per flat slot (bool ``[S*C]``): whether a window may start there."""
    return shard(buffer).arrays()["valid"].copy()


def positions(buffer: Any) -> np.ndarray:
    """Per row (int64 ``[S]``): steps ever written to it."""
    return shard(buffer).positions


def stored(buffer: Any, name: str) -> np.ndarray:
    """The array ``name`` by flat slot ``[S*C, ...]``: a field of the spec (not a
    frame-stacked one), or ``"step_type"``, ``"discount"``, ``"episode_id"``,
    ``"generation"``, ``"priority"`` (raw priorities).

    Raises:
        KeyError: no such array (frame-stacked fields: use :func:`stored_steps`).
    """
    targets = shard(buffer).arrays()
    targets.pop("valid")
    key = name if name in targets else f"field.{name}"
    if key not in targets:
        raise KeyError(f"no stored array {name!r}; there are {sorted(targets)}")
    return targets[key].copy()


def stored_steps(buffer: Any) -> dict[str, np.ndarray]:
    """Every stored step, row after row in time order: ``field.<name>`` per field
    (frame-stacked ones as whole stacks), the per-step arrays, ``row_length`` and
    ``row_pos``."""
    return shard(buffer).export_steps()


def sampler_counters(buffer: Any) -> dict[str, Any]:
    """``{"max_priority", "draws", "beta", "mass", "samplable"}``: the running maximum
    priority (1.0 without priorities), beta-schedule calls so far (0 without priorities),
    the importance-weight exponent now, the sampling mass and the samplable windows."""
    inner = shard(buffer)
    st = inner.stats()
    draws = inner.sampler_state().get("draws", 0)
    return {"max_priority": st.max_priority, "draws": int(draws), "beta": st.beta, "mass": st.mass,
            "samplable": st.samplable}


def tree_sums(buffer: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """The prioritized sampler's sum and min trees (copies), or None without one."""
    tree = shard(buffer).sum_tree
    return None if tree is None else (tree.sums.copy(), tree.mins.copy())


def rng_state(buffer: Any) -> dict[str, Any]:
    """The sampling RNG's bit-generator state."""
    return dict(shard(buffer).rng.bit_generator.state)


def leaf_masses(buffer: Any, starts: np.ndarray) -> np.ndarray:
    """The sampling mass of each flat start: its tree leaf ``p^alpha`` for a prioritized
    buffer, 1.0 otherwise (0 where the start cannot be drawn, prioritized only)."""
    inner = shard(buffer)
    tree = inner.sum_tree
    starts = np.asarray(starts, np.int64)
    return np.ones(starts.shape[0]) if tree is None else np.asarray(tree.leaves(starts))
