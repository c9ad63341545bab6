"""Compiled rejection steps of uniform sampling."""

from __future__ import annotations

import numba
import numpy as np

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)


@numba.njit(cache=True, nogil=True)
def accept_valid(candidates, valid, out, got):
    """Append the candidates ``c`` with ``valid[c]`` to ``out[got:]`` in order, until it
    is full; returns the new fill count."""
    for c in candidates:
        if got == out.shape[0]:
            break
        if valid[c]:
            out[got] = c
            got += 1
    return got


@numba.njit(cache=True, nogil=True)
def accept_written(ordinals, ends, cap, valid, out, got):
    """As :func:`accept_valid`, for candidates given as ordinals of the written slots:
    row ``r`` holds ordinals ``ends[r-1] .. ends[r] - 1`` (``ends``: cumulative written
    counts, ``ends[-1] > 0``), its slots start at ``r * cap``."""
    rows = ends.shape[0]
    length = ends[0]
    aligned = True  # every row holds as many: a division instead of a search
    for r in range(1, rows):
        if ends[r] - ends[r - 1] != length:
            aligned = False
            break
    for u in ordinals:
        if got == out.shape[0]:
            break
        if aligned:
            row = u // length
            slot = row * cap + u - row * length
        else:
            row = np.searchsorted(ends, u, side="right")
            slot = row * cap + u - (ends[row - 1] if row > 0 else 0)
        if valid[slot]:
            out[got] = slot
            got += 1
    return got
