"""Constants of the kernels that modules above read at import time, without numba (each
kernel module re-exports its own: docs/internals.md, "Numpy twins and lazy kernels")."""

from __future__ import annotations

import numpy as np

# -- kernels/validate.py ---------------------------------------------------------------
MAX_STEP_TYPE = 2  # StepType.LAST
# Plan row kinds.
FINITE_F32, FINITE_F64, STEP_TYPES, DISCOUNTS = 0, 1, 2, 3
F32_EXPONENT, F64_EXPONENT = 0x7F800000, 0x7FF0000000000000  # all exponent bits: NaN or inf
# What steps_ok finds.
STEPS_OK, BAD_STEP_TYPE, BAD_DISCOUNT = 0, 1, 2

# -- kernels/add_step.py: what the one-step add returns for an input it refuses (any
# change in the number of valid starts is far smaller).
ADD_STEP_BAD_INPUT = -(1 << 62)
# -- kernels/add_step.py's add_stacked_k: a frame ring must grow first (nothing written; the
# caller grows it and calls again).
ADD_STEP_NEED_FRAMES = ADD_STEP_BAD_INPUT + 1
# -- kernels/add_step.py's add_held: added to its result when an env's episode ended (far
# above any change in the number of valid starts).
ADD_HELD_DONE = 1 << 40

# -- kernels/cast.py: the dtypes a one-step add stores, by code (floats last).
STORED_DTYPES = tuple(np.dtype(t) for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                            np.uint32, np.int64, np.uint64, np.float32, np.float64))
FIRST_FLOAT = 9  # STORED_DTYPES' first float code


def stored_code(dtype: np.dtype) -> int:
    """``dtype``'s index in :data:`STORED_DTYPES`, or -1."""
    return STORED_DTYPES.index(dtype) if dtype in STORED_DTYPES else -1


# -- kernels/keys.py: the key bit layout -------------------------------------------------
SHARD_BITS, TAG_BITS, PLACE_BITS, GEN_BITS = 10, 14, 28, 11
MAX_SHARDS = 1 << SHARD_BITS
MAX_PLACES = 1 << PLACE_BITS
NUM_TAGS = (1 << TAG_BITS) - 1  # tags are 1 .. NUM_TAGS: 0 would make small integers keys
GEN_MASK = (1 << GEN_BITS) - 1
PLACE_MASK = (1 << PLACE_BITS) - 1
TAG_MASK = (1 << TAG_BITS) - 1
SHARD_MASK = (1 << SHARD_BITS) - 1
PLACE_SHIFT = GEN_BITS
TAG_SHIFT = GEN_BITS + PLACE_BITS
SHARD_SHIFT = GEN_BITS + PLACE_BITS + TAG_BITS
LOCAL_MASK = (1 << SHARD_SHIFT) - 1  # tag, place and generation: a key without its shard

# -- kernels/sum_tree.py -------------------------------------------------------------------
ARITY = 8
PRIORITY_BLOCK = 32  # slots per block of the priority changes an incremental checkpoint tracks


_NUMBA_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def numba_takes(dtype: np.dtype) -> bool:
    """Whether compiled kernels accept arrays of ``dtype`` (not float16, long double or
    non-native byte orders)."""
    return dtype.isnative and (dtype.kind in "biu" or dtype in _NUMBA_FLOATS)
