"""Compiled kernels for per-step bookkeeping: episode ids, generations, window validity
(docs/semantics.md, sampling rule 1; which starts a write re-checks: docs/internals.md,
"Stream storage")."""

from __future__ import annotations

import numba
from numba import literal_unroll

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)
from shardreplay.kernels.copy import copy_small_or_at

FIRST, MID, LAST = 0, 1, 2


@numba.njit(cache=True, nogil=True, inline="always")
def _is_valid_at(step_type, episode_id, base, off, q, p1, cap, window):
    """Validity of absolute start ``q`` (at ``off = q % cap``) in the row whose flat offset
    is ``base``. Slots advance by increment-and-wrap (no int64 modulo per step)."""
    if window == 1:
        return True
    slot = base + off
    if step_type[slot] == LAST:
        return False
    ep = episode_id[slot]
    for k in range(1, window):
        if q + k >= p1:
            return False
        off = 0 if off + 1 == cap else off + 1
        nxt = base + off
        if episode_id[nxt] != ep:
            return False
        if step_type[nxt] == LAST:
            return True
    return True


@numba.njit(cache=True, nogil=True)
def write_steps(step_type, episode_id, generation, priority, valid, pos, counters,
                rows, types, prios, has_prios, default_prio, cap, window, out_slots, out_flags):
    """Record ``T`` new steps for each of ``rows`` and refresh window validity.

    Arrays ``step_type, episode_id, generation, priority, valid`` are flat ``[S*C]``;
    ``pos`` is the absolute next position per row; ``counters[0]`` is the next episode
    id. ``types`` and ``prios`` are ``[len(rows), T]``. Results go to scratch arrays the
    caller owns (so nothing is allocated per call):
    ``out_slots[0, :len(rows) * T]`` the flat slots written (row-major),
    ``out_slots[1, :n]`` the flat slots whose validity was recomputed, ``out_flags[0, :n]``
    their new validity and ``out_flags[1, :n]`` whether each became valid just now,
    with ``n = len(rows) * (T + window - 1)`` at most. Returns ``n`` and the change in the
    number of valid starts.
    """
    n_rows, t_len = types.shape
    n_out = 0
    delta = 0
    for i in range(n_rows):
        r = rows[i]
        base = r * cap
        p0 = pos[r]
        off = p0 % cap  # slots advance by increment-and-wrap (see _is_valid_at)
        prev_off = off - 1 if off > 0 else cap - 1
        for t in range(t_len):
            p = p0 + t
            slot = base + off
            out_slots[0, i * t_len + t] = slot
            st = types[i, t]
            if p == 0 or st == FIRST:
                new_ep = True
            else:
                prev = base + prev_off
                new_ep = step_type[prev] == LAST
                if not new_ep:
                    episode_id[slot] = episode_id[prev]
            if new_ep:
                episode_id[slot] = counters[0]
                counters[0] += 1
            step_type[slot] = st
            generation[slot] += 1
            priority[slot] = prios[i, t] if has_prios else default_prio
            if valid[slot]:
                valid[slot] = False
                delta -= 1
            prev_off = off
            off = 0 if off + 1 == cap else off + 1
        p1 = p0 + t_len
        pos[r] = p1
        lo = max(p0 - window + 1, p1 - cap, 0)
        off = lo % cap
        for q in range(lo, p1):
            slot = base + off
            was = valid[slot] and q < p0
            now = _is_valid_at(step_type, episode_id, base, off, q, p1, cap, window)
            off = 0 if off + 1 == cap else off + 1
            out_slots[1, n_out] = slot
            out_flags[0, n_out] = now
            out_flags[1, n_out] = now and not was
            n_out += 1
            if now != valid[slot]:
                delta += 1 if now else -1
                valid[slot] = now
    return n_out, delta


@numba.njit(cache=True, nogil=True, boundscheck=False)
def scatter_fields(pairs, slots):  # pragma: no cover - compiled
    """Every field of a write in one call: each of ``pairs`` is ``(dst, value)``, ``dst``
    a ``[N, k]`` uint8 view with contiguous rows, ``value`` C-contiguous with
    ``len(slots)`` steps of ``k`` bytes each; step ``i`` goes to row ``slots[i]`` of
    ``dst`` (every slot below ``N``)."""
    n = slots.shape[0]
    for pair in literal_unroll(pairs):
        dst, value = pair
        stride, k = dst.strides[0], dst.shape[1]
        for i in range(n):
            copy_small_or_at(dst, slots[i] * stride, value, i * k, k)


@numba.njit(cache=True, nogil=True)
def rows_distinct_in_range(rows, num_streams, marks):  # pragma: no cover - compiled
    """True when every row is in ``[0, num_streams)`` and none repeats. ``marks`` is a
    zeroed uint8 scratch of ``num_streams`` entries, left zeroed on return."""
    n = rows.shape[0]
    done = 0  # rows marked, each in range and new
    while done < n and 0 <= rows[done] < num_streams and not marks[rows[done]]:
        marks[rows[done]] = 1
        done += 1
    for i in range(done):
        marks[rows[i]] = 0
    return done == n and n > 0


@numba.njit(cache=True, nogil=True)
def recompute_validity(step_type, episode_id, valid, pos, cap, window):
    """Recompute ``valid`` for every stored start (after a load); returns the count."""
    count = 0
    for r in range(pos.shape[0]):
        base = r * cap
        p1 = pos[r]
        for q in range(max(p1 - cap, 0), p1):
            ok = _is_valid_at(step_type, episode_id, base, q % cap, q, p1, cap, window)
            valid[base + q % cap] = ok
            count += ok
    return count
