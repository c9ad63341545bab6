"""Compiled n-step returns of sampled windows (buffer/transitions.py states the formulas)."""

from __future__ import annotations

import numba

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)


@numba.njit(cache=True, nogil=True)
def nstep_scalar(idx, mask, reward, discount, gamma, n, ret, boot, m_out, last):
    """n-step returns of windows of slots ``idx [B, L]`` (mask ``[B, L]``) for a scalar
    reward field: ``m`` = steps summed (at most ``n``, fewer when the window ends),
    ``ret = sum_{k<m} gamma^k prod_{i=1..k} d_i r_k`` with ``d`` the discounts,
    ``boot = gamma^m prod_{i=1..m} d_i``, and ``last`` the slot of step ``m``; written
    into ``ret``, ``boot``, ``m_out`` and ``last``."""
    for b in range(idx.shape[0]):
        m = n
        for k in range(1, n + 1):
            if not mask[b, k]:
                m = k - 1
                break
        total = 0.0
        factor = 1.0  # gamma^k * prod_{i=1..k} d_i
        for k in range(m):
            total += factor * reward[idx[b, k]]
            factor *= gamma * discount[idx[b, k + 1]]
        ret[b] = total
        boot[b] = factor
        m_out[b] = m
        last[b] = idx[b, m]
