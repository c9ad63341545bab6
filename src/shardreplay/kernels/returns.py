"""Compiled running episode returns of ingested chunks."""

from __future__ import annotations

import numba

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)

FIRST, LAST = 0, 2


@numba.njit(cache=True, nogil=True)
def track_returns(rows, reward, step_type, running, last_return, finished):
    """Running returns of a chunk's streams, step by step in time order: a FIRST resets
    its row's sum, a LAST records it (into ``finished``, in order, and ``last_return``),
    every other step adds its reward. ``rows``, ``reward`` and ``step_type`` are a chunk's
    ``[n]`` stream rows and ``[n, T]`` steps; ``running`` and ``last_return`` are per
    row. Returns how many episodes finished."""
    n = 0
    for t in range(step_type.shape[1]):
        for i in range(step_type.shape[0]):
            r = rows[i]
            kind = step_type[i, t]
            if kind == FIRST:
                running[r] = 0.0
            if kind == LAST:
                finished[n] = running[r]
                n += 1
                last_return[r] = running[r]
            else:
                running[r] += reward[i, t]
    return n
