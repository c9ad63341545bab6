"""Episodes of a shard's exported steps (row after row in time order), and the policy for
partial ones (``seal`` or ``drop``: docs/semantics.md, "Partial episodes").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardreplay.buffer.shard import SEQUENCE_STEP_ARRAYS
from shardreplay.spec import StepType

PARTIAL_POLICIES = ("seal", "drop")


@dataclass(frozen=True)
class Episodes:
    """Episode runs of exported steps: start index, length, row, id, and partial flag."""

    start: np.ndarray
    length: np.ndarray
    row: np.ndarray
    episode_id: np.ndarray
    partial: np.ndarray

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The table as arrays named ``episode.*`` (saved with a part)."""
        return {"episode.start": self.start, "episode.length": self.length,
                "episode.row": self.row, "episode.id": self.episode_id}


def find_episodes(step_type: np.ndarray, episode_id: np.ndarray, row_length: np.ndarray) -> Episodes:
    """Split exported steps into episode runs (vectorised)."""
    n, ends = step_type.shape[0], np.cumsum(row_length)
    boundary = np.zeros(n, bool)
    boundary[1:] = episode_id[1:] != episode_id[:-1]
    boundary[(ends - row_length)[row_length > 0]] = True  # each row's first step
    start = np.flatnonzero(boundary).astype(np.int64)
    length = np.diff(np.append(start, n)).astype(np.int64)
    last = start + length - 1
    partial = (step_type[start] != StepType.FIRST) | (step_type[last] != StepType.LAST)
    return Episodes(start, length, np.searchsorted(ends, start, "right").astype(np.int64),
                    episode_id[start].astype(np.int64), partial)


def apply_partial_policy(arrays: Mapping[str, Any], policy: str, start_fields: Collection[str] = (),
                         is_start: np.ndarray | None = None
                         ) -> tuple[dict[str, Any], Episodes, dict[str, int]]:
    """Seal or drop (``policy``, one of :data:`PARTIAL_POLICIES`, checked by the caller)
    partial episodes in a copy of exported step arrays.

    User fields (``field.*``) may be lists of pieces (views): sealing leaves them as
    they are; dropping concatenates and filters them. The ``start_fields`` (``at_starts``
    fields) hold a row per step where ``is_start`` (bool, per exported step) only:
    dropping filters them by the kept start steps.

    Returns the new arrays (``row_length`` adjusted for drops), their episode table,
    and counts ``{partial_episodes, partial_steps}`` plus ``sealed_*`` or ``dropped_*``.
    """
    out = dict(arrays)
    eps = find_episodes(arrays["step_type"], arrays["episode_id"], arrays["row_length"])
    n_eps, n_steps = int(eps.partial.sum()), int(eps.length[eps.partial].sum())
    report = {"partial_episodes": n_eps, "partial_steps": n_steps,
              "sealed_episodes": 0, "sealed_steps": 0, "dropped_episodes": 0, "dropped_steps": 0}
    if n_eps == 0:
        return out, eps, report
    if policy == "seal":
        step_type, discount = arrays["step_type"].copy(), arrays["discount"].copy()
        first, last = eps.start[eps.partial], (eps.start + eps.length - 1)[eps.partial]
        open_end = last[step_type[last] != StepType.LAST]
        step_type[first] = StepType.FIRST
        step_type[last] = StepType.LAST
        discount[open_end] = 1.0
        out["step_type"], out["discount"] = step_type, discount
        report.update(sealed_episodes=n_eps, sealed_steps=n_steps)
        return out, eps, report
    keep = np.ones(arrays["step_type"].shape[0], bool)
    keep[ranges(eps.start[eps.partial], eps.length[eps.partial])] = False
    for name, arr in arrays.items():
        if name in start_fields:
            assert is_start is not None  # given with start_fields
            out[name] = np.asarray(arr)[keep[is_start]]
        elif name.startswith("field.") or name in SEQUENCE_STEP_ARRAYS:
            out[name] = (np.concatenate(arr) if isinstance(arr, list) else arr)[keep]
    dropped_per_row = np.bincount(eps.row[eps.partial], weights=eps.length[eps.partial],
                                  minlength=arrays["row_length"].shape[0]).astype(np.int64)
    out["row_length"] = arrays["row_length"] - dropped_per_row
    report.update(dropped_episodes=n_eps, dropped_steps=n_steps)
    return out, find_episodes(out["step_type"], out["episode_id"], out["row_length"]), report


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[s0, s0+1, .., s0+l0-1, s1, ..]``: the indices of runs."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
