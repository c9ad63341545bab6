"""Compiled kernels for per-step bookkeeping: episode ids, generations, window validity.

A window start ``q`` of a stream is **valid** (docs/semantics.md, sampling rule 1) when step ``q``
is stored, is not LAST (for ``L >= 2``), and the steps ``q .. q+L-1`` are stored and in
``q``'s episode, or the episode ends (LAST) inside the window::

    L = 3        q   q+1  q+2
    full         MID MID  MID    valid (all three stored, one episode)
    closed       MID LAST  .     valid (mask: T T F)
    incomplete   MID MID  <not yet written>         invalid until q+2 arrives
    abandoned    MID FIRST ...   invalid forever (next episode, no LAST)

Writing positions ``p0 .. p1-1`` of a stream can change validity only for starts
``max(p0-L+1, p1-C, 0) .. p1-1``: earlier windows that now complete, and the written
slots themselves (their old occupants are gone).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import literal_unroll
from numba.core import cgutils, types
from numba.extending import intrinsic

from shardreplay.spec.keys import GEN_MASK, LOCAL_MASK, PLACE_MASK, PLACE_SHIFT, TAG_MASK, TAG_SHIFT

FIRST, MID, LAST = 0, 1, 2


def _memcpy(builder, dst, src, count):  # pragma: no cover - runs while compiling
    byte_ptr = ir.IntType(8).as_pointer()
    cgutils.raw_memcpy(builder, builder.inttoptr(dst, byte_ptr), builder.inttoptr(src, byte_ptr),
                       count, 1)


@intrinsic
def copy_bytes(typingctx, dst_address, src_address, nbytes):  # pragma: no cover - compiled
    """``memcpy(dst_address, src_address, nbytes)`` inside compiled code: a row copy at
    memory speed, where a loop over bytes runs ~10x slower (it is not vectorised)."""
    def codegen(context, builder, signature, args):
        _memcpy(builder, *args)
        return context.get_dummy_value()
    return types.void(types.intp, types.intp, types.intp), codegen


def _copy_of(size: int) -> Any:
    """An intrinsic copying ``size`` bytes: a constant size compiles to one load and
    store instead of a call (small fields are copied millions of times per exchange)."""
    @intrinsic
    def copy(typingctx, dst_address, src_address):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            _memcpy(builder, *args, ir.Constant(ir.IntType(64), size))
            return context.get_dummy_value()
        return types.void(types.intp, types.intp), codegen
    return copy


copy_1, copy_2, copy_4, copy_8 = (_copy_of(n) for n in (1, 2, 4, 8))


@numba.njit(cache=True, nogil=True, inline="always")
def copy_small_or_bytes(dst_address, src_address, nbytes):  # pragma: no cover - compiled
    """:func:`copy_bytes`, with the common field sizes inlined."""
    if nbytes == 8:
        copy_8(dst_address, src_address)
    elif nbytes == 4:
        copy_4(dst_address, src_address)
    elif nbytes == 1:
        copy_1(dst_address, src_address)
    elif nbytes == 2:
        copy_2(dst_address, src_address)
    else:
        copy_bytes(dst_address, src_address, nbytes)


@numba.njit(cache=True, nogil=True, inline="always")
def _is_valid_at(step_type, episode_id, base, off, q, p1, cap, window):
    """Validity of absolute start ``q`` (at ``off = q % cap``) in the row whose flat offset
    is ``base``. Slots advance by increment-and-wrap: an int64 modulo per step cost
    more than the rest of the bookkeeping."""
    if window == 1:
        return True
    slot = base + off
    if step_type[slot] == LAST:
        return False
    ep = episode_id[slot]
    for k in range(1, window):
        if q + k >= p1:
            return False
        off += 1
        if off == cap:
            off = 0
        nxt = base + off
        if episode_id[nxt] != ep:
            return False
        if step_type[nxt] == LAST:
            return True
    return True


@numba.njit(cache=True, nogil=True)
def _is_valid(step_type, episode_id, base, q, p1, cap, window):
    """Validity of absolute start ``q`` in the row whose flat offset is ``base``."""
    return _is_valid_at(step_type, episode_id, base, q % cap, q, p1, cap, window)


@numba.njit(cache=True, nogil=True)
def write_steps(step_type, episode_id, generation, priority, valid, pos, counters,
                rows, types, prios, has_prios, default_prio, cap, window, out_slots, out_flags):
    """Record ``T`` new steps for each of ``rows`` and refresh window validity.

    Arrays ``step_type, episode_id, generation, priority, valid`` are flat ``[S*C]``;
    ``pos`` is the absolute next position per row; ``counters[0]`` is the next episode
    id. ``types`` and ``prios`` are ``[len(rows), T]``. Results go to scratch arrays the
    caller owns (returning new arrays costs more than the bookkeeping itself):
    ``out_slots[0, :len(rows) * T]`` the flat slots written (row-major),
    ``out_slots[1, :n]`` the flat slots whose validity was recomputed, ``out_flags[0, :n]``
    their new validity and ``out_flags[1, :n]`` whether each became valid just now,
    with ``n = len(rows) * (T + window - 1)`` at most. Returns ``n`` and the change in the
    number of valid starts.
    """
    n_rows, t_len = types.shape
    written = out_slots[0]
    recomputed = out_slots[1]
    out_valid = out_flags[0]
    out_new = out_flags[1]
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
            written[i * t_len + t] = slot
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
            off += 1
            if off == cap:
                off = 0
        p1 = p0 + t_len
        pos[r] = p1
        lo = max(p0 - window + 1, p1 - cap, 0)
        off = lo % cap
        for q in range(lo, p1):
            slot = base + off
            was = valid[slot] and q < p0
            now = _is_valid_at(step_type, episode_id, base, off, q, p1, cap, window)
            off += 1
            if off == cap:
                off = 0
            recomputed[n_out] = slot
            out_valid[n_out] = now
            out_new[n_out] = now and not was
            n_out += 1
            if now != valid[slot]:
                delta += 1 if now else -1
                valid[slot] = now
    return n_out, delta


@numba.njit(cache=True, nogil=True, boundscheck=False)
def scatter_bytes(dst, slots, src):  # pragma: no cover - compiled
    """``dst[slots[i]] = src[i]`` for byte rows: ``dst`` is a ``[N, k]`` uint8 view with
    contiguous rows (records' fields are column slices), ``src`` the ``[n, k]``
    C-contiguous bytes of the values. One compiled call per field instead of numpy's
    fancy-index assignment, which costs 2-5 us per field for a chunk of 256 steps."""
    n, k = src.shape
    dst_at, dst_stride = dst.ctypes.data, dst.strides[0]
    src_at, src_stride = src.ctypes.data, src.strides[0]
    for i in range(n):
        copy_bytes(dst_at + slots[i] * dst_stride, src_at + i * src_stride, k)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def scatter_fields(plan, values, slots):  # pragma: no cover - compiled
    """Every field of a write in one call: for field ``f`` (the ``f``-th array of the
    tuple ``values``, C-contiguous, ``len(slots)`` steps of ``plan[2, f]`` bytes each),
    copy step ``i`` to address ``plan[0, f] + slots[i] * plan[1, f]``. One call per
    chunk instead of one per field saves ~3.5 us of a ~16 us ``extend`` of 256 steps."""
    n = slots.shape[0]
    f = 0
    for value in literal_unroll(values):
        src, base, stride, k = value.ctypes.data, plan[0, f], plan[1, f], plan[2, f]
        for i in range(n):
            copy_small_or_bytes(base + slots[i] * stride, src + i * k, k)
        f += 1  # noqa: SIM113 - numba cannot enumerate a literal_unroll


@numba.njit(cache=True, nogil=True, boundscheck=False)
def gather_window_parts(src_at, src_stride, nbytes, out_offset, idx, dst_rows, out):  # pragma: no cover
    """For every part ``p``, window ``b`` and position ``l``: copy ``nbytes[p]`` bytes of
    slot ``idx[b, l]`` (at address ``src_at[p] + slot * src_stride[p]``) to row
    ``dst_rows[b]`` of ``out`` (C-contiguous uint8 records), at byte
    ``out_offset[p] + l * nbytes[p]``. One part at a time: measured 1.5x faster than all
    parts of a slot together (one access stream at a time suits the prefetchers).

    The caller keeps the source arrays alive and the addresses in bounds."""
    n, window = idx.shape
    out_at, out_stride = out.ctypes.data, out.strides[0]
    for p in range(src_at.shape[0]):
        src, stride, size, offset = src_at[p], src_stride[p], nbytes[p], out_offset[p]
        for b in range(n):
            row = out_at + dst_rows[b] * out_stride + offset
            for pos in range(window):
                copy_small_or_bytes(row + pos * size, src + idx[b, pos] * stride, size)


@numba.njit(cache=True, nogil=True)
def rows_distinct_in_range(rows, num_streams, marks):  # pragma: no cover - compiled
    """True when every row is in ``[0, num_streams)`` and none repeats. ``marks`` is a
    zeroed uint8 scratch of ``num_streams`` entries, left zeroed on return."""
    ok = True
    n = rows.shape[0]
    done = 0
    for i in range(n):
        r = rows[i]
        if r < 0 or r >= num_streams or marks[r]:
            ok = False
            break
        marks[r] = 1
        done += 1
    for i in range(done):
        marks[rows[i]] = 0
    return ok and n > 0


@numba.njit(cache=True, nogil=True)
def all_equal(pos):  # pragma: no cover - compiled
    """True when every entry of ``pos`` equals the first (rows aligned)."""
    for i in range(1, pos.shape[0]):  # noqa: SIM110 - a loop numba compiles (no generators)
        if pos[i] != pos[0]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def recompute_validity(step_type, episode_id, valid, pos, cap, window):
    """Recompute ``valid`` for every stored start (after a load); returns the count."""
    count = 0
    for r in range(pos.shape[0]):
        base = r * cap
        p1 = pos[r]
        for q in range(max(p1 - cap, 0), p1):
            ok = _is_valid(step_type, episode_id, base, q, p1, cap, window)
            valid[base + q % cap] = ok
            count += ok
    return count


@numba.njit(cache=True, nogil=True, inline="always")
def slot_generation(pos, row, slot, cap):
    """Times slot ``slot`` of ``row`` was written: positions ``p < pos[row]`` with
    ``p % cap == slot``. Equal to the stored generation, computed from the (cached)
    row cursor instead of a read of the generation array, which would miss the cache
    for every sampled window."""
    p = pos[row]
    return (p - 1 - slot) // cap + 1 if p > slot else 0


@numba.njit(cache=True, nogil=True)
def window_indices(starts, step_type, pos, cap, window, epoch, tag):
    """Flat slot indices ``[B, L]`` of each window, its mask, and its key (shard 0,
    key ``tag``, place = the flat start; see ``spec/keys.py``).

    A key's generation is the slot's write count plus the storage's key ``epoch``
    (raised by every checkpoint restore, so keys of an earlier life are stale).

    Positions after the window's LAST repeat the LAST step's slot and are masked out.
    A valid start is never LAST (for ``L >= 2``) and a LAST at the window's end masks
    nothing, so only the step types strictly inside the window are read: none for
    ``L = 2``, which saves a cache miss per window.
    """
    n = starts.shape[0]
    idx = np.empty((n, window), np.int64)
    mask = np.ones((n, window), np.bool_)
    keys = np.empty(n, np.int64)
    high = np.int64(tag) << TAG_SHIFT
    for b in range(n):
        s = starts[b]
        row, slot = s // cap, s % cap
        gen = (slot_generation(pos, row, slot, cap) + epoch) & GEN_MASK
        keys[b] = high | (s << PLACE_SHIFT) | gen
    for b in range(n):
        s = starts[b]
        base = s - s % cap
        slot = s - base
        ended = False
        cur = s
        for k in range(window):
            if ended:
                mask[b, k] = False
            else:
                cur = base + (slot + k) % cap
                if 0 < k < window - 1:
                    ended = step_type[cur] == LAST
            idx[b, k] = cur
    return idx, mask, keys


@numba.njit(cache=True, nogil=True)
def resolve_keys(keys, priorities, pos, num_streams, cap, epoch, tag):
    """Check keys and priorities; map keys to flat slots and mark the stale ones
    (generation other than the slot's write count plus the key ``epoch``).

    Returns ``(status, bad, slots, current)``: status 0 when all is well, 1 when
    priority ``bad`` is negative or not finite, 2 when key ``bad`` is not a key of this
    buffer (negative, shard other than 0, another key ``tag``, or a place past the end).
    """
    n = keys.shape[0]
    slots = np.empty(n, np.int64)
    current = np.empty(n, np.bool_)
    for j in range(n):
        p = priorities[j]
        if not (p >= 0.0 and p < np.inf):
            return 1, j, slots, current
        if not key_fits(keys[j], tag, num_streams * cap):
            return 2, j, slots, current
        k = keys[j]
        s = (k >> PLACE_SHIFT) & PLACE_MASK
        slots[j] = s
        row, slot = s // cap, s % cap
        written = slot_generation(pos, row, slot, cap)  # 0: never written, no key names it
        current[j] = written > 0 and ((written + epoch) & GEN_MASK) == (k & GEN_MASK)
    return 0, -1, slots, current


@numba.njit(cache=True, nogil=True, inline="always")
def key_fits(k, tag, size):
    """Whether ``k`` can be a key of a shard-0 buffer with key ``tag`` and ``size``
    slots: not negative, shard 0, the tag, a place below ``size``."""
    return (k >= 0 and (k & LOCAL_MASK) == k and ((k >> TAG_SHIFT) & TAG_MASK) == tag
            and ((k >> PLACE_SHIFT) & PLACE_MASK) < size)


@numba.njit(cache=True, nogil=True)
def keys_fit(keys, tag, size):
    """:func:`key_fits` of every key (bool array)."""
    out = np.empty(keys.shape[0], np.bool_)
    for j in range(keys.shape[0]):
        out[j] = key_fits(keys[j], tag, size)
    return out
