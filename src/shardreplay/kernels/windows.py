"""The compiled gather of whole windows from the per-slot records
(``StreamStorage.windows``; docs/internals.md, "Window gathers")."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import literal_unroll

from shardreplay.kernels import cache_lock
from shardreplay.kernels.copy import copy_1, copy_2, copy_4, copy_8, copy_small_or_at
from shardreplay.kernels.keys import encode_key

__all__ = ["CAP", "DST", "EPOCH", "KEYS_AT", "MASK_AT", "OFFSET", "PARTS", "PART_WORDS", "SIZE", "TAG",
           "WINDOW", "gather_window_parts", "gather_windows"]

LAST = 2
# ``params`` (int64): the ring, the window, the key epoch and tag, where the mask
# ([B, L] bool) and the keys ([B] int64) start in the output bytes, the number of record
# parts; then per part its byte offset in a record, its bytes per step, and where its
# block ([B, L, bytes]) starts in the output bytes.
CAP, WINDOW, EPOCH, TAG, MASK_AT, KEYS_AT, N_PARTS = 0, 1, 2, 3, 4, 5, 6
PARTS = 7
OFFSET, SIZE, DST = 0, 1, 2
PART_WORDS = 3
_OPTIONS: dict[str, Any] = {**cache_lock.SMALL_CALL, "boundscheck": False}


@numba.njit(inline="always", **_OPTIONS)
def _row_base(s, cap, inv_cap):  # pragma: no cover - compiled
    """``s - s % cap`` without an integer division (tens of cycles each, three per
    window before): a float estimate of ``s // cap``, corrected by one either way."""
    row = np.int64(s * inv_cap)
    if row * cap > s:
        row -= 1
    elif (row + 1) * cap <= s:
        row += 1
    return row * cap


@numba.njit(inline="always", **_OPTIONS)
def _copy_small(dst, dst_at, src, src_at, size):  # pragma: no cover - compiled
    """Copy ``size`` bytes (a record part: at most ``SMALL_FIELD_BYTES``) as 8-, 4-, 2-
    and 1-byte moves: a ``memcpy`` call of a size not known when compiling costs more
    than the copy."""
    o = 0
    while o + 8 <= size:
        copy_8(dst, dst_at + o, src, src_at + o)
        o += 8
    if o + 4 <= size:
        copy_4(dst, dst_at + o, src, src_at + o)
        o += 4
    if o + 2 <= size:
        copy_2(dst, dst_at + o, src, src_at + o)
        o += 2
    if o < size:
        copy_1(dst, dst_at + o, src, src_at + o)


@numba.njit(**_OPTIONS)
def gather_windows(starts, step_type, generation, records, params, dst, idx):  # pragma: no cover - compiled
    """Gather the windows starting at flat slots ``starts [B]`` from ``records`` (the
    per-slot records as uint8 rows ``[N, record bytes]``; ``step_type`` and
    ``generation`` are their columns) into ``dst`` (uint8, laid out by ``params``), and
    write each window's slots into ``idx [B * L]`` (positions after a LAST repeat its
    slot, as the mask says)."""
    n, window, cap = starts.shape[0], params[WINDOW], params[CAP]
    epoch, tag = params[EPOCH], params[TAG]
    inv_cap = 1.0 / cap
    mask_at = params[MASK_AT]
    keys = dst[params[KEYS_AT]:params[KEYS_AT] + 8 * n].view(np.int64)
    for b in range(n):
        s = starts[b]
        keys[b] = encode_key(0, tag, s, np.int64(generation[np.uint64(s)]) + epoch)
        base = _row_base(s, cap, inv_cap)
        slot = s - base
        ended = False
        cur = s
        row = np.uint64(mask_at + b * window)  # unsigned indices: no wraparound test per access
        for k in range(window):
            if ended:
                dst[row + np.uint64(k)] = 0
            else:
                dst[row + np.uint64(k)] = 1
                q = slot + k  # < 2 * cap: the window fits the ring
                cur = base + (q - cap if q >= cap else q)
                if 0 < k < window - 1:
                    ended = step_type[np.uint64(cur)] == LAST
            idx[np.uint64(b * window + k)] = cur
    record_bytes = records.shape[1]
    for p in range(params[N_PARTS]):  # a part at a time: its size fixed in the inner loop
        at = PARTS + p * PART_WORDS
        offset, size, block = params[at + OFFSET], params[at + SIZE], params[at + DST]
        for j in range(n * window):
            _copy_small(dst, block + j * size, records, idx[np.uint64(j)] * record_bytes + offset, size)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def gather_window_parts(sources, out_offset, idx, dst_rows, out):  # pragma: no cover - compiled
    """For every part ``p``, window ``b`` and position ``l``: copy row ``idx[b, l]`` of
    ``sources[p]`` (a ``[N, k]`` uint8 view with contiguous rows) to row ``dst_rows[b]``
    of ``out`` (C-contiguous uint8 records), at byte ``out_offset[p] + l * k``. One part
    at a time (one access stream at a time suits the hardware prefetchers).

    The caller keeps slots below ``N`` and every part inside a record."""
    n, window = idx.shape
    out_stride = out.strides[0]
    p = 0
    for src in literal_unroll(sources):
        stride, size, offset = src.strides[0], src.shape[1], out_offset[p]
        for b in range(n):
            row = dst_rows[b] * out_stride + offset
            for pos in range(window):
                copy_small_or_at(out, row + pos * size, src, idx[b, pos] * stride, size)
        p += 1  # noqa: SIM113 - numba cannot enumerate a literal_unroll
