"""The compiled n-step transitions of sampled window starts (buffer/transitions.py calls it):
the formulas of buffer/nstep.py, the key, the bootstrap step's ends, and the bytes of the
observations at the start and the bootstrap step and of the action (shaped as the window
gather: docs/internals.md, "Window gathers")."""

from __future__ import annotations

import numba

from shardreplay.kernels import cache_lock
from shardreplay.kernels.copy import copy_small_or_at
from shardreplay.kernels.keys import encode_key

__all__ = ["CAP", "EPOCH", "GATHER", "PARAMS", "TAG", "WINDOW", "N", "scalar_transitions"]

LAST = 2
# ``params`` (int64): the ring, the window, n, the key epoch and tag; then per gathered
# field (observation at the start, observation at the bootstrap step, action at the start)
# its row stride and offset in the source bytes, its bytes per step (0: not gathered
# here) and where its block starts in the output bytes.
CAP, WINDOW, N, EPOCH, TAG = 0, 1, 2, 3, 4
GATHER = 5
STRIDE, OFFSET, BYTES, DST = 0, 1, 2, 3
GATHER_WORDS = 4
PARAMS = GATHER + 3 * GATHER_WORDS


@numba.njit(inline="always", **cache_lock.SMALL_CALL)
def _gather(params, g, src, slot, dst, b):  # pragma: no cover - compiled
    at = GATHER + g * GATHER_WORDS
    size = params[at + BYTES]
    if size:
        src_at = slot * params[at + STRIDE] + params[at + OFFSET]
        copy_small_or_at(dst, params[at + DST] + b * size, src, src_at, size)


@numba.njit(**cache_lock.SMALL_CALL)
def scalar_transitions(starts, step_type, discount, generation, reward, params, gamma, floats, ints, flags,
                       obs_src, act_src, dst):  # pragma: no cover - compiled
    """n-step transitions of the windows starting at flat slots ``starts [B]`` (a scalar
    reward field ``reward``; ``step_type``, ``discount``, ``generation`` the storage's
    columns).

    Writes ``floats [2, B]`` (the return, the bootstrap discount), ``ints [3, B]``
    (steps summed ``m``, the bootstrap step's slot, the key) and ``flags [2, B]``
    (terminated, truncated), and copies the gathered fields' bytes (``params``) from
    ``obs_src`` / ``act_src`` into ``dst``.
    """
    cap, window, n = params[CAP], params[WINDOW], params[N]
    epoch, tag = params[EPOCH], params[TAG]
    for b in range(starts.shape[0]):
        s = starts[b]
        base = s - s % cap
        slot = s - base
        # m: n, or the first LAST strictly inside the window if it comes before n.
        m = n
        for k in range(1, min(n, window - 2) + 1):
            if step_type[base + (slot + k) % cap] == LAST:
                m = k
                break
        total = 0.0
        factor = 1.0  # gamma^k * prod_{i=1..k} d_i
        cur = s
        for k in range(m):
            nxt = base + (slot + k + 1) % cap
            total += factor * reward[cur]
            factor *= gamma * discount[nxt]
            cur = nxt
        floats[0, b] = total
        floats[1, b] = factor
        ints[0, b] = m
        ints[1, b] = cur
        ints[2, b] = encode_key(0, tag, s, generation[s] + epoch)
        is_last = step_type[cur] == LAST
        ends = discount[cur] == 0
        flags[0, b] = is_last and ends
        flags[1, b] = is_last and not ends
        _gather(params, 0, obs_src, s, dst, b)
        _gather(params, 1, obs_src, cur, dst, b)
        _gather(params, 2, act_src, s, dst, b)
