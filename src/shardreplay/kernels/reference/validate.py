"""Twins of kernels/validate.py: step types, discounts and NaN/inf in packed payloads."""

from __future__ import annotations

import numpy as np

from shardreplay.kernels import codes


def steps_ok(types: np.ndarray, discount: np.ndarray) -> int:
    """``kernels.validate.steps_ok``."""
    if types.size and not ((types >= 0) & (types <= codes.MAX_STEP_TYPE)).all():
        return codes.BAD_STEP_TYPE
    if discount.size and not ((discount >= 0) & (discount <= 1)).all():
        return codes.BAD_DISCOUNT
    return codes.STEPS_OK


def values_ok(payload: np.ndarray, plan: np.ndarray) -> int:
    """``kernels.validate.values_ok``: the index of the first row of ``plan``
    (``(kind, byte offset, count)``) whose values fail in the uint8 ``payload`` (its
    length a multiple of 8), or -1."""
    u8 = payload[:payload.shape[0] - payload.shape[0] % 8]
    for j, (kind, off, n) in enumerate(plan.tolist()):
        if n == 0:
            continue
        if kind == codes.FINITE_F32:
            bad = not np.isfinite(u8.view(np.float32)[off // 4:off // 4 + n]).all()
        elif kind == codes.FINITE_F64:
            bad = not np.isfinite(u8.view(np.float64)[off // 8:off // 8 + n]).all()
        elif kind == codes.STEP_TYPES:
            bad = bool((u8[off:off + n] > codes.MAX_STEP_TYPE).any())  # uint8: never below FIRST
        elif kind == codes.DISCOUNTS:
            discounts = u8.view(np.float32)[off // 4:off // 4 + n]
            bad = not ((discounts >= 0) & (discounts <= 1)).all()  # NaN fails both
        else:
            bad = False
        if bad:
            return j
    return -1
