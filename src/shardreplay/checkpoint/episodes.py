"""Episodes of a shard's exported steps (row after row in time order), and the policy for
partial ones (``seal`` or ``drop``: docs/semantics.md, "Partial episodes").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardreplay.buffer.shard import SEQUENCE_STEP_ARRAYS, Shard
from shardreplay.checkpoint.refs import AnyPartReader, saved_seals
from shardreplay.spec import StepType

PARTIAL_POLICIES = ("seal", "drop")
SEALS = ("seal.index", "seal.step_type", "seal.discount", "sealed.step_type", "sealed.discount")


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

    def ends(self) -> np.ndarray:
        """Each episode's first step, then each one's last step (indices of exported steps)."""
        return np.append(self.start, self.start + self.length - 1)


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

    Returns the new arrays (``row_length`` adjusted for drops; the table, :func:`seal_ends`),
    their episode table, and counts ``{partial_episodes, partial_steps}`` plus ``sealed_*`` or ``dropped_*``.
    """
    out = dict(arrays)
    eps = find_episodes(arrays["step_type"], arrays["episode_id"], arrays["row_length"])
    if policy == "seal" or not eps.partial.any():
        ends = eps.ends()
        seals = seal_ends(eps, arrays["step_type"][ends], arrays["discount"][ends])
        for name in ("step_type", "discount") if seals else ():  # sealed copies
            out[name] = arrays[name].copy()
            out[name][seals["seal.index"]] = seals.pop(f"sealed.{name}")
        return {**out, **eps.as_arrays(), **seals}, eps, _report(eps, "sealed")
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
    kept = find_episodes(out["step_type"], out["episode_id"], out["row_length"])
    return {**out, **kept.as_arrays()}, kept, _report(eps, "dropped")


def _report(eps: Episodes, done: str) -> dict[str, int]:
    n, steps = int(eps.partial.sum()), int(eps.length[eps.partial].sum())
    return {"partial_episodes": n, "partial_steps": steps, "sealed_episodes": 0, "sealed_steps": 0,
            "dropped_episodes": 0, "dropped_steps": 0, f"{done}_episodes": n, f"{done}_steps": steps}


def seal_ends(eps: Episodes, types: np.ndarray, discounts: np.ndarray) -> dict[str, np.ndarray]:
    """The steps sealing changes (``seal.index``), as written (``seal.*``: a restore onto the same
    shards puts them back) and sealed (``sealed.*``), from their values at each first, then last step."""
    n, steps = eps.start.shape[0], eps.ends()
    sealed = np.repeat(np.array([StepType.FIRST, StepType.LAST], types.dtype), n)  # LAST: discount 1
    change = np.tile(eps.partial, 2) & (types != sealed)
    change[:n] &= eps.length > 1
    take = np.flatnonzero(change)[np.argsort(steps[change])]
    values = (steps, types, discounts, sealed, np.where(sealed == StepType.LAST, 1, discounts))
    return {k: v[take] for k, v in zip(SEALS, values, strict=True)} if take.shape[0] else {}


def continue_episodes(previous: AnyPartReader, own: Mapping[str, np.ndarray], start: np.ndarray,
                      shard: Shard) -> tuple[dict[str, Any], Episodes, dict[str, int]]:
    """:func:`apply_partial_policy` (seal) of a part continuing ``previous``: its table before ``start``
    (as it was: the ring writes at its end), the ``own`` steps after, and the first steps the ring cut
    read from ``shard``."""
    first, length, row, ident, pos, lens = (previous.array(k).astype(np.int64) for k in (
        "episode.start", "episode.length", "episode.row", "episode.id", "row_pos", "row_length"))
    seal_at, seal_type, seal_discount = (np.append(x, pad) for x, pad in zip(  # 1: a discount no seal reads
        saved_seals(previous, int(lens.sum())), (-1, 0, 1), strict=True))
    hi = own["row_pos"].astype(np.int64)
    lo, mine, shift = hi - own["row_length"], hi - start, np.cumsum(own["row_length"]) - hi  # shift: to index
    a = first + (pos - np.cumsum(lens))[row]  # its first absolute step
    b = np.minimum(a + length, start[row])  # its end before the own steps
    k = np.flatnonzero(b > np.maximum(a, lo[row]))  # still stored there
    ends = np.append(first[k], first[k] + length[k] - 1)  # as written: seal.*, else as sealed
    at, sealed = np.searchsorted(seal_at[:-1], ends), np.append(length[k] > 1, np.zeros(k.shape, bool))
    types = np.where(seal_at[at] == ends, seal_type[at], np.where(sealed, StepType.FIRST, StepType.LAST))
    disc = np.where(seal_at[at] == ends, seal_discount[at], 1)
    row, a, b = row[k], a[k], b[k]
    read = np.flatnonzero((a < lo[row]) | (b == start[row]))
    a = np.maximum(a, lo[row])
    slots = row[read] * shard.stream_capacity + a[read] % shard.stream_capacity
    stored = shard.arrays()
    types[read], disc[read] = stored["step_type"][slots], stored["discount"][slots]
    # Each earlier episode as its first and last step, then the own steps: in the part's order.
    steps = np.concatenate((a + shift[row], b - 1 + shift[row], ranges(start + shift, mine)))
    order = np.argsort(steps, kind="stable")
    steps, types, disc = steps[order], *(np.append(x, own[y])[order].astype(own[y].dtype) for x, y in (
        (types, "step_type"), (disc, "discount")))
    runs = find_episodes(types, np.append(np.tile(ident[k], 2), own["episode_id"])[order],
                         2 * np.bincount(row, minlength=hi.shape[0]) + mine)
    ends = runs.ends()
    eps = replace(runs, start=steps[runs.start], length=steps[ends[len(runs.start):]] - steps[runs.start] + 1)
    return {**own, **eps.as_arrays(), **seal_ends(eps, types[ends], disc[ends])}, eps, _report(eps, "sealed")


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[s0, s0+1, .., s0+l0-1, s1, ..]``: the indices of runs."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
