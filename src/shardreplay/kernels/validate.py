"""Value checks of written steps: NaN/inf in float fields, step types, discounts.

The step rule lives here once, in :func:`step_type_ok` and :func:`discount_ok`, which
every compiled check inlines (their twins: kernels/reference/validate.py). A *plan*
describes steps packed in one byte buffer: int64 rows ``(kind, byte offset, element
count)``, one per checked field, every offset a multiple of 8.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)
from shardreplay.kernels.codes import (
    BAD_DISCOUNT,
    BAD_STEP_TYPE,
    DISCOUNTS,
    F32_EXPONENT,
    F64_EXPONENT,
    FINITE_F32,
    FINITE_F64,
    MAX_STEP_TYPE,
    STEP_TYPES,
    STEPS_OK,
)

__all__ = ["BAD_DISCOUNT", "BAD_STEP_TYPE", "DISCOUNTS", "FINITE_F32", "FINITE_F64", "MAX_STEP_TYPE",
           "STEPS_OK", "STEP_TYPES", "discount_ok", "max_masked", "step_type_ok", "steps_ok", "values_ok"]


@numba.njit(inline="always")
def step_type_ok(t: Any) -> bool:  # pragma: no cover - compiled
    """A step type is FIRST=0, MID=1 or LAST=2."""
    return t >= 0 and t <= MAX_STEP_TYPE


@numba.njit(inline="always")
def discount_ok(d: Any) -> bool:  # pragma: no cover - compiled
    """A discount lies in [0, 1]; NaN fails both comparisons."""
    return d >= 0 and d <= 1


@numba.njit(cache=True, nogil=True, boundscheck=False)
def max_masked(words: np.ndarray, mask: Any) -> Any:  # pragma: no cover - compiled
    """``max(words & mask)`` over a non-empty array: a float whose exponent bits are all
    set (``== mask``) is NaN or inf."""
    # Branch-free over a contiguous slice so that LLVM vectorises it (no early exit).
    acc = words[0] & mask
    for i in range(1, words.shape[0]):
        acc = max(acc, words[i] & mask)
    return acc


@numba.njit(cache=True, nogil=True, boundscheck=False)
def steps_ok(types: np.ndarray, discount: np.ndarray) -> int:  # pragma: no cover - compiled
    """:data:`STEPS_OK`, or :data:`BAD_STEP_TYPE` / :data:`BAD_DISCOUNT` for the first
    array (1-D, either may be empty) that holds a value the step rule forbids."""
    bad = False
    for i in range(types.shape[0]):  # no early exit: vectorised
        bad |= not step_type_ok(types[i])
    if bad:
        return BAD_STEP_TYPE
    for i in range(discount.shape[0]):
        bad |= not discount_ok(discount[i])
    return BAD_DISCOUNT if bad else STEPS_OK


@numba.njit(cache=True, nogil=True, boundscheck=False)
def values_ok(payload: np.ndarray, plan: np.ndarray) -> int:  # pragma: no cover - compiled
    """Index of the first row of ``plan`` whose values fail in the uint8 ``payload`` (its
    length a multiple of 8), or -1."""
    # The word views are made here, not passed in: fewer arrays to unbox per call.
    u8 = payload[:payload.shape[0] - payload.shape[0] % 8]
    u32, u64, f32 = u8.view(np.uint32), u8.view(np.uint64), u8.view(np.float32)
    for j in range(plan.shape[0]):
        kind, off, n = plan[j, 0], plan[j, 1], plan[j, 2]
        if n == 0:
            continue
        bad = False
        if kind == FINITE_F32:
            mask32 = np.uint32(F32_EXPONENT)
            bad = max_masked(u32[off // 4:off // 4 + n], mask32) == mask32
        elif kind == FINITE_F64:
            mask64 = np.uint64(F64_EXPONENT)
            bad = max_masked(u64[off // 8:off // 8 + n], mask64) == mask64
        elif kind == STEP_TYPES:
            types = u8[off:off + n]
            for i in range(n):
                bad |= not step_type_ok(types[i])
        elif kind == DISCOUNTS:
            discounts = f32[off // 4:off // 4 + n]
            for i in range(n):
                bad |= not discount_ok(discounts[i])
        if bad:
            return j
    return -1
