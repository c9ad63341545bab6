"""Compiled kernels of frame-stacked fields: plan a write, append frames, rebuild stacks
(the ring layout: docs/internals.md, "Frame rings")."""

from __future__ import annotations

import numba

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)
from shardreplay.kernels import copy as kc
from shardreplay.kernels.copy import STREAM_BYTES, copy_at, misalignment, store_fence, stream_copy_at

FIRST, LAST = 0, 2
OK, INCONSISTENT = 0, 1


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _overlaps_stored(values, offset, frames, row, ref, k):  # pragma: no cover - compiled
    """The ``K-1`` frames from byte ``offset`` of ``values`` equal the last ``K-1`` frames of
    the stored stack of ``row`` ending at ``ref``."""
    fb, cap_frames, start = frames.shape[2], frames.shape[1], row * frames.strides[0]
    for j in range(k - 1):
        at = start + ((ref - k + 2 + j) % cap_frames) * frames.strides[1]
        if not kc.bytes_equal(values, offset + j * fb, frames, at, fb):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def plan_write(values, types, rows, pos, step_type, ref, frames, fpos, cap, new_counts):  # pragma: no cover
    """Frames each step of a write appends, checked before anything is written.

    ``values`` is C-contiguous ``[n, T, K, frame]`` (uint8 frame bytes, or the one-step
    add's stacks of any dtype), ``types`` ``[n, T]``. A step that
    continues its episode (not FIRST, and the step before it in its stream is stored
    and not LAST) must continue that step's stack. Fills ``new_counts[n, T]`` (1 or
    ``K``, by :func:`plan_load`) and returns ``(status, i, t, frames needed)``: status
    ``INCONSISTENT`` names the first offending step; ``frames needed`` is the most frames
    any written stream must keep after the write (from its oldest stored step's stack to
    its newest frame).
    """
    n, t_len, k = values.shape[0], values.shape[1], values.shape[2]
    need = 0
    for i in range(n):
        r = rows[i]
        p0 = pos[r]
        prev_slot = r * cap + (p0 - 1) % cap if p0 > 0 else -1
        added = plan_load(values[i], r, frames, ref, prev_slot, new_counts[i])
        for t in range(t_len):
            if t == 0:
                cont = p0 > 0 and types[i, 0] != FIRST and step_type[prev_slot] != LAST
            else:
                cont = types[i, t] != FIRST and types[i, t - 1] != LAST
            if cont and new_counts[i, t] != 1:
                return INCONSISTENT, i, t, 0
        # The oldest step stored after the write, and the first frame of its stack.
        q = max(p0 + t_len - cap, 0)
        if q >= p0:
            oldest_frame = fpos[r] + new_counts[i, :q - p0 + 1].sum() - k
        else:
            oldest_frame = ref[r * cap + q % cap] - k + 1
        need = max(need, fpos[r] + added - oldest_frame)
    return OK, 0, 0, need


@numba.njit(cache=True, nogil=True, boundscheck=False)
def append_frames(values, rows, written, new_counts, frames, ref, fpos):  # pragma: no cover
    """Append the planned frames of each step and record its ``ref``: step ``(i, t)``
    went to flat slot ``written[i * T + t]``; it appends its newest frame when
    ``new_counts[i, t] == 1``, else its whole stack."""
    n, t_len, k, fb = values.shape[0], values.shape[1], values.shape[2], frames.shape[2]
    cap_frames = frames.shape[1]
    row_stride, frame_stride = frames.strides[0], frames.strides[1]
    vs0, vs1, vs2 = values.strides[0], values.strides[1], values.strides[2]
    for i in range(n):
        r = rows[i]
        p = fpos[r]
        for t in range(t_len):
            first = k - new_counts[i, t]
            for j in range(first, k):
                copy_at(frames, r * row_stride + (p % cap_frames) * frame_stride,
                        values, i * vs0 + t * vs1 + j * vs2, fb)
                p += 1
            ref[written[i * t_len + t]] = p - 1
        fpos[r] = p


@numba.njit(cache=True, nogil=True, boundscheck=False)
def gather_stacks_rows(idx, cap, ref, frames, k, dst_rows, out, offset):  # pragma: no cover
    """Rebuild the stacks of the windows of slots ``idx[B, L]``: window ``b`` goes to row
    ``dst_rows[b]`` of ``out`` (C-contiguous uint8 rows) at byte ``offset``, as
    ``[L, K, frame bytes]``."""
    n, window = idx.shape
    fb = frames.shape[2]
    cap_frames = frames.shape[1]
    row_stride, frame_stride, out_stride = frames.strides[0], frames.strides[1], out.strides[0]
    stream = misalignment(out, offset) == 0 and out_stride % STREAM_BYTES == 0 and fb % STREAM_BYTES == 0
    for b in range(n):
        dst_row = dst_rows[b] * out_stride + offset
        for pos in range(window):
            s = idx[b, pos]
            row = s // cap
            first = ref[s] - k + 1
            for j in range(k):
                src = row * row_stride + ((first + j) % cap_frames) * frame_stride
                if stream:
                    stream_copy_at(out, dst_row + (pos * k + j) * fb, frames, src, fb)
                else:
                    copy_at(out, dst_row + (pos * k + j) * fb, frames, src, fb)
    if stream:
        store_fence()


@numba.njit(cache=True, nogil=True, inline="always")
def plan_load(values, row, frames, ref, prev_slot, counts):  # pragma: no cover - compiled
    """Frames each of ``n`` consecutive steps of one row appends (``values`` uint8 ``[n, K,
    frame bytes]``): one when its stack continues the step before it (the first step's
    predecessor is ``prev_slot``, or none when ``prev_slot < 0``), else ``K``. Fills
    ``counts[n]`` and returns their sum. Episodes are not looked at (:func:`plan_write`
    checks them; a load's steps were checked when first written)."""
    n, k = values.shape[0], values.shape[1]
    fb, step = frames.shape[2], values.strides[0]
    total = 0
    for j in range(n):
        if j == 0:
            same = prev_slot >= 0 and _overlaps_stored(values, 0, frames, row, ref[prev_slot], k)
        else:  # its first K-1 frames are the last K-1 of the step before
            same = kc.bytes_equal(values, j * step, values, (j - 1) * step + fb, (k - 1) * fb)
        counts[j] = 1 if same else k
        total += counts[j]
    return total
