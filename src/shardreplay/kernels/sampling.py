"""Compiled rejection step of uniform sampling."""

from __future__ import annotations

import numba


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
